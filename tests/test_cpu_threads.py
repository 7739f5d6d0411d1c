"""The CPU engine's intra-op threads (engines/cpu/threads.py): one for a small model, and the worker's own."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.engines.cpu.threads import SMALL_HIDDEN_SIZE, threads_for
from rollout_sdk.errors import ConfigError

T = TypeVar("T")


def _in_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread: what a thread that has run no parallel op yet gets."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _model_dir(path: Path, cfg: dict[str, object]) -> Path:
    path.mkdir()
    path.joinpath("config.json").write_text(json.dumps(cfg))
    return path


def test_threads_by_model_size(tmp_path: Path, tiny_model: Path) -> None:
    assert threads_for(tiny_model, None) == 1  # hidden size 64
    assert threads_for(tiny_model, 3) == 3  # configured wins
    big = _model_dir(tmp_path / "big", {"hidden_size": SMALL_HIDDEN_SIZE})
    assert threads_for(big, None) is None  # torch's default
    vl = _model_dir(tmp_path / "vl", {"text_config": {"hidden_size": 64}, "vision_config": {"hidden_size": 1280}})
    assert threads_for(vl, None) == 1  # the language model's size
    odd = _model_dir(tmp_path / "odd", {"hidden_size": "wide"})
    assert threads_for(odd, None) is None
    assert threads_for(tmp_path / "missing", None) is None


@pytest.mark.parametrize("n", [0, -1])
def test_num_threads_below_one_is_refused(n: int) -> None:
    with pytest.raises(ConfigError, match="num_threads"):
        CpuEngineConfig(num_threads=n)


def test_engine_runs_on_one_thread_and_leaves_the_process_default(tiny_model: Path) -> None:
    """The embedded engine shares the user's process: its worker runs on one intra-op thread, while the
    process-wide default (what any other thread adopts on its first parallel op) stays what it was."""
    before = _in_fresh_thread(torch.get_num_threads)
    _in_fresh_thread(lambda: torch.set_num_threads(3))  # a default other than 1 and other than the cores
    try:
        assert _in_fresh_thread(torch.get_num_threads) == 3

        own = torch.get_num_threads()

        async def run() -> tuple[int, int, int]:
            engine = CpuEngine(CpuEngineConfig(model_path=str(tiny_model)))
            await engine.start()
            try:
                main = torch.get_num_threads()
                worker = await engine._in_worker(torch.get_num_threads)
                after = await asyncio.to_thread(_in_fresh_thread, torch.get_num_threads)
                return main, worker, after
            finally:
                await engine.close()

        main, worker, after = asyncio.run(run())
        assert worker == 1
        assert after == 3
        assert main == own  # the calling thread's own size is untouched
    finally:
        _in_fresh_thread(lambda: torch.set_num_threads(before))
