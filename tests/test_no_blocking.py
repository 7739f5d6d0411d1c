"""Nothing blocking runs on the event loop (issue 25 item 7).

A detector wraps the blocking calls this SDK could make (``time.sleep``, ``threading.Event.wait``,
``Thread.join``, waiting on a ``concurrent.futures.Future``, ``Popen.wait``, and every call on the c10d
store) and records each one made *on a thread that runs an event loop* from rollout_sdk code, with the
function that made it.  The tests run real workloads under it and assert that list is empty.  Nothing is
timed: a call is reported for what it is, not for how long it took, so a loaded machine cannot make this
fail and a fast one cannot hide a blocking call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from rollout_sdk import GenerateRequest, JobSecret, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.launch import job as job_mod
from rollout_sdk.launch.layout import Layout
from test_faults import serving

HANG_GUARD_S = 60.0  # only against a hang: no assertion depends on it


class BlockingOnLoop:
    """Records blocking calls made from rollout_sdk code on a thread that runs an event loop."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def note(self, what: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # a worker thread: blocking is what it is for
        stack = traceback.extract_stack()[:-2]
        caller = stack[-1]
        if caller.name == "start" and caller.filename.endswith("threading.py"):
            return  # Thread.start waits for the new thread to signal that it runs: a handshake, not a block
        ours = [f for f in stack if "/rollout_sdk/" in f.filename.replace("\\", "/")]
        if ours:
            f = ours[-1]
            where = f.filename.replace("\\", "/").rsplit("/rollout_sdk/", 1)[1]
            self.calls.append(f"{what} from {f.name} ({where}:{f.lineno})")

    def wrap(
        self, mp: pytest.MonkeyPatch, owner: Any, name: str, label: str, when: Callable[..., bool] | None = None
    ) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when is None or when(*args, **kwargs):
                self.note(label)
            return real(*args, **kwargs)

        mp.setattr(owner, name, wrapper)


class Watched:
    """A proxy for a c10d store: every method call is a blocking network round trip."""

    def __init__(self, store: Any, detector: BlockingOnLoop) -> None:
        self._store = store
        self._detector = detector

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._detector.note(f"store.{name}")
            return fn(*args, **kwargs)

        return call


@pytest.fixture
def blocking_on_loop(monkeypatch: pytest.MonkeyPatch) -> BlockingOnLoop:
    d = BlockingOnLoop()
    d.wrap(monkeypatch, time, "sleep", "time.sleep")
    d.wrap(monkeypatch, threading.Event, "wait", "threading.Event.wait")
    d.wrap(monkeypatch, threading.Thread, "join", "Thread.join")
    d.wrap(monkeypatch, subprocess.Popen, "wait", "Popen.wait")
    d.wrap(
        monkeypatch,
        concurrent.futures.Future,
        "result",
        "concurrent Future.result",
        when=lambda fut, *a, **k: not fut.done(),
    )
    return d


def test_the_detector_reports_a_blocking_call_from_our_code_on_the_loop(blocking_on_loop) -> None:
    """It can fail: a store call on the loop, as launch/job.py made one before issue 25, is reported."""
    store = Watched(object.__new__(_NoStore), blocking_on_loop)

    async def main() -> None:
        job_mod._try_get(store, "k")  # rollout_sdk code calling the store on the loop

    asyncio.run(main())
    assert blocking_on_loop.calls and blocking_on_loop.calls[0].startswith("store.check from _try_get")


class _NoStore:
    def check(self, keys: list[str]) -> bool:
        return False


async def test_serving_generating_control_and_shutdown_block_nothing_on_the_loop(blocking_on_loop) -> None:
    async with serving(offload_decode_bytes=10_000) as server:
        async with RolloutClient(servers=[server.address]) as client:
            sp = SamplingParams(max_new_tokens=4)
            await asyncio.gather(*(client.generate([5, 6, i], sampling=sp) for i in range(50)))
            big = await client.generate(GenerateRequest(input_ids=[1000] * 6_000, sampling=sp))  # off the loop
            assert big.prompt_tokens == 6_000
            await client.pause()
            await client.resume()
            await client.release_memory()
            await client.resume_memory()
    assert blocking_on_loop.calls == []


async def test_a_torchrun_ranks_store_calls_run_off_the_loop(blocking_on_loop, monkeypatch) -> None:
    import torch.distributed as dist

    master = await asyncio.to_thread(lambda: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    address = f"127.0.0.1:{master.port}"

    def connect(addr: str, *args: Any, **kwargs: Any) -> Watched:  # the rank's own store connections
        client = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
        return Watched(client, blocking_on_loop)

    monkeypatch.setattr(job_mod, "connect_store", connect)
    layout = Layout(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0, nnodes=1, tp=2)  # TP member
    engines = job_mod.EngineConfigs(fake=FakeEngineConfig())
    store = Watched(master, blocking_on_loop)
    rank = job_mod._RankJob(
        layout, job_mod.LaunchConfig(engine="fake"), engines, store, address, None, store_secret=JobSecret.generate()
    )
    run = asyncio.create_task(rank.run(None))
    rank.stop("the test")  # it publishes the job's shutdown (sealed), its watcher sees it, and it returns
    assert await asyncio.wait_for(run, HANG_GUARD_S) == 0
    assert blocking_on_loop.calls == []
