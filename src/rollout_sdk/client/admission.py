"""Admission from the engine's capacity: how many requests one client keeps in flight on one server.

A fixed per-server cap is the wrong control for an RL rollout: the right number depends on the engine's
running-request limit, its KV pool and the workload (measured on an H200: a cap of 512 cost 10-35% on
GRPO-shaped and short-request work against an engine that runs 4,096 requests at once).  So each
connection owns an :class:`AdmissionController` that turns the server's reported capacity and live
pressure into a *limit*, re-computed on every heartbeat (Pong)::

    Pong(stats) ──▶ observe(...) ──▶ limit ──▶ Scheduler._try_take: a server takes a request while
                                               this client's in_flight < limit

The rule (all numbers per server, from the latest Pong):

* **capacity known** (the engine reports ``max_running``): keep the engine saturated with a queue behind
  its running batch (by default one more running batch), so finishing requests are replaced from the
  engine's own queue without a client round trip, even when a whole wave finishes at once::

      target = max_running + queue          queue = max(min_queue, ceil(queue_fraction * max_running))

* **KV-bound** (``kv_usage >= kv_high`` while the engine already queues requests): the engine cannot
  start more than it runs, so more requests there would only wait in its queue where no other server
  can take them: ``target = running + min_queue``.  The state holds until ``kv_usage`` falls below
  ``kv_low`` (hysteresis, so a limit does not flap on every heartbeat).
* **other clients**: what the server holds for others (its in-flight count minus ours) is subtracted.
* **capacity unknown** (an engine that reports none): the fixed ``fallback`` (512, the old default).
* the user's ``max_in_flight_per_server``, when set, is a **ceiling** on all of the above; the limit is
  never below ``min_limit``.

Sync and loop-local: called from the connection's reader, read by the scheduler; no task, no lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["AdmissionConfig", "AdmissionController"]


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """How a client sizes its in-flight window per server (see the module docstring)."""

    #: a hard ceiling on the window (``max_in_flight_per_server``); None: the engine's capacity alone
    ceiling: int | None = None
    #: the window while the server has not reported its capacity
    fallback: int = 512
    #: queue kept behind the engine's running batch, as a fraction of its running limit (1.0: a whole
    #: running batch waits behind the running one, so a wave of requests finishing at once is replaced
    #: from the engine's own queue, not through a client round trip) ...
    queue_fraction: float = 1.0
    #: ... and at least this many requests
    min_queue: int = 32
    #: KV usage at or above which a server that already queues is treated as KV-bound ...
    kv_high: float = 0.92
    #: ... until its KV usage falls below this
    kv_low: float = 0.80
    #: the window is never smaller than this (a server must always make progress)
    min_limit: int = 1

    def __post_init__(self) -> None:
        if self.ceiling is not None and self.ceiling < 1:
            raise ConfigError("max_in_flight_per_server", self.ceiling, "must be >= 1 or None")
        if self.fallback < 1:
            raise ConfigError("admission.fallback", self.fallback, "must be >= 1")
        if not 0.0 <= self.queue_fraction <= 16.0:
            raise ConfigError("admission.queue_fraction", self.queue_fraction, "must be in [0, 16]")
        if self.min_queue < 0:
            raise ConfigError("admission.min_queue", self.min_queue, "must be >= 0")
        if not 0.0 < self.kv_low <= self.kv_high <= 1.0:
            raise ConfigError("admission.kv_low", (self.kv_low, self.kv_high), "needs 0 < kv_low <= kv_high <= 1")
        if self.min_limit < 1:
            raise ConfigError("admission.min_limit", self.min_limit, "must be >= 1")


class AdmissionController:
    """The in-flight window of one client on one server.  ``limit`` is what the scheduler reads."""

    __slots__ = ("config", "kv_bound", "limit", "max_running", "target")

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.max_running: int | None = None  # the engine's running limit, once reported
        self.kv_bound = False
        self.target = self.config.fallback  # the whole server's window, before others are subtracted
        self.limit = self._clamp(self.config.fallback)

    def __repr__(self) -> str:
        return f"<AdmissionController limit={self.limit} max_running={self.max_running} kv_bound={self.kv_bound}>"

    def _clamp(self, n: int) -> int:
        cfg = self.config
        if cfg.ceiling is not None:
            n = min(n, cfg.ceiling)
        return max(cfg.min_limit, n)

    def observe(
        self,
        *,
        max_running: int | None,
        running: int,
        queued: int,
        kv_usage: float | None,
        others: int,
    ) -> bool:
        """Re-compute the window from one heartbeat.  ``others``: requests the server holds for other
        clients.  Returns True when the window grew (the scheduler then wakes a waiting request)."""
        cfg = self.config
        old = self.limit
        if max_running is None or max_running <= 0:
            self.max_running = None
            self.kv_bound = False
            self.target = cfg.fallback
        else:
            self.max_running = max_running
            if kv_usage is not None:
                if kv_usage >= cfg.kv_high and queued > 0:
                    self.kv_bound = True
                elif kv_usage < cfg.kv_low:
                    self.kv_bound = False
            queue = max(cfg.min_queue, math.ceil(cfg.queue_fraction * max_running))
            if self.kv_bound:
                self.target = max(0, running) + cfg.min_queue
            else:
                self.target = max_running + queue
        self.limit = self._clamp(self.target - max(0, others))
        return self.limit > old
