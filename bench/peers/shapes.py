"""The model every GPU bench (and tests/gpu) starts: a Qwen2.5-shaped config with dummy weights.

* :func:`model_dir` -- a folder with just the ``config.json`` of a shape (``0.5b``, ``7b``): SGLang loads it
  with ``load_format="dummy"``, so no checkpoint is downloaded;
* :func:`dummy_engine_config` -- the ``SglangEngineConfig`` the GPU benches start on it;
* :func:`hf_named` -- the trainer's side: random bf16 weights under the HF parameter names of the shape.

bench/gpu_check.py re-exports these names (bench/gpu_inflight.py and tests/gpu import them from there).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

SHAPES = {  # Qwen2.5 shapes
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_window_layers=21,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_window_layers=28,
    ),
}


def model_dir(shape: str) -> str:
    d = tempfile.mkdtemp(prefix=f"qwen2-{shape}-")
    cfg = dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        sliding_window=32768,
        use_sliding_window=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=151643,
        eos_token_id=151645,
        use_cache=True,
        torch_dtype="bfloat16",
        **SHAPES[shape],
    )
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return d


def dummy_engine_config(a: argparse.Namespace, model_path: str, *, extra: dict[str, Any], **fields: Any) -> Any:
    """The SglangEngineConfig the GPU benches start: dummy weights of ``model_path``, the bench's ``--attn``,
    ``--sampling``, ``--mem-fraction`` and ``--graph-bs``, seed 0, prefill CUDA graphs off (plus ``extra``);
    ``fields`` set or override any other field."""
    from rollout_sdk.engines.sglang import SglangEngineConfig

    base: dict[str, Any] = dict(
        model_path=model_path,
        load_format="dummy",
        attention_backend=a.attn,
        sampling_backend=a.sampling,
        mem_fraction_static=a.mem_fraction,
        cuda_graph_max_bs=a.graph_bs,
        random_seed=0,
    )
    return SglangEngineConfig(**(base | fields), extra={"disable_prefill_cuda_graph": True, **extra})


def hf_named(shape: str, device: str) -> list[tuple[str, Any]]:
    """Random bf16 weights under the HF parameter names of the shape (norms 1): the trainer's side."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir(shape))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator(device=device).manual_seed(1)
    out = []
    for name, p in meta.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(p.shape, generator=g, dtype=torch.float32, device=device).to(torch.bfloat16) * 0.02
        out.append((name, t))
    return out
