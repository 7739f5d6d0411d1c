"""What a :class:`~rollout_sdk.client.RolloutClient` reports: ``ServerStatus`` per server, ``ClientStats``
for the whole client (``client.stats()``), and how a status is read off a connection."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .connection import ServerConnection

__all__ = ["ClientStats", "ServerStatus", "percentile", "server_status"]


class ServerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One server as this client sees it."""

    address: str
    server_id: str
    #: the server process (a restarted server at the same address is a new member with a new one)
    incarnation: str
    alive: bool
    dead_reason: str
    #: routed to (it serves the fleet's weight version); ``admission`` says why not
    admitted: bool
    admission: str
    #: ``remove_server`` was called: it takes no new work
    removing: bool
    in_flight: int
    engine_running: int
    engine_queued: int
    sent: int
    completed: int
    aborted: int
    errors: int
    failed_over: int
    weight_version: int
    latency_p50_s: float | None
    #: capacity and KV use as the engine reports them (ServerStats documents each); None: unknown / no limit
    engine_max_running: int | None = None
    engine_kv_capacity_tokens: int | None = None
    engine_kv_used_tokens: int | None = None
    engine_kv_usage: float | None = None
    #: seconds since these engine numbers arrived (the last Pong); None before the first
    stats_age_s: float | None = None


class ClientStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the client: per-server status, totals, latency percentiles (seconds)."""

    servers: list[ServerStatus]
    in_flight: int
    waiting: int
    completed: int
    aborted: int
    errors: int
    retried: int
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_p99_s: float | None
    #: sessions that moved to another server (theirs left, filled up or waits for weights), and the prompt
    #: tokens of the requests that moved, whose cached prefix stayed behind
    sessions_moved: int = 0
    prefix_tokens_lost: int = 0
    #: members that left for good (removed, or replaced by a restarted process), newest last, with the
    #: counters of the work they did
    retired: list[ServerStatus] = []


def server_status(c: ServerConnection) -> ServerStatus:
    """One member (or retired member) as the client sees it now."""
    return ServerStatus(
        address=c.address,
        server_id=c.server_id,
        incarnation=c.incarnation,
        alive=c.alive,
        dead_reason=c.dead_reason,
        admitted=c.admitted,
        admission=c.admission,
        removing=c.removing,
        in_flight=c.in_flight,
        engine_running=c.stats.running if c.stats else 0,
        engine_queued=c.stats.queued if c.stats else 0,
        engine_max_running=c.stats.max_running_requests if c.stats else None,
        engine_kv_capacity_tokens=c.stats.kv_capacity_tokens if c.stats else None,
        engine_kv_used_tokens=c.stats.kv_used_tokens if c.stats else None,
        engine_kv_usage=c.stats.kv_usage if c.stats else None,
        stats_age_s=c.stats_age_s,
        sent=c.sent,
        completed=c.completed,
        aborted=c.aborted,
        errors=c.errors,
        failed_over=c.failed_over,
        weight_version=c.reported_version,
        latency_p50_s=percentile(sorted(c.latencies), 0.5),
    )


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of an ascending sequence (None when empty)."""
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[i]
