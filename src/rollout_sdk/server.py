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
      └── engine watchdog .. waits on: engine.wait_dead()
                              then: marks the server failed; in-flight requests already fail with
                              EngineDeadError from the engine; new ones get it at once

    Bound: the server does not queue on its own; the number of request tasks is the number of requests
    clients sent, and clients cap it (back-pressure lives in the client's scheduler, per server).

Shutdown (``stop()``): new requests are refused with ServerShuttingDownError, in-flight ones get
``drain_timeout_s`` to finish, then the rest are aborted (they answer with ``finish_reason='abort'``), the
request tasks are awaited so that every request is answered, and only then the socket closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from . import _transport
from ._aio import await_unless, ended_with
from .engines.base import Engine
from .errors import (
    EngineBusyError,
    EngineDeadError,
    InvalidRequestError,
    ProtocolError,
    RemoteError,
    RequestFailedError,
    RolloutError,
    ServerShuttingDownError,
    UnsupportedOperationError,
)
from .protocol import (
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
    SetWeightVersion,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
    check_against_limits,
    decode_client_message,
    encode,
    error_reply,
)

if TYPE_CHECKING:
    from .metrics import ServerMetrics

__all__ = ["EngineServer", "ServerConfig"]

log = logging.getLogger("rollout_sdk.server")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How a server binds and identifies itself."""

    #: interface to bind ("0.0.0.0" for every interface)
    host: str = "127.0.0.1"
    #: 0 picks a free port (the only sensible choice unless a firewall demands otherwise)
    port: int = 0
    #: the host clients should use; defaults to ``host`` (or this machine's IP when binding 0.0.0.0)
    advertise_host: str | None = None
    #: stable name in stats and results; defaults to a random id
    server_id: str | None = None
    #: seconds in-flight requests get to finish on stop() before they are aborted
    drain_timeout_s: float = 5.0
    dp_rank: int = 0
    tp_size: int = 1


class _Flight:
    __slots__ = ("ident", "rid", "task")

    def __init__(self, ident: bytes, rid: str) -> None:
        self.ident = ident
        self.rid = rid
        self.task: asyncio.Task[None] | None = None


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
        self.server_id = self.config.server_id or f"srv-{uuid.uuid4().hex[:8]}"
        #: Prometheus metrics this server reports into while it serves (docs/observability.md)
        self.metrics = metrics
        #: this start of the server; clients treat a new incarnation at a known address as a new member
        self.incarnation = uuid.uuid4().hex[:12]
        self.address = ""
        self._flights: dict[str, _Flight] = {}  # engine rid -> flight
        self._by_client: dict[tuple[bytes, str], str] = {}  # (ident, client rid) -> engine rid
        self._completed = 0
        self._aborted = 0
        self._errors = 0
        self._draining = False
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._endpoint: _transport.RouterEndpoint | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._started_at = time.monotonic()
        self._failure: BaseException | None = None

    # -- running -----------------------------------------------------------------------------------

    async def serve(self, *, on_ready: Callable[[str], Any] | None = None) -> None:
        """Start the engine, bind, serve until :meth:`stop`, then shut down cleanly."""
        ctx = _transport.new_context()
        try:
            await self.engine.start()
            try:
                self._endpoint = _transport.bind_router(ctx, self.config.host, self.config.port)
                host = self.config.advertise_host or (
                    _transport.local_ip() if self.config.host in ("0.0.0.0", "*") else self.config.host
                )
                self.address = f"tcp://{host}:{self._endpoint.port}"
                log.info("server %s serving %s on %s", self.server_id, self.engine.backend, self.address)
                if self.metrics is not None:
                    self.metrics.attach(self.server_id, self.stats)
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    recv = tg.create_task(self._recv_loop(), name=f"{self.server_id}-recv")
                    watch = tg.create_task(self._watch_engine(), name=f"{self.server_id}-watchdog")
                    if on_ready is not None:
                        on_ready(self.address)
                    await self._stop.wait()
                    await self._drain()
                    recv.cancel()
                    watch.cancel()
            finally:
                self._tg = None
                if self.metrics is not None:
                    self.metrics.detach(self.server_id)
                if self._endpoint is not None:
                    await self._endpoint.close()
                await self.engine.close()
        finally:
            await asyncio.to_thread(ctx.term)  # waits (bounded by linger) for the last replies to leave
            self._stopped.set()

    def stop(self) -> None:
        """Ask the server to shut down (drain, then abort what is left).  Safe from signal handlers."""
        self._draining = True
        self._stop.set()

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
            running=load.running,
            queued=load.queued,
            queued_tokens=load.queued_tokens,
            completed=self._completed,
            aborted=self._aborted,
            errors=self._errors,
            weight_version=self.engine.weight_version,
            engine_alive=self.engine.dead is None,
            paused=self.engine.paused,
            draining=self._draining,
            kv_usage=load.kv_usage,
            kv_used_tokens=load.kv_used_tokens,
            kv_capacity_tokens=load.kv_capacity_tokens,
            max_running_requests=load.max_running_requests,
            incarnation=self.incarnation,
        )

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
            incarnation=self.incarnation,
        )

    # -- loops -------------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._endpoint is not None
        endpoint = self._endpoint
        while True:
            for frames in await endpoint.recv_batch():
                if len(frames) != 2:
                    self._errors += 1
                    if frames:
                        self._reply(frames[0], error_reply(ProtocolError("expected exactly one frame")))
                    continue
                try:
                    self._handle(frames[0], frames[1])
                except Exception as exc:  # a bug here must not take the server down
                    log.exception("server %s: unexpected error handling a message", self.server_id)
                    self._errors += 1
                    self._reply(frames[0], error_reply(RemoteError(f"{type(exc).__name__}: {exc}")))

    async def _watch_engine(self) -> None:
        exc = await self.engine.wait_dead()
        self._failure = exc
        log.error("server %s: engine died: %s", self.server_id, exc)

    def _reply(self, ident: bytes, msg: msgspec.Struct) -> None:
        assert self._endpoint is not None
        if not self._endpoint.send(ident, encode(msg)):
            log.debug("server %s: peer gone, reply dropped", self.server_id)

    def _handle(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = decode_client_message(payload)
        except (InvalidRequestError, ProtocolError) as exc:
            self._errors += 1
            self._reply(ident, error_reply(exc))
            return
        match msg:
            case GenerateRequest():
                self._start_generate(ident, msg)
            case Ping(seq=seq):
                self._reply(ident, Pong(seq, self.stats(ident)))
            case Abort(rid=rid):
                self._abort(ident, rid)
            case _:
                self._start_control(ident, msg)

    def _start_generate(self, ident: bytes, req: GenerateRequest) -> None:
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
                raise InvalidRequestError("rid", rid, "a request with this rid is already in flight")
            check_against_limits(req, self.engine.limits)
        except RolloutError as exc:
            self._errors += 1
            self._reply(ident, error_reply(exc, rid=rid))
            return
        engine_rid = f"{ident.hex()}:{rid}"
        flight = _Flight(ident, rid)
        self._flights[engine_rid] = flight
        self._by_client[key] = engine_rid
        self._idle.clear()
        assert self._tg is not None
        flight.task = self._tg.create_task(
            self._run_generate(flight, msgspec.structs.replace(req, rid=engine_rid), engine_rid)
        )

    def _check_supported(self, req: GenerateRequest) -> None:
        engine = self.engine
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
            result: GenerateResult = await self.engine.generate(req)
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
            self._flights.pop(engine_rid, None)
            self._by_client.pop((flight.ident, flight.rid), None)
            if not self._flights:
                self._idle.set()
        self._reply(flight.ident, reply)

    def _abort(self, ident: bytes, rid: str) -> None:
        if rid:
            engine_rid = self._by_client.get((ident, rid))
            if engine_rid is not None:
                self.engine.abort(engine_rid)
            return
        for (who, _), engine_rid in list(self._by_client.items()):
            if who == ident:
                self.engine.abort(engine_rid)

    # -- control -----------------------------------------------------------------------------------

    def _start_control(self, ident: bytes, msg: Any) -> None:
        assert self._tg is not None
        self._tg.create_task(self._run_control(ident, msg))

    async def _run_control(self, ident: bytes, msg: Any) -> None:
        t0 = time.perf_counter()
        call_id: str = msg.call_id
        ok = False
        try:
            message = await self._control(msg)
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
        self._draining = True
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout_s)
            if pending:
                log.info("server %s: aborting %d request(s) still in flight", self.server_id, len(pending))
                self.engine.abort_all()
                _, pending = await asyncio.wait(pending, timeout=5.0)
                for task in pending:  # an engine that ignores abort: cancel; the task still replies
                    task.cancel()
                if pending:
                    await asyncio.wait(pending)
