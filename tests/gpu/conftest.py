"""What the GPU tier's modules share: SGLang engines on dummy weights of bench/gpu_check.py's shapes.

``sglang_config(model_path, **fields)`` is the one engine configuration of these tests (dummy weights,
triton attention, pytorch sampling, seed 0); a module overrides only what it needs.  Needs a GPU and
sglang, as every module here does; the fixtures import neither until a test asks for them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

# bench/ on the path: gpu_check.py builds the checkpoint shapes (model_dir) and the trainer's weights (hf_named)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


@pytest.fixture(scope="session")
def qwen_05b_dir() -> str:
    """A Qwen2.5-0.5B-shaped checkpoint folder (config and tokenizer; the engines load dummy weights)."""
    from gpu_check import model_dir  # type: ignore[import-not-found]

    return str(model_dir("0.5b"))


@pytest.fixture(scope="session")
def sglang_config() -> Callable[..., Any]:
    """``make(model_path, **fields)``: the SglangEngineConfig of a GPU test; ``fields`` override the defaults."""

    def make(model_path: str, **fields: Any) -> Any:
        from rollout_sdk.engines.sglang import SglangEngineConfig

        base: dict[str, Any] = dict(
            model_path=model_path,
            load_format="dummy",
            attention_backend="triton",
            sampling_backend="pytorch",
            mem_fraction_static=0.5,
            cuda_graph_max_bs=64,
            random_seed=0,
        )
        return SglangEngineConfig(**(base | fields))

    return make
