"""The client's view of one server: its socket, the requests waiting on it, its health and load.

Each connection runs three loops (under the client's supervisor task group)::

    reader ...... waits on: the DEALER socket being readable
                  does: decodes every ready reply and completes the future that waits on it
                  (GenerateResult / ErrorReply by rid, ControlReply by call_id, Pong → health and load)
    heartbeat ... waits on: a timer (heartbeat_interval_s)
                  does: sends Ping; marks the server dead when no Pong came for heartbeat_timeout_s
    monitor ..... waits on: ZMQ socket events
                  does: marks the server dead the moment its TCP connection drops

Marking a server dead fails every future waiting on it at once with ServerUnavailableError, so no
``await`` outlives its server.  A dead server that answers a heartbeat again (same process, reconnected)
is taken back.  A heartbeat answered by a *different* process at the same address (a new
``incarnation``: the server was restarted on its old port) is not: this connection stays dead, marked
``replaced``, and ``on_replaced`` tells the client, which admits the newcomer as a new member.

Membership state, besides alive/dead: ``admitted`` (the client routes to it only once it serves the
client's weight version; ``admission`` says why not) and ``removing`` (``remove_server``: no new work).

Orphans: the rids that were in flight when a server was marked dead (their callers failed over) are kept
(bounded, ``_MAX_ORPHANS``); an Abort for each is sent the moment the server can be reached again, and
whatever it still sends for them is dropped without touching a counter.

Held: new requests are not placed on a server that is paused, has released its memory, or answered
``busy`` moments ago (``held``); they wait in the client's scheduler instead of in the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from .. import _transport
from ..errors import (
    ClientStateError,
    EngineDeadError,
    MessageTooLargeError,
    ProtocolError,
    ServerUnavailableError,
    error_from_reply,
)
from ..protocol import (
    Abort,
    ControlReply,
    ControlRequest,
    ErrorReply,
    GenerateResult,
    GetInfo,
    Ping,
    Pong,
    ServerInfo,
    ServerStats,
    Stepped,
    decode_server_message,
    encode,
)
from .admission import AdmissionConfig, AdmissionController

__all__ = ["ServerConnection"]

log = logging.getLogger("rollout_sdk.client")

#: rids of failed-over requests remembered per server, to abort there once it is reachable
_MAX_ORPHANS = 100_000
#: back-off after a busy reply: first, and largest (doubling in between)
_BUSY_BACKOFF_S = 0.02
_BUSY_BACKOFF_MAX_S = 1.0


#: a connection not made within this many seconds is logged once as waiting
_SAY_WAITING_AFTER_S = 2.0


async def check_resolvable(address: str) -> None:
    """Raise :class:`ServerUnavailableError` at once when ``address``'s host name does not resolve."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname:
        return
    try:
        await asyncio.get_running_loop().getaddrinfo(parts.hostname, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServerUnavailableError(
            f"cannot connect to {address}: host {parts.hostname!r} does not resolve ({exc.strerror})"
        ) from None


class ServerConnection:
    """One server as the scheduler sees it.  All fields are touched on the client's event loop only."""

    def __init__(
        self,
        index: int,
        address: str,
        channel: _transport.DealerChannel,
        *,
        on_change: Callable[[ServerConnection], Any],
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        on_replaced: Callable[[ServerConnection], Any] | None = None,
        admission: AdmissionConfig | None = None,
    ) -> None:
        self.index = index
        self.address = address
        self.channel = channel
        self.info: ServerInfo | None = None
        #: the scheduler's: a probation request sent here has been through an engine step (``Stepped``)
        self.on_stepped: Callable[[ServerConnection, str], None] | None = None
        self.alive = False
        self.dead_reason = "not connected yet"
        #: a "marked dead" warning was logged and no "is back" yet
        self._said_dead = False
        self.draining = False
        #: routed to only while admitted (it serves the client's weight version); why not, when not
        self.admitted = True
        self.admission = ""
        #: remove_server() was called: no new work
        self.removing = False
        #: a new process answered at this address; this connection is retired for good
        self.replaced = False
        #: the weight version the server last reported (Pong or control reply)
        self.reported_version = 0
        # live load
        self.in_flight = 0
        self.outstanding_tokens = 0
        self.external = 0  # requests other clients hold there, as of the last Pong
        #: this client's in-flight window on this server, from the server's capacity (admission.py)
        self.window = AdmissionController(admission)
        # counters
        self.sent = 0
        #: send order (the scheduler's, over all servers) of the latest request this server answered with
        #: tokens: what was sent here before it has been through an engine step (client/scheduler.py)
        self.answered_seq = -1
        self.completed = 0
        self.aborted = 0
        self.errors = 0
        self.failed_over = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self.stats: ServerStats | None = None
        self._stats_at: float | None = None
        self._last_refresh = 0.0
        self._pending: dict[str, asyncio.Future[GenerateResult]] = {}
        self._calls: dict[str, asyncio.Future[ControlReply]] = {}
        self._on_change = on_change
        self._on_replaced = on_replaced
        self._idle: asyncio.Event | None = None
        self._hb_interval = heartbeat_interval_s
        self._hb_timeout = heartbeat_timeout_s
        self._last_pong = time.monotonic()
        self._ping_seq = 0
        self._call_seq = 0
        self._pings: dict[int, asyncio.Future[ServerStats]] = {}
        # faults (docs/reliability.md)
        self._orphans: dict[str, None] = {}  # insertion-ordered set of rids to abort once reachable
        self.paused = False  # paused (client.pause(), or a Pong that says so)
        self.released = False  # memory released by client.release_memory()
        self.busy = False  # answered busy moments ago
        self.held = False  # any of the three: place nothing new here
        self.busy_replies = 0
        self._busy_backoff = _BUSY_BACKOFF_S
        self._busy_timer: asyncio.TimerHandle | None = None
        self._paused_seq = 0  # Pongs up to this seq predate our last pause/resume: their flag is stale

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"dead: {self.dead_reason}"
        return f"<ServerConnection {self.index} {self.address} {state} in_flight={self.in_flight}>"

    @property
    def server_id(self) -> str:
        return self.info.server_id if self.info is not None else self.address

    @property
    def incarnation(self) -> str:
        return self.info.incarnation if self.info is not None else ""

    @property
    def paces_probation(self) -> bool:
        """The server hands probation requests to its engine one step at a time (server.py, "Probation")."""
        return self.info is not None and self.info.paces_probation

    @property
    def accepting(self) -> bool:
        return self.alive and self.admitted and not self.draining and not self.removing

    @property
    def load(self) -> int:
        return self.in_flight + self.external

    @property
    def num_pending(self) -> int:
        """Requests sent to this server still waiting for their reply."""
        return len(self._pending)

    # -- requests ----------------------------------------------------------------------------------

    def submit(self, rid: str, payload: bytes) -> asyncio.Future[GenerateResult]:
        """Send an encoded GenerateRequest; the future completes with its result or typed error."""
        if not self.alive:
            raise ServerUnavailableError(f"server {self.server_id} is dead: {self.dead_reason}")
        info = self.info
        if info is not None and 0 < info.max_generate_bytes < len(payload):
            raise MessageTooLargeError(
                "input_ids",
                f"<{len(payload)} bytes encoded>",
                f"server {self.server_id} accepts requests up to {info.max_generate_bytes} bytes (max_generate_bytes)",
            )
        if self._orphans:
            self._orphans.pop(rid, None)
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        self.channel.send(payload)  # raises ServerUnavailableError when not connected
        self._pending[rid] = fut
        self.sent += 1
        return fut

    def cancel(self, rid: str) -> None:
        """Forget ``rid`` and tell the server to abort it (best effort: the server may be gone)."""
        if self._pending.pop(rid, None) is not None:
            try:
                self.channel.send(encode(Abort(rid)))
            except ServerUnavailableError:
                self._adopt_orphans({rid: None})  # aborted there once it is reachable

    def abort(self, rid: str) -> bool:
        """Ask the server to abort ``rid``; its caller still gets the (abort) result.  False if unknown."""
        if rid not in self._pending or not self.alive:
            return False
        try:
            self.channel.send(encode(Abort(rid)))
        except ServerUnavailableError:
            return False
        return True

    def abort_all(self) -> None:
        if self.alive:
            try:
                self.channel.send(encode(Abort("")))
            except ServerUnavailableError:
                pass

    async def call(self, msg: ControlRequest, timeout: float | None = None) -> ControlReply:
        """Send a control message and wait for its reply (raises the server's typed error)."""
        if not self.alive:
            raise ServerUnavailableError(f"server {self.server_id} is dead: {self.dead_reason}")
        return await self._call(msg, timeout)

    def next_call_id(self) -> str:
        self._call_seq += 1
        return f"c{self._call_seq}"

    async def _call(self, msg: ControlRequest, timeout: float | None) -> ControlReply:
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._calls[msg.call_id] = fut
        try:
            self.channel.send(encode(msg))
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._calls.pop(msg.call_id, None)

    async def fetch_stats(self, timeout: float | None = 10.0) -> ServerStats:
        """A fresh heartbeat round trip: the server's stats as of now."""
        if not self.alive:
            raise ServerUnavailableError(f"server {self.server_id} is dead: {self.dead_reason}")
        self._ping_seq += 1
        seq = self._ping_seq
        fut: asyncio.Future[ServerStats] = asyncio.get_running_loop().create_future()
        self._pings[seq] = fut
        try:
            self.channel.send(encode(Ping(seq)))
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pings.pop(seq, None)

    async def handshake(self, timeout: float) -> ServerInfo:
        """Wait for the connection, then ask the server who it is.

        A host name that does not resolve fails at once (libzmq would retry it in silence until the
        timeout); a server that does not answer within ``_SAY_WAITING_AFTER_S`` gets one log line saying
        what is awaited and for how long, then ``timeout`` (the client's ``connect_timeout_s``) applies."""
        deadline = time.monotonic() + timeout
        await check_resolvable(self.address)
        first = min(timeout, _SAY_WAITING_AFTER_S)
        if not await self.channel.wait_connected(first):
            log.warning(
                "no server answers at %s yet; waiting up to %.0fs more (the client's connect_timeout_s)",
                self.address,
                timeout - first,
            )
            if not await self.channel.wait_connected(max(0.0, deadline - time.monotonic())):
                raise ServerUnavailableError(
                    f"no server answered at {self.address} within {timeout:.0f}s (connect_timeout_s): "
                    "is it running, and is this its address (the READY line it printed)?"
                )
        reply = await self._call(GetInfo(call_id=self.next_call_id()), max(0.1, deadline - time.monotonic()))
        assert reply.info is not None
        self.info = reply.info
        self.reported_version = reply.info.weight_version
        self.alive = True
        self.dead_reason = ""
        self._last_pong = time.monotonic()
        # one heartbeat now, so the first requests are admitted from the engine's capacity, not the fallback
        with contextlib.suppress(TimeoutError, ServerUnavailableError):
            await self.fetch_stats(max(0.1, deadline - time.monotonic()))
        return reply.info

    async def wait_idle(self) -> None:
        """Until none of this client's requests is in flight here (or the server is dead)."""
        while self.in_flight > 0 and self.alive:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()

    def notify_idle(self) -> None:
        """Wake :meth:`wait_idle` (the scheduler calls it when ``in_flight`` drops to 0)."""
        if self._idle is not None:
            self._idle.set()
            self._idle = None

    # -- health --------------------------------------------------------------------------------------

    def mark_dead(self, reason: str, error: BaseException | None = None) -> None:
        """Fail everything waiting on this server, at once (with ``error``, or ServerUnavailableError)."""
        if not self.alive and not self._pending and not self._calls:
            return
        was_alive = self.alive
        self.alive = False
        self.dead_reason = reason
        if was_alive and not isinstance(error, ClientStateError):
            log.warning("server %s (%s) marked dead: %s", self.server_id, self.address, reason)
            self._said_dead = True
        err = error or ServerUnavailableError(f"server {self.server_id} ({self.address}) is dead: {reason}")
        pending, self._pending = self._pending, {}
        if not isinstance(error, ClientStateError):
            self._adopt_orphans(pending)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        calls, self._calls = self._calls, {}
        for cfut in calls.values():
            if not cfut.done():
                cfut.set_exception(err)
        pings, self._pings = self._pings, {}
        for pfut in pings.values():
            if not pfut.done():
                pfut.set_exception(err)
        self.notify_idle()
        self._on_change(self)

    def _revive(self) -> None:
        if not self.alive and self.info is not None and not self.replaced:
            # "back" only after a "marked dead": a server answering its first heartbeats is no news
            if self._said_dead:
                log.info("server %s (%s) is back", self.server_id, self.address)
            self._said_dead = False
            self.alive = True
            self.dead_reason = ""
            self._abort_orphans()
            self._on_change(self)

    # -- orphans: requests that failed over while this server still held them ---------------------------

    def _adopt_orphans(self, pending: dict[str, Any]) -> None:
        for rid in pending:
            self._orphans[rid] = None
        while len(self._orphans) > _MAX_ORPHANS:
            del self._orphans[next(iter(self._orphans))]
        self._abort_orphans()  # reachable already when it was only slow (a missed heartbeat)

    def _abort_orphans(self) -> None:
        """Send an Abort for every orphan; keep those that could not be sent for the next chance."""
        while self._orphans:
            rid = next(iter(self._orphans))
            try:
                self.channel.send(encode(Abort(rid)))
            except ServerUnavailableError:
                return
            del self._orphans[rid]

    @property
    def num_orphans(self) -> int:
        return len(self._orphans)

    # -- held: paused, released, busy -------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        """This client paused / resumed the server (Pongs sent before now no longer say otherwise)."""
        self._paused_seq = self._ping_seq
        self.paused = paused
        self._update_held()

    def set_released(self, released: bool) -> None:
        self.released = released
        self._update_held()

    def on_busy(self) -> None:
        """The server answered busy: place nothing here for a back-off (doubling), or until a reply
        shows that a slot freed."""
        self.busy_replies += 1
        self.busy = True
        self._update_held()
        if self._busy_timer is None:
            delay = self._busy_backoff
            self._busy_backoff = min(_BUSY_BACKOFF_MAX_S, delay * 2)
            self._busy_timer = asyncio.get_running_loop().call_later(delay, self._clear_busy, False)

    def _clear_busy(self, reset_backoff: bool = True) -> None:
        if self._busy_timer is not None:
            self._busy_timer.cancel()
            self._busy_timer = None
        if reset_backoff:
            self._busy_backoff = _BUSY_BACKOFF_S
        self.busy = False
        self._update_held()

    def _update_held(self) -> None:
        held = self.paused or self.released or self.busy
        if held != self.held:
            self.held = held
            if not held:
                self._on_change(self)  # waiters may take this server again

    # -- loops -------------------------------------------------------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._reader(), name=f"conn{self.index}-reader")
            tg.create_task(self._heartbeat(), name=f"conn{self.index}-heartbeat")
            tg.create_task(self.channel.watch(self._on_socket_event), name=f"conn{self.index}-monitor")

    def _on_socket_event(self, event: str) -> None:
        if event == "disconnected":
            self.mark_dead("connection dropped")

    async def _reader(self) -> None:
        while True:
            for data in await self.channel.recv_batch():
                try:
                    msg = decode_server_message(data)
                except ProtocolError as exc:
                    log.error("server %s sent an unreadable reply: %s", self.server_id, exc)  # noqa: TRY400
                    continue
                self._dispatch(msg)

    def _dispatch(self, msg: msgspec.Struct) -> None:
        match msg:
            case GenerateResult(rid=rid):
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                self._refresh_if_idle()
                if self.busy:
                    self._clear_busy()  # a slot freed on the server
            case Stepped(rid=rid):
                if self.on_stepped is not None and rid in self._pending:
                    self.on_stepped(self, rid)
            case ErrorReply():
                self._dispatch_error(msg)
            case Pong(seq=seq, stats=stats):
                self._on_pong(stats, seq)
                pfut = self._pings.pop(seq, None)
                if pfut is not None and not pfut.done():
                    pfut.set_result(stats)
            case ControlReply(call_id=call_id):
                if msg.weight_version is not None and msg.info is None:
                    self.reported_version = msg.weight_version
                cfut = self._calls.pop(call_id, None)
                if cfut is not None and not cfut.done():
                    cfut.set_result(msg)

    def _dispatch_error(self, msg: ErrorReply) -> None:
        exc = error_from_reply(msg.code, msg.message, msg.field, msg.value, msg.applied)
        target: asyncio.Future[Any] | None = None
        if msg.rid is not None:
            target = self._pending.pop(msg.rid, None)
        elif msg.call_id is not None:
            target = self._calls.pop(msg.call_id, None)
        if target is not None and not target.done():
            target.set_exception(exc)
        if msg.rid is not None:
            self._refresh_if_idle()
        elif msg.rid is None and msg.call_id is None:
            log.error("server %s reported: [%s] %s", self.server_id, msg.code, msg.message)
        if isinstance(exc, EngineDeadError):
            self.mark_dead(f"engine died: {msg.message}", exc)

    def _on_pong(self, stats: ServerStats, seq: int = 0) -> None:
        if self.replaced:
            return
        if stats.incarnation and self.info is not None and stats.incarnation != self.info.incarnation:
            # another process answers at this address: the server we knew is gone for good
            self.replaced = True
            reason = f"replaced by a new server process ({stats.incarnation}) at this address"
            self.mark_dead(reason)
            self.dead_reason = reason
            if self._on_replaced is not None:
                self._on_replaced(self)
            return
        self._last_pong = time.monotonic()
        moved = stats.weight_version != self.reported_version
        self.reported_version = stats.weight_version
        self.stats = stats
        self._stats_at = time.monotonic()
        # both counts from the same snapshot: our own replies still in transit are not someone else's load
        self.external = max(0, stats.in_flight - stats.client_in_flight)
        self.draining = stats.draining
        if seq > self._paused_seq and stats.paused != self.paused:
            self.paused = stats.paused  # paused or resumed by another client
            self._update_held()
        grew = self.window.observe(
            max_running=stats.max_running_requests,
            running=stats.running,
            queued=stats.queued,
            kv_usage=stats.kv_usage,
            others=self.external,
        )
        if not stats.engine_alive:
            self.mark_dead("engine died", EngineDeadError(f"the engine of server {self.server_id} died"))
        elif not self.alive:
            self._revive()
        elif moved and not self.admitted:
            self._on_change(self)  # it may now serve the client's version
        elif grew and self.admitted:
            self._on_change(self)  # a larger window: let a waiting request in

    @property
    def stats_age_s(self) -> float | None:
        """Seconds since ``stats`` arrived (None before the first Pong)."""
        return None if self._stats_at is None else time.monotonic() - self._stats_at

    def _refresh_if_idle(self) -> None:
        """Our last request here just ended: ask for fresh stats now rather than at the next heartbeat, so
        a server seen busy does not look busy for a heartbeat interval after it went idle.  At most one such
        Ping per 50 ms (a request-at-a-time caller would otherwise send one per request)."""
        if self._pending or not self.alive or self.stats is None:
            return
        if not (self.stats.in_flight or self.stats.running or self.stats.queued):
            return
        now = time.monotonic()
        if now - self._last_refresh < 0.05:
            return
        self._last_refresh = now
        self._ping_seq += 1
        try:
            self.channel.send(encode(Ping(self._ping_seq)))
        except ServerUnavailableError:
            pass

    def _on_tick(self, slept: float, now: float) -> None:
        """One heartbeat tick that slept from ``slept`` to ``now``: the silence counts only the time this
        event loop kept time.  How late the tick woke is the client's own loop lag (a saturated loop, a
        trainer's synchronous step): Pongs may sit unread in the socket meanwhile, so that time says nothing
        about the server and is credited to it.  A dead server is still found after ``heartbeat_timeout_s``
        of responsive time (at once when the loop keeps time; later only while the client itself lags)."""
        lag = max(0.0, now - slept - self._hb_interval)
        self._last_pong = min(now, self._last_pong + lag)
        if now - slept > 2 * self._hb_interval + 0.5:
            # blocked outright: start counting afresh
            self._last_pong = max(self._last_pong, now - self._hb_interval)
        elif self.alive and now - self._last_pong > self._hb_timeout:
            self.mark_dead(f"no heartbeat for {self._hb_timeout:.1f}s")

    async def _heartbeat(self) -> None:
        while True:
            slept = time.monotonic()
            await asyncio.sleep(self._hb_interval)
            self._on_tick(slept, time.monotonic())
            self._ping_seq += 1
            try:
                self.channel.send(encode(Ping(self._ping_seq)))
            except ServerUnavailableError:
                pass
