"""Flattened buckets: many tensors sent as one byte buffer per collective.

A bucket is its tensors' bytes back to back (each ``tensor.flatten().view(torch.uint8)``, in order), the
layout SGLang's ``FlattenedTensorBucket`` uses, so one ``broadcast`` per bucket feeds SGLang's
``load_format="flattened_bucket"`` as well as our CPU engine.  Buckets are cut at ``bucket_bytes``
(hundreds of MB by default): one collective per tensor is what made other weight syncs 100x slower.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..protocol import TensorMeta

__all__ = ["DTYPE_NAMES", "Bucket", "plan_buckets", "receive_buckets", "send_buckets", "torch_dtype", "unflatten"]

DEFAULT_BUCKET_BYTES = 512 << 20


#: the dtypes a weight update may name; a name from the wire is looked up here, never on the torch module
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (one of :data:`DTYPE_NAMES`); InvalidRequestError otherwise."""

    table = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }
    dtype = table.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise InvalidRequestError("dtype", name, f"must be one of {', '.join(DTYPE_NAMES)}")
    return dtype


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Bucket:
    tensors: list[tuple[str, torch.Tensor]]

    @property
    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, _dtype_name(t), list(t.shape)) for n, t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def flatten(self) -> torch.Tensor:
        return torch.cat([t.detach().contiguous().flatten().view(torch.uint8) for _, t in self.tensors])


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            buckets.append(Bucket(cur))
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        buckets.append(Bucket(cur))
    return buckets


def _nbytes(meta: TensorMeta) -> int:
    dtype = torch_dtype(meta.dtype)
    numel = 1
    for d in meta.shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


def unflatten(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` (uint8) as the tensors ``metas`` describe."""

    out = []
    start = 0
    for m in metas:
        n = _nbytes(m)
        out.append((m.name, flat[start : start + n].view(torch_dtype(m.dtype)).reshape(m.shape)))
        start += n
    if start != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, its tensors {start}")
    return out


def send_buckets(group: Any, buckets: Sequence[Bucket], device: Any = None) -> None:
    """Broadcast every bucket from rank 0 of ``group`` (blocking: call from a thread)."""
    for b in buckets:
        flat = b.flatten()
        if device is not None:
            flat = flat.to(device)
        group.broadcast(flat, src=0)


def receive_buckets(group: Any, buckets: Sequence[Sequence[TensorMeta]], device: Any = None) -> list[tuple[str, Any]]:
    """Receive what :func:`send_buckets` sends (blocking: call from a thread)."""

    out: list[tuple[str, Any]] = []
    for metas in buckets:
        flat = torch.empty(sum(_nbytes(m) for m in metas), dtype=torch.uint8, device=device)
        group.broadcast(flat, src=0)
        out.extend(unflatten(flat, metas))
    return out
