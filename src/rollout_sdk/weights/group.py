"""A weight-update process group spanning a trainer and engines that live in *other* torch.distributed
worlds (SGLang's scheduler processes, our CPU engine servers, the trainer's own torchrun job).

``torch.distributed.new_group`` only groups ranks of the default world, so this builds the backend
(``ProcessGroupGloo`` / ``ProcessGroupNCCL``) directly on a TCPStore rendezvous at
``master_address:master_port`` (rank 0, the trainer, hosts the store on a free port).  The store keys are
prefixed exactly as SGLang's ``init_custom_process_group`` (from PyTorch / OpenRLHF) ends up prefixing
them (``{name}`` then ``{name}/`` then ``{device}/``), so a trainer using this module and an SGLang engine
meet in one group.  Unlike that helper, nothing is registered in torch's global group table: two members
of one group can live in one process (the embedded CPU engine and its trainer), and no private torch
function is called.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..protocol import InitWeightGroup

__all__ = ["Rendezvous", "WeightGroup", "destroy_weight_group", "init_weight_group", "master_store"]


class WeightGroup:
    """Rank ``rank`` of a ``world_size`` group; only broadcast is needed."""

    def __init__(self, pg: Any, rank: int, world_size: int, backend: str) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.backend = backend

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """Blocking broadcast of ``tensor`` from ``src`` (call from a thread, never the event loop)."""

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.pg = None


def master_store(host: str, world_size: int, timeout_s: float = 300.0) -> Any:
    """The rendezvous store rank 0 hosts, on a free port (read it from ``.port``)."""

    return dist.TCPStore(  # type: ignore[attr-defined]
        host, 0, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where and how the ranks of one weight-update group meet: the settings every rank shares (the trainer
    makes them, each engine gets them in its :class:`~rollout_sdk.protocol.InitWeightGroup`)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "rollout_weights"
    backend: str = "gloo"
    timeout_s: float = 300.0

    @classmethod
    def of(cls, msg: InitWeightGroup) -> Rendezvous:
        """The settings an InitWeightGroup message carries."""
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})

    def message(self, call_id: str, rank_offset: int) -> InitWeightGroup:
        """The InitWeightGroup that asks one engine (its ranks from ``rank_offset``) to join."""
        return InitWeightGroup(call_id=call_id, rank_offset=rank_offset, **dataclasses.asdict(self))


def init_weight_group(rendezvous: Rendezvous, *, rank: int, store: Any = None) -> WeightGroup:
    """Join the group as ``rank`` (blocking until every rank joined).  Rank 0 passes the store it made with
    :func:`master_store`; the other ranks connect to ``master_address:master_port``."""

    master_address, master_port, world_size = rendezvous.master_address, rendezvous.master_port, rendezvous.world_size
    group_name, backend = rendezvous.group_name, rendezvous.backend
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    if store is None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            master_address, master_port, world_size, is_master=False, timeout=timeout
        )
    store.set_timeout(timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    prefix: Any = dist.PrefixStore  # type: ignore[attr-defined]
    prefixed = prefix(f"{device}/", prefix(f"{group_name}/", prefix(group_name, store)))
    pg: Any
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)  # type: ignore[attr-defined]
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)  # type: ignore[attr-defined]
    else:
        raise ConfigError("backend", backend, "must be 'gloo' or 'nccl'")
    return WeightGroup(pg, rank, world_size, backend)


def destroy_weight_group(group: WeightGroup) -> None:
    group.destroy()
