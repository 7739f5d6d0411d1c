"""The in-process scheduler: one coroutine per request, dispatched to a server chosen by policy.

Concurrency (everything on the client's event loop; no thread, no lock)::

    caller coroutine (one per request: the caller's own ``await client.generate(...)``)
      │
      ├─ acquire() ......... takes a slot on a live server now, or waits in the client:
      │                        waits on: its waiter event (FIFO queue, bounded by max_waiting;
      │                                  QueueFullError beyond it)
      │                        unblocked by: release() of any slot, a server coming back (one waiter
      │                                      woken), a server dying (all woken, to re-check or fail)
      │                        bound: each server's admission window (admission.py: the engine's
      │                               running limit plus a short queue, less when KV-bound, capped by
      │                               max_in_flight_per_server when set); the rest wait here
      ├─ submit ............ one non-blocking ZMQ send
      ├─ await result ...... waits on: the future the connection's reader completes
      │                        unblocked by: the reply, the server being marked dead (socket dropped,
      │                                      heartbeat missed, engine dead), or cancellation
      │                        on cancel / timeout: Abort(rid) goes to the server, the slot is freed
      │                        on server death: a *suspect* from then on, retried on another server
      │                                      (a fresh budget: the death uses none of ``retries``, unless
      │                                      retries=0), at most one suspect in flight per server; a
      │                                      suspect whose server dies too is PoisonRequestError, never
      │                                      retried (so a poison request kills at most 2 engines, and
      │                                      an innocent never shares a server with it as a suspect)
      │                        on busy: the server is held for a back-off; acquire again (waits, or
      │                                 goes elsewhere); no retry is used up
      └─ release() ......... frees the slot, wakes the first waiter

Held servers (paused, memory released, busy) take no new request: callers wait in acquire(), bounded by
their own timeout (none by default: until the fleet is resumed).  A rid is in flight at most once per
client: a second request with it fails with DuplicateRequestError and the first is untouched.

Placement: a request with a ``session_id`` goes back to the server that served the session before
(prefix cache) unless that server's load exceeds ``(1 + affinity_margin) * min_load + affinity_slack``
or it no longer takes work (dead, removed, waiting for weights); then the session moves to the server the
policy picks, once, and the move is counted (``sessions_moved``, and the prompt tokens whose cached prefix
stays behind, ``prefix_tokens_lost``).  Everything else goes where the policy says.

The server set changes at run time (``add`` / ``remove``): a request only ever sees the servers that take
work at the moment it is placed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from ..errors import (
    ConfigError,
    DuplicateRequestError,
    EngineDeadError,
    NoServersError,
    PoisonRequestError,
    QueueFullError,
    ServerBusyError,
    ServerShuttingDownError,
    ServerUnavailableError,
)
from ..protocol import GenerateRequest, GenerateResult, Lifecycle
from ..protocol.checks import check_config_types
from .admission import AdmissionConfig
from .connection import ServerConnection
from .policies import Policy, make_policy

__all__ = ["Scheduler", "SchedulerConfig", "ServerHandle"]

#: what policies see
ServerHandle = ServerConnection

_RETRYABLE = (ServerUnavailableError, EngineDeadError, ServerShuttingDownError)
_DEATHS = (ServerUnavailableError, EngineDeadError)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Routing, back-pressure and affinity settings."""

    #: "least_load", "round_robin", or a Policy object
    policy: str | Policy = "least_load"
    #: ceiling on the requests one client keeps in flight on one server (None: the engine's capacity
    #: decides, see admission.py); more wait in the client
    max_in_flight_per_server: int | None = None
    #: how the window follows the engine's capacity (its ``ceiling`` is max_in_flight_per_server)
    admission: AdmissionConfig | None = None
    #: requests allowed to wait in the client for a slot; QueueFullError beyond
    max_waiting: int = 1_000_000
    #: a session stays on its server while that server's load <= (1 + margin) * min load + slack
    affinity_margin: float = 0.5
    #: requests a session's server may carry above the margin before the session moves
    affinity_slack: int = 8
    #: sessions remembered (least recently used forgotten first)
    max_sessions: int = 200_000

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        self.admission_config()  # validates the ceiling
        if self.max_waiting < 0:
            raise ConfigError("max_waiting", self.max_waiting, "must be >= 0")
        if self.affinity_margin < 0:
            raise ConfigError("affinity_margin", self.affinity_margin, "must be >= 0")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions", self.max_sessions, "must be >= 1")


    def admission_config(self) -> AdmissionConfig:
        base = self.admission or AdmissionConfig()
        if self.max_in_flight_per_server is None:
            return base
        return dataclasses.replace(base, ceiling=self.max_in_flight_per_server)


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.policy = make_policy(self.config.policy)
        self.servers: list[ServerConnection] = []
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._sessions: collections.OrderedDict[str, ServerConnection] = collections.OrderedDict()
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self.retried = 0
        #: called with every result (its ``lifecycle`` filled), e.g. by the client's metrics
        self.on_result: Callable[[GenerateResult], None] | None = None
        self.poisoned = 0
        self._rids: set[str] = set()  # rids in flight in this client
        self._suspects_on: set[ServerConnection] = set()  # servers running a suspect (at most one each)
        self.sessions_moved = 0
        self.prefix_tokens_lost = 0

    # -- server set --------------------------------------------------------------------------------

    def add(self, conn: ServerConnection) -> None:
        self.servers.append(conn)
        self.on_server_change(conn)

    def remove(self, conn: ServerConnection) -> None:
        """Forget a server (its sessions move at their next request)."""
        if conn in self.servers:
            self.servers.remove(conn)
        for w in self._waiters:  # re-check: it may have been the last one
            w.event.set()

    def on_server_change(self, conn: ServerConnection) -> None:
        """A server died or came back: let waiters re-check (and fail if nothing is left)."""
        if conn.alive:
            self._wake_next()
        else:
            for w in self._waiters:
                w.event.set()

    def window(self) -> int:
        """Requests the live servers admit from this client now, together (at least 1)."""
        return max(1, sum(s.window.limit for s in self.servers if s.accepting))

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def live_servers(self) -> list[ServerConnection]:
        return [s for s in self.servers if s.accepting]

    # -- slots -------------------------------------------------------------------------------------

    async def acquire(
        self, req: GenerateRequest, exclude: Sequence[ServerConnection] = (), *, suspect: bool = False
    ) -> ServerConnection:
        """A slot on a live server; a ``suspect`` (in flight at a server's death) only on a server that runs
        no other suspect: a second death then names the one request that was at both."""
        if not self._waiters:
            conn = self._try_take(req, exclude, suspect)
            if conn is not None:
                return conn
        if len(self._waiters) >= self.config.max_waiting:
            raise QueueFullError(
                f"{len(self._waiters)} requests already wait for a slot (max_waiting={self.config.max_waiting})"
            )
        waiter = _Waiter()
        self._waiters.append(waiter)
        if len(self._waiters) == 1:
            waiter.event.set()  # first in line: look once more before sleeping
        try:
            while True:
                await waiter.event.wait()
                waiter.event.clear()
                if self._waiters and self._waiters[0] is not waiter:
                    # woken because a server died: only check that some server is still alive
                    if not self.live_servers():
                        raise NoServersError(self._no_servers_message())
                    continue
                conn = self._try_take(req, exclude, suspect)
                if conn is not None:
                    return conn
        finally:
            self._waiters.remove(waiter)
            self._wake_next()

    def _try_take(
        self, req: GenerateRequest, exclude: Sequence[ServerConnection], suspect: bool = False
    ) -> ServerConnection | None:
        live = [s for s in self.servers if s.accepting]
        if not live:
            raise NoServersError(self._no_servers_message())
        free = [s for s in live if s.in_flight < s.window.limit and not s.held]
        if suspect:
            free = [s for s in free if s not in self._suspects_on]
        if exclude:
            preferred = [s for s in free if s not in exclude]
            free = preferred or free
        if not free:
            return None
        conn = self._place(req, free)
        if suspect:
            self._suspects_on.add(conn)
        conn.in_flight += 1
        conn.outstanding_tokens += len(req.input_ids) + req.sampling.max_new_tokens
        return conn

    def _place(self, req: GenerateRequest, free: list[ServerConnection]) -> ServerConnection:
        sid = req.session_id
        if sid is None:
            return self.policy.choose(free, req)
        sessions = self._sessions
        conn = sessions.get(sid)
        if conn is not None and conn in free:
            cfg = self.config
            floor = min(s.load for s in free)
            if conn.load <= (1.0 + cfg.affinity_margin) * floor + cfg.affinity_slack:
                sessions.move_to_end(sid)
                return conn
        chosen = self.policy.choose(free, req)
        if conn is not None and conn is not chosen:
            self.sessions_moved += 1
            self.prefix_tokens_lost += len(req.input_ids)
        sessions[sid] = chosen
        sessions.move_to_end(sid)
        if len(sessions) > self.config.max_sessions:
            sessions.popitem(last=False)
        return chosen

    def release(self, conn: ServerConnection, req: GenerateRequest, *, suspect: bool = False) -> None:
        if suspect:
            self._suspects_on.discard(conn)
        conn.in_flight -= 1
        if conn.in_flight == 0:
            conn.notify_idle()
        conn.outstanding_tokens -= len(req.input_ids) + req.sampling.max_new_tokens
        self._wake_next()

    def _wake_next(self) -> None:
        if self._waiters:
            self._waiters[0].event.set()

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def session_server(self, session_id: str) -> ServerConnection | None:
        return self._sessions.get(session_id)

    def _no_servers_message(self) -> str:
        if not self.servers:
            return "no servers configured"
        reasons = "; ".join(f"{s.address}: {_why_not(s)}" for s in self.servers)
        return f"no live server left ({reasons})"

    # -- one request -------------------------------------------------------------------------------

    async def run(self, req: GenerateRequest, payload: bytes, retries: int) -> GenerateResult:
        """Place, send and await one request, failing over to another server while retries remain.

        The result carries its :class:`~rollout_sdk.protocol.Lifecycle` (when it was queued, dispatched,
        answered; where; which servers failed it first)."""
        rid = req.rid
        if rid in self._rids:
            raise DuplicateRequestError("rid", rid, "a request with this rid is already in flight in this client")
        self._rids.add(rid)
        try:
            return await self._run(req, payload, retries)
        finally:
            self._rids.discard(rid)

    async def _run(self, req: GenerateRequest, payload: bytes, retries: int) -> GenerateResult:
        attempt = 0  # retries so far
        used = 0  # of them, those that count against ``retries`` (a death while serving it does not)
        deaths = 0  # servers that died while serving this request
        exclude: tuple[ServerConnection, ...] = ()
        queued_at = time.time()
        failed_over_from: list[str] = []
        while True:
            suspect = deaths > 0
            conn = await self.acquire(req, exclude, suspect=suspect)
            dispatched_at = time.time()
            t0 = time.perf_counter()
            sent = False
            try:
                fut = conn.submit(req.rid, payload)
                sent = True
                try:
                    result = await fut
                except asyncio.CancelledError:
                    conn.cancel(req.rid)
                    raise
            except ServerBusyError:
                conn.on_busy()  # back-pressure: wait for a slot here or elsewhere
                continue
            except _RETRYABLE as exc:
                conn.errors += 1
                if isinstance(exc, _DEATHS):
                    if conn.alive:
                        conn.mark_dead(str(exc))
                    if sent:
                        deaths += 1
                        if deaths >= 2:
                            self.poisoned += 1
                            raise PoisonRequestError(
                                f"request {req.rid}: server {conn.server_id} died while serving it, and so did "
                                f"the server it ran on before; not retried again ({exc})"
                            ) from exc
                if used >= retries:
                    raise
                if not (sent and isinstance(exc, _DEATHS)):  # a death's retry is bounded by the rule above
                    used += 1
                attempt += 1
                conn.failed_over += 1
                self.retried += 1
                failed_over_from.append(conn.server_id)
                exclude = (conn,)
                continue
            except asyncio.CancelledError:
                conn.aborted += 1
                raise
            except BaseException:
                conn.errors += 1
                raise
            finally:
                self.release(conn, req, suspect=suspect)
            dt = time.perf_counter() - t0
            conn.latencies.append(dt)
            self.latencies.append(dt)
            if result.finish_reason == "abort":
                conn.aborted += 1
            else:
                conn.completed += 1
            # the result was decoded from this request's reply and nobody else holds it: set it in place
            msgspec.structs.force_setattr(
                result, "lifecycle", _lifecycle(result, queued_at, dispatched_at, dt, attempt + 1, failed_over_from)
            )
            if self.on_result is not None:
                self.on_result(result)
            return result


def _lifecycle(
    result: GenerateResult,
    queued_at: float,
    dispatched_at: float,
    elapsed_s: float,
    attempts: int,
    failed_over_from: list[str],
) -> Lifecycle:
    """Client timestamps; the first token is placed from the server's durations (no clock mixing)."""
    finished_at = dispatched_at + elapsed_s  # one wall-clock read per request, durations from perf_counter
    t = result.timings
    first_token_at = None
    if t.ttft_s > 0 and result.output_ids:
        first_token_at = max(dispatched_at, finished_at - max(0.0, t.total_s - t.ttft_s))
    return Lifecycle(
        queued_at=queued_at,
        dispatched_at=dispatched_at,
        finished_at=finished_at,
        server_id=result.server_id,
        first_token_at=first_token_at,
        attempts=attempts,
        failed_over_from=failed_over_from,
    )


def _why_not(s: ServerConnection) -> str:
    if not s.alive:
        return s.dead_reason
    if s.removing:
        return "being removed"
    if not s.admitted:
        return s.admission or "not admitted"
    return "draining"
