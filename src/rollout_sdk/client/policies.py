"""Routing policies: which live server with a free slot gets the next request.

A policy sees only servers that are alive and below their in-flight cap, and returns one of them.
Session affinity and back-pressure are the scheduler's job, not the policy's.

* :class:`LeastLoad` — the fewest requests in flight now (this client's, plus what other clients hold
  there as of the last heartbeat), ties broken by outstanding tokens, then by a fixed per-client order of
  the servers.  Because the count drops when a request completes, a slow server holds its requests longer
  and so receives fewer: its share follows its speed (Little's law), not a lifetime tally — as long as
  placements keep happening: with work arriving continuously, or with requests waiting in the client
  (``max_in_flight_per_server`` near the engine's batch size).  A burst that fits under the cap at once is
  placed at once, evenly by count (bench/load_balance.py measures both).  The fixed
  order keeps a lightly loaded client on the same warm server (bench/dispatch.py: rotating over idle
  servers cost ~30% at concurrency 1) while its random start spreads several clients apart.
* :class:`RoundRobin` — the next server in a fixed rotation; the baseline a benchmark compares against.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..protocol import GenerateRequest
    from .connection import ServerConnection as ServerHandle

__all__ = ["LeastLoad", "Policy", "RoundRobin", "make_policy"]


class Policy(Protocol):
    """Chooses a server for a request among live servers with a free slot."""

    name: str

    def choose(self, candidates: Sequence[ServerHandle], req: GenerateRequest) -> ServerHandle:
        """Pick one of ``candidates`` (never empty)."""
        ...


class LeastLoad:
    """Fewest requests in flight (this client's and others'), then fewest outstanding tokens."""

    name = "least_load"

    def __init__(self, *, seed: int | None = None) -> None:
        self._offset = random.Random(seed).randrange(1 << 16)

    def choose(self, candidates: Sequence[ServerHandle], req: GenerateRequest) -> ServerHandle:
        off = self._offset
        return min(candidates, key=lambda h: (h.load, h.outstanding_tokens, (h.index + off) % 65536))


class RoundRobin:
    """Servers in a fixed rotation, skipping full ones: the baseline for benchmarks."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[ServerHandle], req: GenerateRequest) -> ServerHandle:
        # rotate over server indices (not over the candidate list), skipping servers that are full
        span = max(h.index for h in candidates) + 1
        chosen = min(candidates, key=lambda h: (h.index - self._next) % span)
        self._next = chosen.index + 1
        return chosen


def make_policy(name: str | Policy) -> Policy:
    if not isinstance(name, str):
        return name
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()

    raise ConfigError("policy", name, "must be 'least_load', 'round_robin' or a Policy object")
