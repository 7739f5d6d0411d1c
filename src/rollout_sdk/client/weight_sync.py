"""The trainer-facing control plane: fan a control message out to every server, and weight sync.

Weight sync (distributed)::

    trainer (this process, group rank 0)              engine server k (ranks offset_k .. offset_k+tp_k-1)
    ───────────────────────────────────              ──────────────────────────────────────────────────
    init_weight_sync():
      master TCPStore on a free port ─────────────▶  InitWeightGroup(address, port, offset_k, world)
      join the group (thread) ◀──── rendezvous ────▶  engine joins (SGLang: its TP workers)
    update_weights(named, version):
      [pause(mode)]
      plan flattened buckets (bucket_bytes each)
      UpdateWeightsDistributed(metas of all buckets) ▶ engine posts one receive per bucket
      broadcast bucket 1..n (thread) ────────────────▶ engine loads each bucket
      await every server's reply (version applied)
      [resume()]

A server that reports ``applied=None`` (part of its weights changed) is marked dead for this client: it
is never silently half-updated.  Collectives run in threads; the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, WeightUpdateError
from ..protocol import (
    ControlReply,
    ControlRequest,
    DestroyWeightGroup,
    InflightMode,
    PauseGeneration,
    ResumeGeneration,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
    flushes,
)

if TYPE_CHECKING:
    import torch

    from .connection import ServerConnection

__all__ = ["WeightSync", "WeightSyncSettings", "broadcast_control"]

log = logging.getLogger("rollout_sdk.client")


async def broadcast_control(
    servers: Sequence[ServerConnection],
    make: Callable[[ServerConnection], ControlRequest],
    *,
    timeout: float | None = None,
) -> list[ControlReply]:
    """Send one control message to each server concurrently; raise the first error after all answered."""
    results = await asyncio.gather(*(s.call(make(s), timeout) for s in servers), return_exceptions=True)
    errors = [(s, r) for s, r in zip(servers, results, strict=True) if isinstance(r, BaseException)]
    for s, err in errors:
        if isinstance(err, WeightUpdateError) and err.applied is None:
            s.mark_dead(f"weights partially updated, engine unusable: {err}")
    if errors:
        if len(errors) > 1:
            log.error("control failed on %d servers: %s", len(errors), [f"{s.server_id}: {e}" for s, e in errors])
        raise errors[0][1]
    return [r for r in results if isinstance(r, ControlReply)]


@dataclass(frozen=True, kw_only=True)
class WeightSyncSettings:
    """How the trainer's weight group is made; the defaults of :meth:`RolloutClient.init_weight_sync`.

    Kept by the client so that the group can be re-formed the same way when the fleet changes (a member
    died, a newcomer joined): only the group's name changes then (:meth:`regrouped`).
    """

    backend: str = "gloo"  # "nccl" with device="cuda:N" on GPUs; gloo moves CPU tensors
    master_address: str = "127.0.0.1"
    group_name: str = "rollout_weights"
    device: Any = None
    timeout_s: float = 300.0

    def regrouped(self, generation: int) -> WeightSyncSettings:
        """The same settings for the ``generation``-th re-formed group (a process group's name is single-use)."""
        return replace(self, group_name=f"{self.group_name}.{generation}")


@dataclass
class WeightSync:
    """A weight-update process group between this trainer (rank 0) and a set of engine servers."""

    group: Any
    settings: WeightSyncSettings
    servers: list[ServerConnection]
    world_size: int
    _store: Any = field(default=None, repr=False)

    @property
    def group_name(self) -> str:
        return self.settings.group_name

    @property
    def backend(self) -> str:
        return self.settings.backend

    @property
    def device(self) -> Any:
        return self.settings.device

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s

    @classmethod
    async def create(cls, servers: Sequence[ServerConnection], settings: WeightSyncSettings) -> WeightSync:
        from ..weights.group import Rendezvous, init_weight_group, master_store  # door: torch

        if not servers:
            raise ConfigError("servers", [], "no live server to sync weights with")
        timeout_s = settings.timeout_s
        tps = [s.info.tp_size if s.info is not None else 1 for s in servers]
        world = 1 + sum(tps)
        store = await asyncio.to_thread(master_store, settings.master_address, world, timeout_s)
        port = int(store.port)
        offsets = [1 + sum(tps[:i]) for i in range(len(servers))]
        by_id = {id(s): off for s, off in zip(servers, offsets, strict=True)}
        rendezvous = Rendezvous(
            master_address=settings.master_address,
            master_port=port,
            world_size=world,
            group_name=settings.group_name,
            backend=settings.backend,
            timeout_s=timeout_s,
        )
        join = asyncio.ensure_future(asyncio.to_thread(init_weight_group, rendezvous, rank=0, store=store))
        try:
            await broadcast_control(
                servers, lambda s: rendezvous.message(s.next_call_id(), by_id[id(s)]), timeout=timeout_s
            )
        except BaseException:
            join.cancel()
            raise
        group = await join
        return cls(group, settings, list(servers), world, store)

    async def update(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None,
        bucket_bytes: int,
        flush_cache: bool | None = None,
        inflight: InflightMode = "reprefill",
    ) -> dict[str, float]:
        """Broadcast ``named`` in flattened buckets; every server loads them and takes ``version``."""
        from ..weights.buckets import plan_buckets, send_buckets  # door: torch

        t0 = time.perf_counter()
        buckets = plan_buckets(named, bucket_bytes)
        if not buckets:
            raise WeightUpdateError("no tensors to send", applied=False)
        metas = [b.metas for b in buckets]
        live = [s for s in self.servers if s.alive]
        if len(live) != len(self.servers):
            gone = [s.server_id for s in self.servers if not s.alive]
            raise WeightUpdateError(
                f"servers {gone} left the weight group (dead); create a new sync with init_weight_sync()",
                applied=False,
            )
        send = asyncio.ensure_future(asyncio.to_thread(send_buckets, self.group, buckets, self.device))
        try:
            await broadcast_control(
                live,
                lambda s: UpdateWeightsDistributed(
                    call_id=s.next_call_id(),
                    group_name=self.group_name,
                    buckets=metas,
                    version=version,
                    flush_cache=flush_cache,
                    inflight=inflight,
                ),
                timeout=self.timeout_s,
            )
        finally:
            await send
        return {
            "seconds": time.perf_counter() - t0,
            "bytes": float(sum(b.nbytes for b in buckets)),
            "buckets": float(len(buckets)),
        }

    async def close(self) -> None:
        from ..weights.group import destroy_weight_group  # door: torch

        live = [s for s in self.servers if s.alive]
        try:
            await broadcast_control(
                live, lambda s: DestroyWeightGroup(call_id=s.next_call_id(), group_name=self.group_name)
            )
        finally:
            await asyncio.to_thread(destroy_weight_group, self.group)


async def update_weights_ipc(
    servers: Sequence[ServerConnection],
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int | None,
    bucket_bytes: int,
    flush_cache: bool | None = None,
    inflight: InflightMode = "reprefill",
    hold: bool = True,
) -> dict[str, float]:
    """Colocated: share CUDA buckets by IPC handle with engines on this GPU (no copy through the host).

    One bucket at a time, so the extra GPU memory is one bucket.  A failure after the first bucket leaves
    the engines part updated: they report it (``applied=None``) and are marked dead.
    """
    from ..weights.buckets import plan_buckets  # door: torch

    t0 = time.perf_counter()
    buckets = plan_buckets(named, bucket_bytes)
    if not buckets:
        raise WeightUpdateError("no tensors to send", applied=False)
    # one bucket per message: in between, nothing may decode on weights half old, half new (its tokens
    # would carry the old version): the engines hold their requests from the first bucket to the last
    held = hold and len(buckets) > 1
    if held:
        await broadcast_control(servers, lambda s: PauseGeneration(s.next_call_id(), "in_place"))
    try:
        await _send_ipc_buckets(servers, buckets, version=version, flush_cache=flush_cache, inflight=inflight)
    finally:
        if held:
            await broadcast_control(servers, lambda s: ResumeGeneration(s.next_call_id()))
    return {"seconds": time.perf_counter() - t0, "bytes": float(sum(b.nbytes for b in buckets))}


async def _send_ipc_buckets(
    servers: Sequence[ServerConnection],
    buckets: list[Any],
    *,
    version: int | None,
    flush_cache: bool | None,
    inflight: InflightMode,
) -> None:
    import torch  # door: torch

    from ..weights.ipc import export_cuda_ipc  # door: torch

    for i, bucket in enumerate(buckets):
        flat = bucket.flatten()
        if not flat.is_cuda:
            raise WeightUpdateError("colocated (IPC) updates need CUDA tensors", applied=False if i == 0 else None)
        handle = export_cuda_ipc(flat)
        torch.cuda.current_stream(flat.device).synchronize()
        last = i == len(buckets) - 1

        def message(s: ServerConnection, h: bytes = handle, b: Any = bucket, last: bool = last) -> UpdateWeightsFromIpc:
            return UpdateWeightsFromIpc(
                call_id=s.next_call_id(),
                handles=[h],
                buckets=[b.metas],
                version=version if last else None,
                flush_cache=flushes(inflight, flush_cache) and last,
                inflight=inflight if last else "keep",  # the version (and the re-keying) comes with the last
            )

        await broadcast_control(servers, message)
        del flat  # the engines copied it into their weights
