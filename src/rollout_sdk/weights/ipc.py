"""Colocated weight updates: CUDA IPC handles of flattened buckets, described by a msgspec struct.

The trainer shares a bucket's GPU buffer by handle (``export_cuda_ipc``), the handle's fields cross ZMQ in
our own struct (no pickle on our wire), and the engine server turns them into the payload SGLang's
``update_weights_from_tensor(load_format="flattened_bucket")`` expects (``sglang_bucket_payload``) without
opening the memory itself: SGLang's scheduler, on the same GPU, maps it.  The device travels as its UUID
(what SGLang's patched rebuild accepts), so differing ``CUDA_VISIBLE_DEVICES`` do not matter.  The trainer
must keep the buffer alive until the update call returns.

Nothing in a handle chooses code: the storage class and the dtypes are looked up in fixed allowlists
(:data:`STORAGE_CLASSES`, :func:`~rollout_sdk.weights.buckets.torch_dtype`), never imported by name, so a
message cannot make the server (or SGLang's unpickler, which receives what we build) load a module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch.multiprocessing import reductions

from ..errors import InvalidRequestError
from ..protocol import TensorMeta
from .buckets import torch_dtype

__all__ = ["STORAGE_CLASSES", "CudaIpcHandle", "export_cuda_ipc", "sglang_bucket_payload", "storage_class"]

#: the storage classes ``torch.multiprocessing.reductions.reduce_tensor`` reports for a CUDA tensor
STORAGE_CLASSES = ("torch.storage.TypedStorage", "torch.storage.UntypedStorage")


def storage_class(name: str) -> Any:
    """The storage class named ``name`` (one of :data:`STORAGE_CLASSES`); InvalidRequestError otherwise."""

    table = {
        "torch.storage.TypedStorage": torch.storage.TypedStorage,
        "torch.storage.UntypedStorage": torch.UntypedStorage,
    }
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidRequestError("handles[].storage_cls", name, f"must be one of {', '.join(STORAGE_CLASSES)}")
    return cls


class CudaIpcHandle(msgspec.Struct, frozen=True, array_like=True):
    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device_uuid: str
    storage_cls: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def export_cuda_ipc(t: torch.Tensor) -> bytes:
    """The IPC handle of a CUDA tensor, encoded (trainer side)."""

    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    _, args = reduce(t)
    (_, size, stride, offset, storage_cls, dtype, device, handle, ssize, soff, _, rc_handle, rc_off, ev, ev_sync) = args
    if isinstance(device, int):
        device = str(torch.cuda.get_device_properties(device).uuid)
    return msgspec.msgpack.encode(
        CudaIpcHandle(
            size=list(size),
            stride=list(stride),
            offset=int(offset),
            dtype=str(dtype).removeprefix("torch."),
            device_uuid=str(device),
            storage_cls=f"{storage_cls.__module__}.{storage_cls.__qualname__}",
            storage_handle=bytes(handle),
            storage_size_bytes=int(ssize),
            storage_offset_bytes=int(soff),
            ref_counter_handle=bytes(rc_handle),
            ref_counter_offset=int(rc_off),
            event_handle=bytes(ev) if ev is not None else None,
            event_sync_required=bool(ev_sync),
        )
    )


class _Rebuild:
    """Pickles as ``torch.multiprocessing.reductions.rebuild_cuda_tensor(*args)`` without touching CUDA."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (reductions.rebuild_cuda_tensor, self.args)


def sglang_bucket_payload(handle: bytes, metas: Sequence[TensorMeta]) -> bytes:
    """SGLang's serialized flattened-bucket payload for a bucket shared by IPC (server side)."""
    try:
        h = msgspec.msgpack.decode(handle, type=CudaIpcHandle)
    except msgspec.MsgspecError as exc:
        raise InvalidRequestError("handles[]", f"<{len(handle)} bytes>", f"not a CUDA IPC handle: {exc}") from exc
    storage_cls = storage_class(h.storage_cls)  # checked before anything else is imported or built
    tensor_dtype = torch_dtype(h.dtype)
    dtypes = [torch_dtype(m.dtype) for m in metas]
    from sglang.srt.utils import MultiprocessingSerializer  # optional: sglang
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata  # optional: sglang

    args = (
        torch.Tensor,
        torch.Size(h.size),
        tuple(h.stride),
        h.offset,
        storage_cls,
        tensor_dtype,
        h.device_uuid,
        h.storage_handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        False,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    metadata = []
    start = 0
    for m, dtype in zip(metas, dtypes, strict=True):
        numel = 1
        for d in m.shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        metadata.append(
            FlattenedTensorMetadata(
                name=m.name,
                shape=torch.Size(m.shape),
                dtype=dtype,
                start_idx=start,
                end_idx=start + nbytes,
                numel=nbytes,
            )
        )
        start += nbytes
    payload: bytes = MultiprocessingSerializer.serialize({"flattened_tensor": _Rebuild(args), "metadata": metadata})
    return payload
