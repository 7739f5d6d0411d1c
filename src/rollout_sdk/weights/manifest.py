"""What an engine accepts as weights: the HF parameter names and shapes, checked before anything loads.

An update is all-or-nothing: every tensor of it is checked against the model's manifest first, and one
unknown name or wrong shape refuses the whole update with the old weights kept.  SGLang itself would not
(an unknown name is logged and skipped, a wrong shape fails half way through a bucket), so the SGLang
engine checks here before it hands anything over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..protocol import TensorMeta

__all__ = ["check_metas", "hf_parameter_shapes", "parameter_shapes"]

Shapes = Mapping[str, tuple[int, ...]]


def parameter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Every name a checkpoint may use for ``model``'s parameters, tied ones under each of their names."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        shapes.setdefault("lm_head.weight", tuple(in_emb.weight.shape))
    return shapes


def hf_parameter_shapes(model_path: str, *, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """The manifest of the HF model at ``model_path``, built from its config on the meta device (no memory,
    no weights read): the names and full (unsharded) shapes a trainer sends."""
    cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)  # type: ignore[no-untyped-call]
    return parameter_shapes(model)


def check_metas(shapes: Shapes, buckets: Iterable[Sequence[TensorMeta]], *, limit: int = 5) -> list[str]:
    """What is wrong with an update of these tensors (empty: it may load).  At most ``limit`` problems."""
    problems: list[str] = []
    for bucket in buckets:
        for meta in bucket:
            want = shapes.get(meta.name)
            if want is None:
                problems.append(f"unknown parameter {meta.name!r}")
            elif tuple(meta.shape) != want:
                problems.append(f"parameter {meta.name!r}: shape {tuple(meta.shape)} does not match {want}")
            if len(problems) >= limit:
                return problems
    return problems
