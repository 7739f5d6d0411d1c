"""The DP x TP layout of a torchrun job, read from torchrun's environment.

Ranks are laid out TP-innermost: TP group ``d`` holds global ranks ``[d * tp, (d + 1) * tp)``, so a TP
group sits on consecutive local ranks (one node's GPUs) whenever ``tp`` divides ``nproc_per_node``.
Rank 0 of each TP group (``tp_rank == 0``) is its *leader*: it runs the engine server of DP rank ``d``.

::

    world = 4, tp = 2            dp_rank:   0        1
                                 ranks:   [0, 1]   [2, 3]
                                 leaders:  0        2     (each serves one engine spanning its TP group)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["Layout"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError("tp", self.tp, "must be >= 1")
        if self.world_size % self.tp:
            raise ConfigError("tp", self.tp, f"must divide the world size ({self.world_size})")

    @classmethod
    def from_env(cls, tp: int, env: Mapping[str, str] | None = None) -> Layout:
        env = os.environ if env is None else env
        missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in env]
        if missing:
            raise ConfigError(
                "environment",
                missing,
                "not set: run this under torchrun (torchrun --standalone --nproc-per-node N ...)",
            )
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return cls(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=local_world,
            node_rank=int(env.get("GROUP_RANK", "0")),
            nnodes=max(1, world // max(1, local_world)),
            tp=tp,
        )

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def leader_rank(self) -> int:
        return self.dp_rank * self.tp

    @property
    def tp_ranks(self) -> list[int]:
        return list(range(self.leader_rank, self.leader_rank + self.tp))

    @property
    def tp_spans_nodes(self) -> bool:
        return self.tp > self.local_world_size

    def describe(self) -> str:
        role = "leader" if self.is_leader else "member"
        return (
            f"rank {self.rank}/{self.world_size} node {self.node_rank}/{self.nnodes} local {self.local_rank}: "
            f"dp {self.dp_rank}/{self.dp} tp {self.tp_rank}/{self.tp} ({role})"
        )
