"""The engine server: one asyncio event loop around one engine, serving clients over a ZMQ ROUTER.

It runs on rank 0 of a TP group (or in-process, as the client's embedded default).

Concurrency (all on one event loop; the engine's model work runs in its own thread or processes)::

    serve()  ── owns ──▶ TaskGroup
      │
      ├── recv loop ........ waits on: the ROUTER socket being readable
      │                       does: drains every ready message, decodes it, and
      │                         Generate → validates, then starts one request task (below)
      │                         Abort    → engine.abort(rid)            (sync, returns at once)
      │                         Ping     → Pong with live stats         (sync send)
      │                         control  → starts one control task
      │                       never awaits the engine, so a busy engine never delays an Abort or a Ping
      │
      ├── request task x N . waits on: engine.generate(req)
      │                       unblocked by: the engine finishing, aborting, or dying
      │                       always ends by sending exactly one reply (result or typed error)
      │
      ├── control task x M . waits on: the engine hook (pause, weights, memory, ...)
      │
      ├── engine watchdog .. waits on: engine.wait_dead()
      │                       then: marks the server failed; in-flight requests already fail with
      │                       EngineDeadError from the engine; new ones get it at once
      │
      ├── decode worker .... (frames.py) a spawned process (made on first use) that decodes GenerateRequests
      │                       larger than ``offload_decode_bytes``; at most ``max_offloaded_decodes`` wait for
      │                       it, one per peer; a large frame beyond either is answered ``busy`` at once (the
      │                       recv loop never waits, so Ping and Abort are served whatever one peer sends)
      │
      └── client sweeper ... (peers.py) waits on: a timer; aborts the requests of a client silent (no
                              message, not even a heartbeat Ping) for ``client_timeout_s``

    Bounds (docs/reliability.md): a frame larger than the bigger size limit never reaches Python
    (ZMQ MAXMSGSIZE); one larger than its kind's limit is refused before decoding (frames.py); the recv loop
    yields to the event loop every ``_HANDLE_BUDGET_S`` of handling; at most ``max_requests`` requests are
    accepted, and a client beyond its fair share (``max_requests`` / clients that sent requests recently,
    counted by credential when authentication is on) is answered ``busy`` (ServerBusyError) without running
    anything (peers.py).  While it serves, the garbage collector's young threshold is raised
    (``ServerConfig.gc_threshold``, :func:`raise_gc_threshold`): thousands of requests in flight would otherwise run
    collections on this loop every few dozen requests.

This module is the serving state machine; ``ServerConfig`` is in config.py, the per-client bookkeeping
(fair share, orphans) in peers.py, size limits and off-loop decoding in frames.py.

Authentication (``ServerConfig.auth``): the socket admits only CURVE peers with the job's keys (ZAP, in
``_transport``); each message carries its credential's role, and :func:`authorize` refuses a control
message from a generate-only credential with PermissionDeniedError before anything acts on it.  A bind
beyond loopback without ``auth`` is refused at configuration time.  See docs/security.md.

Shutdown (``stop()``), all within ``shutdown_timeout_s``: new requests are refused with
ServerShuttingDownError, pending control calls are cancelled and answered with it, in-flight requests get
``drain_timeout_s`` to finish, then the rest are aborted (they answer with ``finish_reason='abort'``), then
cancelled (they answer ``shutting_down``), and only then the socket closes.

Probation (issue 36; client/scheduler.py, "Suspects").  Where the engine ``reports_steps``, a request sent
with ``probation=True`` reaches the engine only when none of the same client's probation requests is in the
engine without having been through a step: one at a time per client, in arrival order.  When the step that
admitted one ends, the engine calls the server back before its next admission; the server sends the client
``Stepped(rid)`` and hands the engine the next one at once (the engine yields to the loop once, so it is
admitted at the very next step).  So a client may send all its suspects at once and they enter the engine
at one a step, and when the engine dies the client knows the one probation request that can have killed
it: the first it has no ``Stepped`` for (the Stepped replies of earlier ones left before the EngineDead
replies, on the same socket).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .. import _transport
from .._aio import LifecycleGuard, LifecycleState, await_unless, ended_with
from ..engines.base import Engine
from ..errors import (
    DuplicateRequestError,
    EngineBusyError,
    EngineDeadError,
    InvalidRequestError,
    PermissionDeniedError,
    ProtocolError,
    RemoteError,
    RequestFailedError,
    RequestTimeoutError,
    RolloutError,
    ServerBusyError,
    ServerShuttingDownError,
    UnsupportedOperationError,
)
from ..protocol import (
    Abort,
    ControlReply,
    DestroyWeightGroup,
    FlushCache,
    GenerateRequest,
    GenerateResult,
    GetInfo,
    InitWeightGroup,
    PauseGeneration,
    Ping,
    Pong,
    ReleaseMemory,
    ResumeGeneration,
    ResumeMemory,
    ServerInfo,
    ServerStats,
    SessionHints,
    SetWeightVersion,
    Stepped,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
    check_against_limits,
    check_weight_version,
    decode_client_message,
    encode,
    error_reply,
    is_generate_frame,
)
from .config import ServerConfig
from .frames import DecodeWorker, IntTable, free_ids_in_chunks, ids_from_uint32, oversize, peek_rid
from .peers import Peers
from .stall import Sample, StallDetector

if TYPE_CHECKING:
    from .metrics import ServerMetrics

__all__ = ["EngineServer", "ServerConfig", "authorize"]

log = logging.getLogger("rollout_sdk.server")

#: the recv loop hands the event loop back after this much handling in one go (seconds)
_HANDLE_BUDGET_S = 0.001


#: the share of the loop's time spent reading the rids of large frames refused ``busy`` (~9 ns an id: 18 ms
#: for a 2M-id frame); beyond it (a flood) they are refused without their rid.  Burst: one maximum frame.
_PEEK_SHARE = 0.1
_PEEK_BURST_S = 0.025

#: what a generate-only credential may send; everything else needs the control role
#: SessionHints: an agent worker's own sessions' KV (advisory: a hint about another client's session costs
#: cache hits, never a result)
_GENERATE_ROLE_MESSAGES = (GenerateRequest, Abort, Ping, GetInfo, SessionHints)


def raise_gc_threshold(threshold0: int | None) -> tuple[int, int, int] | None:
    """Raise the garbage collector's youngest-generation threshold to ``threshold0`` (never lower it, and
    leave a disabled collector alone); return the thresholds to put back, or None when nothing changed.

    Why: a server holds thousands of requests in flight, each a handful of tracked objects (its task, its
    request, its ids), so the live count swings by thousands as batches arrive and finish; at CPython's
    default 700 that runs a young collection every few dozen requests, and every tenth of the tenth a full
    one over the whole heap (a stall of the loop).  Objects of a finished request are freed by reference
    counting; the collector only finds cycles, and fewer, larger young collections find the same ones."""
    if threshold0 is None:
        return None
    old = gc.get_threshold()
    if old[0] == 0 or old[0] >= threshold0:
        return None
    gc.set_threshold(threshold0, old[1], old[2])
    return old


def restore_gc_threshold(saved: tuple[int, int, int] | None, threshold0: int | None) -> None:
    """Undo :func:`raise_gc_threshold`, unless someone changed the threshold since."""
    if saved is not None and gc.get_threshold()[0] == threshold0:
        gc.set_threshold(*saved)


def authorize(msg: msgspec.Struct, role: str | None) -> None:
    """Refuse ``msg`` unless ``role`` may send it (None: an unauthenticated loopback server, all may)."""
    if role is None or role == "control":
        return
    if role == "generate" and isinstance(msg, _GENERATE_ROLE_MESSAGES):
        return
    raise PermissionDeniedError(f"a {role!r} credential may not send {type(msg).__name__} (needs 'control')")


class _Flight:
    __slots__ = ("aborted", "big", "engine_rid", "ident", "probation", "rid", "stepped", "task", "turn")

    def __init__(self, ident: bytes, rid: str, big: bool = False) -> None:
        self.ident = ident
        self.rid = rid
        self.engine_rid = ""
        self.big = big  # decoded off the loop: its ids are also freed a chunk at a time
        self.task: asyncio.Task[None] | None = None
        # an Abort arrived: also when it was handled before this request's task first ran (the same recv
        # batch, or the next one on a busy loop), when the engine has not seen the request yet
        self.aborted = False
        self.probation = False  # paced (module docstring, "Probation")
        self.stepped = False  # a probation request whose admitting step ended (Stepped sent)
        self.turn: asyncio.Future[None] | None = None  # set when a paced request may reach the engine


class _Line:
    """One client's probation requests (module docstring, "Probation"): the one in the engine whose
    admitting step has not ended yet, and those waiting for it, in arrival order."""

    __slots__ = ("current", "waiting")

    def __init__(self) -> None:
        self.current = ""  # engine rid, or "" when none
        self.waiting: collections.deque[_Flight] = collections.deque()


class EngineServer:
    """Serve one engine.  Use ``await server.serve(on_ready=...)``, or ``async with EngineServer(...)``,
    which runs :meth:`serve` in a task owned by the server and returns once it listens.

    Example::

        async with EngineServer(CpuEngine(), ServerConfig()) as server:
            print(server.address)          # tcp://127.0.0.1:54321
            await server.wait_stopped()    # until stop() or a signal handler calls it
    """

    def __init__(
        self, engine: Engine, config: ServerConfig | None = None, *, metrics: ServerMetrics | None = None
    ) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        # a stable name (metrics series, a restarted server taking its slot): the configured id, else the rank
        # and, once bound, the address (``dp0@host:port``: unique among standalone servers, and the same
        # after a restart on the same address)
        self.server_id = self.config.server_id or f"dp{self.config.dp_rank}"
        #: Prometheus metrics this server reports into while it serves (docs/observability.md)
        self.metrics = metrics
        #: this start of the server; clients treat a new incarnation at a known address as a new member
        self.incarnation = uuid.uuid4().hex[:12]
        self.address = ""
        self._flights: dict[str, _Flight] = {}  # engine rid -> flight
        self._lines: dict[bytes, _Line] = {}  # client ident -> its probation requests (module docstring)
        if engine.reports_steps:
            engine.step_listener = self._on_stepped
        self._by_client: dict[tuple[bytes, str], str] = {}  # (ident, client rid) -> engine rid
        self._completed = 0
        self._aborted = 0
        self._errors = 0
        self._draining = False
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._life = LifecycleGuard("EngineServer")  # serve() runs once; `state` says where it is
        self._endpoint: _transport.RouterEndpoint | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._started_at = time.monotonic()
        self._failure: BaseException | None = None
        # faults and bounds (docs/reliability.md)
        self._peers = Peers(
            self.server_id,
            max_requests=self.config.max_requests,
            client_timeout_s=self.config.client_timeout_s,
            abort_client=lambda ident: self._abort(ident, ""),
        )
        self._now = 0.0  # loop time of the batch being handled
        self._busy = 0  # requests answered busy
        self._controls: set[asyncio.Task[None]] = set()
        self._offloaded: set[asyncio.Task[None]] = set()  # large frames being decoded off the loop
        self._decoder = DecodeWorker(self.config.max_offloaded_decodes)
        self._ints = IntTable()  # shared ints for the ids of requests decoded off the loop
        self._peek_credit = _PEEK_BURST_S  # seconds of rid reading the loop may still spend (_peek_rid)
        self._peek_at = time.perf_counter()
        self._stop_deadline: float | None = None
        c = self.config
        self._stall = StallDetector(
            window_s=c.stall_window_s or 10.0,
            ratio=c.stall_ratio,
            loop_lag_s=c.stall_loop_lag_s,
            history_s=max(900.0, 2 * (c.stall_window_s or 10.0)),
        )

    # -- running -----------------------------------------------------------------------------------

    async def serve(self, *, on_ready: Callable[[str], Any] | None = None) -> None:
        """Start the engine, bind, serve until :meth:`stop`, then shut down cleanly.  A server serves once."""
        self._life.opening()
        ctx = _transport.new_context()
        gc_saved: tuple[int, int, int] | None = None
        try:
            if not await self._start_engine():  # stopped during start-up: no bind, no ready, shut down
                log.info("server stopped during start-up: not serving")
                await self._close_engine()
                return
            gc_saved = raise_gc_threshold(self.config.gc_threshold)
            try:
                self._endpoint = _transport.bind_router(
                    ctx,
                    self.config.host,
                    self.config.port,
                    max_msg_bytes=max(self.config.max_generate_bytes, self.config.max_control_bytes),
                    peer_timeout_s=self.config.client_timeout_s,
                    auth=self.config.auth,
                )
                host = self.config.advertise_host or (
                    _transport.local_ip() if self.config.host in ("0.0.0.0", "*") else self.config.host
                )
                self.address = f"tcp://{host}:{self._endpoint.port}"
                if not self.config.server_id:
                    self.server_id = f"dp{self.config.dp_rank}@{host}:{self._endpoint.port}"
                log.info(
                    "server %s serving %s on %s (authentication %s)",
                    self.server_id,
                    self.engine.backend,
                    self.address,
                    "on" if self.config.auth is not None else "off",
                )
                if self.metrics is not None:
                    self.metrics.attach(self.server_id, self.stats)
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    recv = tg.create_task(self._recv_loop(), name=f"{self.server_id}-recv")
                    watch = tg.create_task(self._watch_engine(), name=f"{self.server_id}-watchdog")
                    sweep = tg.create_task(
                        self._peers.sweep(self._endpoint, self.stats), name=f"{self.server_id}-sweeper"
                    )
                    stall = tg.create_task(self._watch_progress(), name=f"{self.server_id}-stall")
                    self._life.opened()
                    if on_ready is not None:
                        on_ready(self.address)
                    await self._stop.wait()
                    self._life.closing()
                    await self._drain()
                    recv.cancel()
                    watch.cancel()
                    sweep.cancel()
                    stall.cancel()
            finally:
                self._tg = None
                if self.metrics is not None:
                    self.metrics.detach(self.server_id)
                self._decoder.close()
                if self._endpoint is not None:
                    await self._endpoint.close()
                await self._close_engine()
        finally:
            restore_gc_threshold(gc_saved, self.config.gc_threshold)
            await asyncio.to_thread(ctx.term)  # waits (bounded by linger) for the last replies to leave
            self._life.closed()
            self._stopped.set()

    async def _start_engine(self) -> bool:
        """Start the engine unless :meth:`stop` comes first (a Ctrl-C while a model loads): False then, and
        the start is cancelled (a load running in a worker thread finishes there; the process's bounded
        exit does not wait for it)."""
        start = asyncio.ensure_future(self.engine.start())
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not start.done():
                start.cancel()
        if not start.cancelled() and start.done():
            start.result()  # a start-up error surfaces as it is
            return not self._stop.is_set()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        return False

    async def _close_engine(self) -> None:
        try:
            await asyncio.wait_for(self.engine.close(), timeout=max(1.0, self._time_left(0.5)))
        except TimeoutError:
            log.warning("server %s: engine did not close within the shutdown bound", self.server_id)

    def stop(self) -> None:
        """Ask the server to shut down (drain, then abort what is left) within ``shutdown_timeout_s``.
        Safe from signal handlers; idempotent (the first call starts the clock)."""
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.config.shutdown_timeout_s
        self._draining = True
        self._stop.set()

    def _time_left(self, reserve: float = 0.0) -> float:
        """Seconds left of the shutdown bound, keeping ``reserve`` for closing sockets and the engine."""
        if self._stop_deadline is None:
            return self.config.shutdown_timeout_s
        return max(0.0, self._stop_deadline - reserve - time.monotonic())

    @property
    def state(self) -> LifecycleState:
        return self._life.state

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> EngineServer:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Any] = loop.create_future()

        def _ready(addr: str) -> None:
            if not ready.done():
                ready.set_result(addr)

        runner = self._runner = loop.create_task(self.serve(on_ready=_ready), name=f"{self.server_id}-serve")
        await await_unless(
            ready, runner, error=lambda: ended_with(runner, RemoteError("server stopped before it was ready"))
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self.stop()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner

    # -- stats -------------------------------------------------------------------------------------

    def stats(self, client: bytes | None = None) -> ServerStats:
        """Live stats; ``client`` (a peer's identity) fills ``client_in_flight`` with that peer's requests."""
        load = self.engine.load()
        mine = sum(1 for who, _ in self._by_client if who == client) if client is not None else 0
        return ServerStats(
            server_id=self.server_id,
            in_flight=len(self._flights),
            client_in_flight=mine,
            completed=self._completed,
            aborted=self._aborted,
            errors=self._errors,
            weight_version=self.engine.weight_version,
            engine_alive=self.engine.dead is None,
            paused=self.engine.paused,
            draining=self._draining,
            incarnation=self.incarnation,
            stalled=self._stall.stalled,
            stalls=self._stall.stalls,
            stall_reason=self._stall.reason,
            **msgspec.structs.asdict(load),  # the engine's load and capacity, field for field
        )

    @property
    def auth_refused(self) -> int:
        """Handshakes refused for an unknown key since the server started (0 without authentication)."""
        zap = self._endpoint.zap if self._endpoint is not None else None
        return zap.denied if zap is not None else 0

    def _info_for(self, role: str | None) -> ServerInfo:
        """What GetInfo tells a credential: a generate-only one learns neither the pid nor the model's path."""
        info = self.info()
        if role in (None, "control"):
            return info
        return msgspec.structs.replace(info, pid=0, model=os.path.basename(info.model.rstrip("/")))

    def info(self) -> ServerInfo:
        return ServerInfo(
            server_id=self.server_id,
            backend=self.engine.backend,
            model=self.engine.model_name,
            limits=self.engine.limits,
            dp_rank=self.config.dp_rank,
            tp_size=max(self.config.tp_size, self.engine.tp_size),
            weight_version=self.engine.weight_version,
            pid=os.getpid(),
            host=self.address,
            max_generate_bytes=self.config.max_generate_bytes,
            max_control_bytes=self.config.max_control_bytes,
            incarnation=self.incarnation,
            paces_probation=self.engine.reports_steps,
        )

    # -- loops -------------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._endpoint is not None
        endpoint = self._endpoint
        loop = asyncio.get_running_loop()
        offload = self.config.offload_decode_bytes
        perf = time.perf_counter
        authenticated = endpoint.zap is not None
        while True:
            # a CURVE server reads each message's role (its ZAP User-Id); a loopback server has none
            batch: list[tuple[list[bytes], str | None]] = (
                await endpoint.recv_batch_with_roles()
                if authenticated
                else [(frames, None) for frames in await endpoint.recv_batch()]
            )
            self._now = loop.time()
            t0 = perf()
            for frames, role in batch:
                if len(frames) != 2:
                    self._errors += 1
                    if frames:
                        self._reply(frames[0], error_reply(ProtocolError("expected exactly one frame")))
                    continue
                ident, payload = frames
                try:
                    if len(payload) > offload and is_generate_frame(payload):
                        if role is not None and role not in ("generate", "control"):
                            self._errors += 1
                            self._reply(ident, error_reply(PermissionDeniedError(f"role {role!r} may not generate")))
                        elif not self._refuse_size(ident, payload):
                            self._start_offloaded(ident, payload, role)
                    else:
                        self._handle(ident, payload, role)
                except Exception as exc:  # a bug here must not take the server down
                    log.exception("server %s: unexpected error handling a message", self.server_id)
                    self._errors += 1
                    self._reply(ident, error_reply(RemoteError(f"{type(exc).__name__}: {exc}")))
                if perf() - t0 > _HANDLE_BUDGET_S:
                    await asyncio.sleep(0)  # a long batch never holds the loop: timers and replies run
                    self._now = loop.time()
                    t0 = perf()

    async def _watch_progress(self) -> None:
        """The stall detector's ticker (server/stall.py): the engine's progress and how late the tick came."""
        if self.config.stall_window_s is None:
            return
        loop = asyncio.get_running_loop()
        every = self.config.stall_window_s / 10
        due = loop.time() + every
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            lag, due = now - due, now + every
            line = self._stall.observe(
                Sample(
                    t=now,
                    progress=self.engine.progress(),
                    running=self.engine.load().running,
                    lag_s=lag,
                    prefilled=self.engine.prefill_progress(),
                )
            )
            if line is not None:
                if self._stall.stalled and hasattr(os, "getloadavg") and os.getloadavg()[0] > (os.cpu_count() or 1):
                    line += f" (this machine's load average is {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
                warn = self._stall.stalled and self.config.stall_warns
                (log.warning if warn else log.info)("server %s: %s", self.server_id, line)

    async def _watch_engine(self) -> None:
        exc = await self.engine.wait_dead()
        self._failure = exc
        log.error("server %s: engine died: %s", self.server_id, exc)

    def _reply(self, ident: bytes, msg: msgspec.Struct) -> None:
        assert self._endpoint is not None
        if not self._endpoint.send(ident, encode(msg)):
            log.debug("server %s: peer gone, reply dropped", self.server_id)
            if self._endpoint.last_failure == "gone":
                self._peers.forget(ident, "it disconnected (a reply could not be delivered)")

    def _refuse_size(self, ident: bytes, payload: bytes) -> bool:
        """Refuse a frame over its kind's size limit before decoding it (True when refused)."""
        exc = oversize(payload, self.config.max_generate_bytes, self.config.max_control_bytes)
        if exc is None:
            return False
        self._errors += 1
        self._reply(ident, error_reply(exc))
        return True

    def _refuse_busy_frame(self, ident: bytes, payload: bytes) -> None:
        """A large frame of a peer that already has one waiting to be decoded (or of any peer while
        ``max_offloaded_decodes`` wait): ``busy``, with its rid, and nothing decoded."""
        self._busy += 1
        exc = ServerBusyError(
            f"server {self.server_id} is busy: a large request of this client (or {self.config.max_offloaded_decodes} "
            "of all clients) waits to be decoded"
        )
        self._reply(ident, error_reply(exc, rid=self._peek_rid(payload)))

    def _peek_rid(self, payload: bytes) -> str | None:
        """The frame's rid, while reading rids takes at most ``_PEEK_SHARE`` of the loop (else None: under a
        flood of large frames the loop keeps up, and the flood's busy replies name no request)."""
        now = time.perf_counter()
        credit = min(_PEEK_BURST_S, self._peek_credit + (now - self._peek_at) * _PEEK_SHARE)
        self._peek_at = now
        if credit <= 0.0:
            self._peek_credit = credit
            return None
        rid = peek_rid(payload)
        self._peek_credit = credit - (time.perf_counter() - now)
        return rid

    def _handle(self, ident: bytes, payload: bytes, role: str | None = None) -> None:
        self._peers.heard(ident, self._now)
        if self._refuse_size(ident, payload):
            return
        try:
            msg = decode_client_message(payload)
        except (InvalidRequestError, ProtocolError) as exc:
            self._errors += 1
            self._reply(ident, error_reply(exc))
            return
        if role is not None and not self._authorized(ident, msg, role):
            return
        match msg:
            case GenerateRequest():
                self._start_generate(ident, msg, role=role)
            case Ping(seq=seq):
                self._reply(ident, Pong(seq, self.stats(ident)))
            case Abort(rid=rid):
                self._abort(ident, rid)
            case _:
                self._start_control(ident, msg)

    def _authorized(self, ident: bytes, msg: msgspec.Struct, role: str) -> bool:
        try:
            authorize(msg, role)
        except PermissionDeniedError as exc:
            self._errors += 1
            self._reply(ident, error_reply(exc, call_id=getattr(msg, "call_id", None), rid=getattr(msg, "rid", None)))
            return False
        if role != "control" and isinstance(msg, GetInfo):
            self._reply(ident, ControlReply(call_id=msg.call_id, message="ok", info=self._info_for(role)))
            return False  # answered here, with what this role may see
        return True

    def _start_generate(
        self, ident: bytes, req: GenerateRequest, *, checked: bool = False, role: str | None = None
    ) -> None:
        rid = req.rid
        try:
            if self._draining:
                raise ServerShuttingDownError(f"server {self.server_id} is shutting down")
            if self._failure is not None or self.engine.dead is not None:
                raise EngineDeadError(f"engine of server {self.server_id} is dead: {self.engine.dead}")
            if not rid:
                raise InvalidRequestError("rid", rid, "must be a non-empty string")
            self._check_supported(req)
            key = (ident, rid)
            if key in self._by_client:
                raise DuplicateRequestError("rid", rid, "a request with this rid is already in flight")
            # fair share by credential (its role) where authentication is on, by identity where it is off
            share_key = role.encode() if role is not None else None
            self._peers.admit(ident, len(self._flights), self._now, share_key)
            if not checked:
                check_against_limits(req, self.engine.limits)
        except RolloutError as exc:
            if isinstance(exc, ServerBusyError):
                self._busy += 1
            else:
                self._errors += 1
            self._reply(ident, error_reply(exc, rid=rid))
            return
        engine_rid = f"{ident.hex()}:{rid}"
        flight = _Flight(ident, rid, big=checked)
        self._flights[engine_rid] = flight
        self._by_client[key] = engine_rid
        self._peers.accepted(ident, share_key)
        self._idle.clear()
        assert self._tg is not None
        # the request is this server's own object (decoded from the frame here or off the loop): the engine
        # rid is set in place, with no copy and no second validation pass over its ids
        msgspec.structs.force_setattr(req, "rid", engine_rid)
        flight.engine_rid = engine_rid
        if req.probation and self.engine.reports_steps:
            self._enter_line(flight)
        flight.task = self._tg.create_task(self._run_generate(flight, req, engine_rid))

    def _check_supported(self, req: GenerateRequest) -> None:
        engine = self.engine
        check_weight_version(req, engine.weight_version, f"server {self.server_id}")
        if req.score_only and not engine.supports_score:
            raise UnsupportedOperationError(
                f"score_only=True: the {engine.backend!r} engine of server {self.server_id} cannot score prompts"
            )
        if req.return_routed_experts and not engine.supports_routed_experts:
            raise UnsupportedOperationError(
                f"return_routed_experts=True: the {engine.backend!r} engine of server {self.server_id} does not "
                "report MoE routing (SGLang does, for MoE models)"
            )

    async def _run_generate(self, flight: _Flight, req: GenerateRequest, engine_rid: str) -> None:
        reply: msgspec.Struct
        try:
            result: GenerateResult
            if flight.turn is not None:
                await flight.turn  # a probation request behind another (module docstring)
            if flight.aborted:  # aborted before the engine saw it: answered as an abort with no tokens
                result = GenerateResult(
                    rid=req.rid,
                    output_ids=[],
                    finish_reason="abort",
                    prompt_tokens=len(req.input_ids),
                    weight_version=self.engine.weight_version,
                    logprobs=[] if req.return_logprobs else None,
                )
            else:  # no await between the check and the engine registering the request (its first step)
                result = await self.engine.generate(req)
            reply = msgspec.structs.replace(
                result, rid=flight.rid, server_id=self.server_id, incarnation=self.incarnation
            )
            if self.metrics is not None:
                self.metrics.observe_result(self.server_id, result)
            if result.finish_reason == "abort":
                self._aborted += 1
            else:
                self._completed += 1
        except asyncio.CancelledError:
            self._errors += 1
            self._reply(flight.ident, error_reply(ServerShuttingDownError("server stopped"), rid=flight.rid))
            raise
        except RolloutError as exc:
            self._errors += 1
            reply = error_reply(exc, rid=flight.rid)
        except Exception as exc:  # one request's failure: the engine dies only through wait_dead()
            log.exception("server %s: engine failed request %s", self.server_id, flight.rid)
            self._errors += 1
            reply = error_reply(RequestFailedError(f"{type(exc).__name__}: {exc}"), rid=flight.rid)
        finally:
            if flight.probation:
                self._leave_line(flight)
            self._flights.pop(engine_rid, None)
            self._by_client.pop((flight.ident, flight.rid), None)
            self._peers.answered(flight.ident)
            if not self._flights:
                self._idle.set()
        self._reply(flight.ident, reply)
        if flight.big:
            await free_ids_in_chunks(req)

    def _abort(self, ident: bytes, rid: str) -> int:
        if rid:
            engine_rid = self._by_client.get((ident, rid))
            if engine_rid is not None:
                self._abort_one(engine_rid)
                return 1
            return 0
        if not self._peers.holds(ident):
            return 0
        n = 0
        for (who, _), engine_rid in list(self._by_client.items()):
            if who == ident:
                self._abort_one(engine_rid)
                n += 1
        return n

    def _abort_one(self, engine_rid: str) -> None:
        flight = self._flights.get(engine_rid)
        if flight is not None:
            flight.aborted = True  # in case its task has not reached the engine yet
            if flight.turn is not None and not flight.turn.done():  # waiting in its line: answered now
                self._leave_line(flight)
                flight.turn.set_result(None)
        self.engine.abort(engine_rid)

    # -- probation (module docstring) -----------------------------------------------------------------

    def _enter_line(self, flight: _Flight) -> None:
        flight.probation = True
        line = self._lines.get(flight.ident)
        if line is None:
            line = self._lines[flight.ident] = _Line()
        if line.current or line.waiting:
            flight.turn = asyncio.get_running_loop().create_future()
            line.waiting.append(flight)
        else:
            line.current = flight.engine_rid

    def _leave_line(self, flight: _Flight) -> bool:
        """``flight`` no longer holds its line (stepped, ended, or aborted while waiting): hand the engine the
        next one.  True when one was handed over."""
        line = self._lines.get(flight.ident)
        if line is None:
            return False
        if line.current == flight.engine_rid:
            line.current = ""
        elif flight in line.waiting:
            line.waiting.remove(flight)
        handed = False
        while not line.current and line.waiting:
            nxt = line.waiting.popleft()
            if nxt.turn is not None and not nxt.turn.done():
                nxt.turn.set_result(None)
            if not nxt.aborted:  # an aborted one answers without the engine: it holds nothing
                line.current = nxt.engine_rid
                handed = True
        if not line.current and not line.waiting:
            del self._lines[flight.ident]
        return handed

    def _on_stepped(self, engine_rids: list[str]) -> bool:
        """The engine's step listener (engines/base.py): tell each client, hand over the next in its line."""
        handed = False
        for engine_rid in engine_rids:
            flight = self._flights.get(engine_rid)
            if flight is None or not flight.probation or flight.stepped:
                continue
            flight.stepped = True
            self._reply(flight.ident, Stepped(flight.rid))
            handed = self._leave_line(flight) or handed
        return handed

    # -- large frames (frames.py) ---------------------------------------------------------------------

    def _start_offloaded(self, ident: bytes, payload: bytes, role: str | None) -> None:
        self._peers.heard(ident, self._now)
        if not self._decoder.try_reserve(ident):  # back-pressure without waiting: this peer gets busy
            self._refuse_busy_frame(ident, payload)
            return
        assert self._tg is not None
        task = self._tg.create_task(self._run_offloaded(ident, payload, role))
        self._offloaded.add(task)  # cancelled at shutdown: a decode must not hold the server's exit
        task.add_done_callback(self._offloaded.discard)

    async def _run_offloaded(self, ident: bytes, payload: bytes, role: str | None) -> None:
        """Decode a large GenerateRequest in the worker process; turn its ids into ints a chunk at a time."""
        try:
            ok, head, raw_ids = await self._decoder.decode(payload, self.engine.limits)
            del payload
            if not ok:
                self._errors += 1
                assert self._endpoint is not None
                self._endpoint.send(ident, head)
                return
            stub = decode_client_message(head)
            assert isinstance(stub, GenerateRequest)
            # validated in the worker already
            table = await self._ints.get(self.engine.limits.vocab_size)
            msgspec.structs.force_setattr(stub, "input_ids", await ids_from_uint32(raw_ids, table))
            del raw_ids
            self._start_generate(ident, stub, checked=True, role=role)
        except Exception as exc:  # a broken worker fails this request, not the server
            log.exception("server %s: decoding a large request failed", self.server_id)
            self._errors += 1
            self._reply(ident, error_reply(RemoteError(f"decoding failed: {type(exc).__name__}: {exc}")))
        finally:
            self._decoder.release(ident)

    # -- control -----------------------------------------------------------------------------------

    def _start_control(self, ident: bytes, msg: Any) -> None:
        assert self._tg is not None
        if self._draining and not isinstance(msg, GetInfo):
            self._reply(ident, error_reply(ServerShuttingDownError("server is shutting down"), call_id=msg.call_id))
            return
        task = self._tg.create_task(self._run_control(ident, msg))
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    async def _run_control(self, ident: bytes, msg: Any) -> None:
        t0 = time.perf_counter()
        call_id: str = msg.call_id
        ok = False
        try:
            try:
                async with asyncio.timeout(self.config.control_timeout_s):
                    message = await self._control(msg)
            except TimeoutError as exc:
                raise RequestTimeoutError(
                    f"{type(msg).__name__} did not finish within control_timeout_s={self.config.control_timeout_s}"
                ) from exc
            ok = True
            reply: msgspec.Struct = ControlReply(
                call_id=call_id,
                message=message,
                info=self.info() if isinstance(msg, GetInfo) else None,
                weight_version=self.engine.weight_version,
                elapsed_s=time.perf_counter() - t0,
            )
        except asyncio.CancelledError:
            self._reply(ident, error_reply(ServerShuttingDownError("server stopped"), call_id=call_id))
            raise
        except RolloutError as exc:
            reply = error_reply(exc, call_id=call_id)
        except Exception as exc:
            log.exception("server %s: control %s failed", self.server_id, type(msg).__name__)
            reply = error_reply(RemoteError(f"{type(exc).__name__}: {exc}"), call_id=call_id)
        finally:
            if self.metrics is not None and not isinstance(msg, GetInfo):
                op = str(msg.__struct_config__.tag)  # the wire tag: update_weights_dist, pause, ...
                self.metrics.observe_control(self.server_id, op, time.perf_counter() - t0, ok=ok)
        self._reply(ident, reply)

    async def _control(self, msg: Any) -> str:
        engine = self.engine
        if engine.dead is not None and not isinstance(msg, GetInfo):
            raise EngineDeadError(f"engine of server {self.server_id} is dead: {engine.dead}")
        match msg:
            case GetInfo():
                return "ok"
            case PauseGeneration(mode=mode):
                await engine.pause(mode)
            case ResumeGeneration():
                await engine.resume()
            case FlushCache():
                await engine.flush_cache()
            case ReleaseMemory(tags=tags, wait=wait):
                await self._release_memory(tags, wait)
            case ResumeMemory(tags=tags):
                await engine.resume_memory(tags)
            case SetWeightVersion(version=v):
                await engine.set_weight_version(v)
            case SessionHints(hints=hints):
                engine.session_hints(hints)
            case InitWeightGroup():
                await engine.init_weight_group(msg)
            case UpdateWeightsDistributed():
                await engine.update_weights_distributed(msg)
            case UpdateWeightsFromIpc():
                await engine.update_weights_from_ipc(msg)
            case DestroyWeightGroup(group_name=name):
                await engine.destroy_weight_group(name)
            case _:  # pragma: no cover - the decoder only admits the types above
                raise UnsupportedOperationError(f"unknown control message {type(msg).__name__}")
        return "ok"

    async def _release_memory(self, tags: Sequence[str] | None, wait: bool) -> None:
        # held requests (a pause in 'hold' mode) may stay: the engine checks that none of them keeps memory
        if self._flights and not self.engine.paused:
            if not wait:
                raise EngineBusyError(
                    f"cannot release memory: {len(self._flights)} request(s) in flight "
                    "(pause with mode='abort' first, or pass wait=True)"
                )
            await self._idle.wait()
        await self.engine.release_memory(tags)

    # -- shutdown ----------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Within the shutdown bound: cancel control calls, drain, abort, cancel; every request answered."""
        self._draining = True
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.config.shutdown_timeout_s
        reserve = min(2.5, 0.25 * self.config.shutdown_timeout_s)  # closing the socket (linger) and the engine
        controls = list(self._controls)
        for ctask in controls:  # they answer ServerShuttingDownError
            ctask.cancel()
        for otask in list(self._offloaded):  # not accepted yet: dropped (a client resends on reconnect)
            otask.cancel()
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=min(self.config.drain_timeout_s, self._time_left(reserve)))
            if pending:
                log.info("server %s: aborting %d request(s) still in flight", self.server_id, len(pending))
                self.engine.abort_all()
                _, pending = await asyncio.wait(pending, timeout=self._time_left(reserve) / 2)
                for task in pending:  # an engine that ignores abort: cancel; the task still replies
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=self._time_left(reserve))
        if controls:
            await asyncio.wait(controls, timeout=self._time_left(reserve))
