"""``Gateway``: an OpenAI-compatible HTTP server in front of a :class:`~rollout_sdk.RolloutClient`.

Lifecycle (like the client's)::

    UNOPENED ──open() / async with──▶ OPEN ──aclose()──▶ CLOSED   (aclose idempotent; never reopens)

Concurrency::

    aiohttp (one handler task per HTTP request) ──▶ TurnService ──▶ RolloutClient.generate
         │  admission: at most max_in_flight model calls at once (429 beyond, never an unbounded wait)
         └─ sessions: SessionStore (max_sessions; keys' auto sessions at most max_auto_sessions, and
            forgotten when their call fails before a turn) ── finish / idle ──▶ finished queue (at most
            max_sessions live entries) ──▶ ONE of: trajectories(), the JSONL writer task (removes a
            session once written), or GET /v1/trajectories/stream handlers (at most max_export_streams;
            each writes a record and awaits its drain before taking the next: TCP back-pressure; a sent
            record waits, leased, for POST /v1/trajectories/ack (at most `window` per stream) and goes
            back to the queue when its stream's connection is lost or export_ack_timeout_s passes: at
            least once) ──▶ exported records, the last keep_exported kept for GET
    owned tasks: the idle reaper and (with trajectories_jsonl) the JSONL writer; both cancelled and
    awaited by aclose(), which first stops the listener, then finishes every open session.

Example::

    async with Gateway() as gw:                          # embedded CPU engine, loopback, free port
        s = gw.session()                                 # s.base_url / s.api_key for the agent
        ...  # run any OpenAI-API agent against s.base_url
        gw.finish(s.id, reward=1.0)
        async for traj in gw.trajectories():             # Trajectory objects, as agents produce
            ...
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .._aio import LifecycleGuard, OpenedWith, await_unless, cancel_and_wait
from ..agents import Trajectory
from ..client import RolloutClient
from ..errors import ClientStateError, ConfigError
from ..metrics import render_metrics
from .bodies import PromptLimits
from .config import GatewayConfig
from .errors import GatewayError
from .listener import BoundedSite
from .records import ExportLease, SessionRecord, session_record
from .routes import build_app
from .sampling import SessionSampling
from .service import Outcome, TurnService, keeps_call_content, keeps_reasoning, vocab_bounds
from .sessions import Session, SessionStore

__all__ = ["Gateway", "GatewayConfig", "SessionHandle", "read_trajectories"]

log = logging.getLogger("rollout_sdk.gateway")

#: after answering a request whose body was not read whole (a 413, a 408, an early 401), aiohttp reads and
#: drops the rest for at most this long (so the client sees the answer, not a reset), then closes
LINGER_S = 2.0


@dataclass(frozen=True)
class SessionHandle:
    """What an agent needs to talk to one session: either ``base_url`` (path form) or ``api_key``."""

    id: str
    base_url: str
    api_key: str
    #: the shared base URL (``/v1``), for clients that take the session as ``api_key``
    shared_base_url: str


class Gateway(OpenedWith):
    """An OpenAI-compatible gateway that records every token of every session for the trainer.

    ``client``: a :class:`~rollout_sdk.RolloutClient` you opened (the gateway does not close it); or
    ``servers`` / nothing, and the gateway opens (and closes) its own client (nothing: the embedded CPU
    engine).  ``tokenizer``: a tokenizer object to use instead of loading one.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        servers: list[str] | None = None,
        config: GatewayConfig | None = None,
        tokenizer: Any = None,
        client_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if client is not None and (servers is not None or client_options):
            raise ConfigError("servers", servers, "give an open client or servers, not both")
        fields = {f.name for f in dataclasses.fields(GatewayConfig)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(f"Gateway() got unexpected keyword argument(s): {', '.join(unknown)}")
        base = config or GatewayConfig()
        self.config = dataclasses.replace(base, **options) if options else base
        self._client = client
        self._owns_client = client is None
        self._servers = servers
        self._client_options = dict(client_options or {})
        self._tokenizer = tokenizer
        self._life = LifecycleGuard("Gateway", error=ClientStateError)
        cfg = self.config
        auto = cfg.max_auto_sessions
        self.store = SessionStore(
            max_sessions=cfg.max_sessions,
            max_turns=cfg.max_turns_per_session,
            max_auto_sessions=max(1, cfg.max_sessions - cfg.max_sessions // 10) if auto is None else auto,
        )
        self._service: TurnService | None = None
        self._runner: Any = None
        self._site: Any = None
        self._background: asyncio.Task[None] | None = None  # runs the gateway's own tasks in one group
        self._closed = asyncio.Event()
        #: set when closing begins: export streams end then (the listener is going away)
        self._stopping = asyncio.Event()
        self._in_flight = 0
        self.model_name = ""
        self.created = int(time.time())
        self.host = self.config.host
        self.port = 0
        self.served_turns = 0
        self.rejected_busy = 0
        #: records of exported sessions, newest last (bounded by keep_exported)
        self._exported: collections.OrderedDict[str, SessionRecord] = collections.OrderedDict()
        self.export_streams = 0
        self.exported_sessions = 0
        #: sessions sent on an export stream, not yet acknowledged: id -> (session, its stream's lease,
        #: the timer that gives it back)
        self._unacked: dict[str, tuple[Session, ExportLease, asyncio.TimerHandle]] = {}
        self.redelivered_sessions = 0
        self._registry: Any = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the client (if owned), load the tokenizer, start listening.  A gateway opens once."""
        await self._life.open_with(self._open, self._teardown)

    async def _open(self) -> None:
        cfg = self.config
        if self._client is None:
            self._client = RolloutClient(servers=self._servers, **self._client_options)
            await self._client.open()
        model_path = str(self._client.model_path)
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(_load_tokenizer, cfg.tokenizer, model_path)
        self.model_name = cfg.model_name or (Path(model_path).name if model_path else "") or "rollout-sdk"
        token_chars, caps = await asyncio.to_thread(vocab_bounds, tokenizer)
        call_content = await asyncio.to_thread(keeps_call_content, tokenizer)
        reasoning = await asyncio.to_thread(keeps_reasoning, tokenizer)
        self._service = TurnService(
            self._client,
            tokenizer,
            model=self.model_name,
            config=cfg,
            max_token_chars=token_chars,
            char_caps=caps,
            call_content=call_content,
            reasoning=reasoning,
        )
        self._runner = web.AppRunner(
            build_app(self),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=5,
            keepalive_timeout=cfg.header_timeout_s,  # aiohttp closes a connection idle in its head this long
            lingering_time=LINGER_S,  # the unread rest of a refused body is drained this long at most
        )
        await self._runner.setup()
        # bind the socket here (port 0: a free one) and hand it to aiohttp, so the bound port is known
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.create_server((cfg.host, cfg.port), family=family, backlog=cfg.backlog)
        # aiohttp listens again with its own backlog (128 unless told): pass ours, or a burst overflows it
        self._site = BoundedSite(self._runner, sock, backlog=cfg.backlog, max_connections=cfg.max_connections)
        await self._site.start()
        self.host, self.port = sock.getsockname()[:2]
        self._background = asyncio.get_running_loop().create_task(self._run_background(), name="gateway")

    async def aclose(self) -> None:
        """Stop listening, finish every open session, stop the owned tasks and client.  Idempotent."""
        await self._life.close_with(self._teardown)

    async def _teardown(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()  # stops the listener; cancels handlers still running
        for session in list(self.store.sessions.values()):
            self.store.finish(session, reason="closed")
        for sid in list(self._unacked):  # streams are gone: what they did not get acknowledged is queued again
            self._unacked[sid][2].cancel()
            self._expire(sid)
        self._closed.set()
        background, self._background = self._background, None
        if background is not None:
            await _drain(background)
        if self._service is not None:
            self._service.close()
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _check_open(self) -> None:
        self._life.check_open("use it inside 'async with Gateway() as gw'")

    # -- addresses ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The OpenAI base URL: ``http://host:port/v1``."""
        return f"http://{_host(self.host)}:{self.port}/v1"

    @property
    def client(self) -> Any:
        return self._client

    # -- sessions ----------------------------------------------------------------------------------

    def session(
        self,
        session_id: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        sampling: SessionSampling | dict[str, Any] | None = None,
    ) -> SessionHandle:
        """Open a session; give the agent ``handle.base_url`` (or ``api_key`` with :attr:`url`).

        ``metadata`` is exported with its trajectories; ``sampling`` (a :class:`SessionSampling` or its
        JSON form) fixes sampling fields for every call of the session and caps ``max_tokens``."""
        self._check_open()
        if isinstance(sampling, dict):
            sampling = SessionSampling.from_json(sampling)
        elif sampling is not None:
            sampling.check()
        s = self.store.create(session_id, metadata, sampling)
        root = f"http://{_host(self.host)}:{self.port}"
        return SessionHandle(id=s.id, base_url=f"{root}/s/{s.id}/v1", api_key=s.id, shared_base_url=self.url)

    def get_session(self, session_id: str) -> Session:
        return self.store.get(session_id, create=False)

    def reward(self, session_id: str, value: float, *, finish: bool = True) -> bool:
        """Set a session's reward (every trajectory of it gets it); by default also finish it."""
        self._check_open()
        session = self.store.get(session_id, create=False)
        session.reward = _finite(value, "reward")
        return self.store.finish(session) if finish else False

    def turn_reward(
        self, session_id: str, value: float, *, turn: int | None = None, response_id: str | None = None
    ) -> None:
        """Give one served turn of a session its own reward (``Turn.reward`` in every trajectory holding
        it): by ``turn``, its index in serving order, or by the ``response_id`` the agent got."""
        self._check_open()
        session = self.store.get(session_id, create=False)
        session.set_turn_reward(_finite(value, "reward"), turn=turn, response_id=response_id)

    def session_record(self, session_id: str, *, per_turn: bool = True) -> SessionRecord:
        """The trainer's view of one session (open, finished, or exported and still kept)."""
        self._check_open()
        kept = self._exported.get(session_id)
        if kept is not None:
            return kept if per_turn else msgspec.structs.replace(kept, turns=[])
        return session_record(self.store.get(session_id, create=False), per_turn=per_turn)

    def finish(self, session_id: str, *, reward: float | None = None) -> bool:
        """Finish a session: its trajectories go to :meth:`trajectories`.  False if already finished."""
        self._check_open()
        return self.store.finish(self.store.get(session_id, create=False), reward=reward)

    def prompt_limits(self) -> PromptLimits | None:
        """The most any prompt can hold (None before the gateway is open)."""
        return None if self._service is None else self._service.prompt_limits()

    async def probe(self, texts: list[str], param: str) -> None:
        """Refuse a body whose first counted characters alone cannot fit (:meth:`TurnService.probe`)."""
        if self._service is not None:
            await self._service.probe(texts, param)

    async def serve_turn(
        self, session: Session, body: dict[str, Any], *, chat: bool, id_prefix: str = "chatcmpl-"
    ) -> Outcome:
        """One model call of ``session`` (used by the HTTP routes)."""
        self._check_open()
        assert self._service is not None
        if self._in_flight >= self.config.max_in_flight:
            self.rejected_busy += 1
            raise GatewayError(
                429,
                f"{self._in_flight} model calls in flight (max_in_flight); retry later",
                type="rate_limit_error",
                code="busy",
            )
        self._in_flight += 1
        try:
            outcome = await (
                self._service.chat(session, body, id_prefix=id_prefix)
                if chat
                else self._service.complete(session, body)
            )
        finally:
            self._in_flight -= 1
        self.served_turns += len(outcome.choices)
        return outcome

    # -- to the trainer ----------------------------------------------------------------------------

    async def trajectories(self) -> AsyncIterator[Trajectory]:
        """Every trajectory of every finished session, as sessions finish (several per branched session).

        Ends once the gateway is closed and everything finished before has been yielded.
        """
        self._check_consumable()
        async for session in self.finished_sessions():
            if session is not None:
                for traj in self._export(session).trajectories:
                    yield traj

    def _check_consumable(self) -> None:
        if self.config.trajectories_jsonl:
            raise ClientStateError("this gateway writes its trajectories to trajectories_jsonl; read that file")

    async def finished_sessions(
        self, heartbeat_s: float | None = None, *, http: bool = False, room: asyncio.Event | None = None
    ) -> AsyncGenerator[Session | None, None]:
        """Finished sessions as they come (each to one consumer); ``None`` after ``heartbeat_s`` without
        one.  The consumer exports a session (:meth:`_export`), leases it (:meth:`_lease`) or gives it back
        (``store.requeue``).  ``room``: the next session is taken only while it is set (an export stream's
        window of unacknowledged records).  Ends once closed and drained; ``http`` consumers (export
        streams) end as soon as closing begins."""
        queue = self.store.finished
        end = self._stopping if http else self._closed
        while True:
            if end.is_set() and (http or queue.empty()):
                return
            if room is not None and not room.is_set():
                await await_unless(room.wait(), end.wait(), timeout=heartbeat_s)
                if not room.is_set() and not end.is_set():
                    yield None
                continue
            session = await await_unless(queue.get(), end.wait(), timeout=heartbeat_s)
            if session is not None:
                if session.state == "exported":  # acknowledged while it waited in the queue again
                    continue
                yield session
            elif not end.is_set():
                yield None

    def _export(self, session: Session, record: SessionRecord | None = None) -> SessionRecord:
        """The session leaves the store for the trainer; its record stays readable (``keep_exported``)."""
        record = record or session_record(session, state="exported")
        self.store.taken(session)
        self.exported_sessions += 1
        if self.config.keep_exported:
            self._exported[session.id] = record
            while len(self._exported) > self.config.keep_exported:
                self._exported.popitem(last=False)
        return record

    # -- at-least-once delivery of export streams -------------------------------------------------

    def _lease(self, session: Session, lease: ExportLease, record: SessionRecord | None) -> None:
        """``session``'s record was written to an export stream: it stays in the store until acknowledged,
        and goes back to the queue ``export_ack_timeout_s`` after being sent if it is not."""
        timer = asyncio.get_running_loop().call_later(self.config.export_ack_timeout_s, self._expire, session.id)
        self._unacked[session.id] = (session, lease, timer)
        lease.add(session.id, record)

    def _expire(self, sid: str) -> None:
        entry = self._unacked.pop(sid, None)
        if entry is None:
            return
        session, lease, _ = entry
        lease.remove(sid)
        if session.state == "finished":
            self.redelivered_sessions += 1
            self.store.requeue(session)

    def sent(self, session: Session, record: SessionRecord | None, lease: ExportLease | None) -> None:
        """``session``'s record was written to a consumer: leased until acknowledged (``lease``), or, with
        none (at-most-once consumers), exported now."""
        if lease is not None:
            self._lease(session, lease, record)
        else:
            self._export(session, record)

    def release(self, lease: ExportLease) -> None:
        """The consumer holding ``lease`` went away: what it did not acknowledge goes back to the queue now."""
        for sid in list(lease.records):
            self._expire(sid)

    def ack(self, ids: list[str]) -> dict[str, list[str]]:
        """Acknowledge delivered records by session id: they leave the store (exported).  Idempotent: an id
        already exported is reported as such; an id never finished, or unknown, is not acknowledged."""
        acked, already, unknown = [], [], []
        for sid in ids:
            entry = self._unacked.pop(sid, None)
            record = None
            if entry is not None:
                _, lease, timer = entry
                timer.cancel()
                record = lease.remove(sid)
            session = self.store.sessions.get(sid)
            if session is not None and session.state == "finished":
                self._export(session, record)
                acked.append(sid)
            elif self.store.was_taken(sid):
                already.append(sid)
            else:
                unknown.append(sid)
        return {"acknowledged": acked, "already_acknowledged": already, "unknown": unknown}

    async def _write_jsonl(self, path: str) -> None:
        """Each finished session's trajectories appended to ``path``; the session leaves the store only once
        written (a failed write is logged and the session stays queued: nothing is lost)."""
        async for session in self.finished_sessions():
            if session is None:
                continue
            record = session_record(session, state="exported")
            if record.trajectories:
                try:
                    await asyncio.to_thread(_append_jsonl, path, record.trajectories)
                except OSError:
                    log.exception("writing %s failed; session %s stays queued", path, session.id)
                    self.store.requeue(session)
                    await asyncio.sleep(1.0)  # a full disk is not retried in a busy loop
                    continue
            self._export(session, record)

    async def _run_background(self) -> None:
        """The gateway's own tasks, in one task group: the idle-session reaper (cancelled at close) and the
        JSONL writer (it ends by itself once closed and drained)."""
        cfg = self.config
        async with asyncio.TaskGroup() as tg:
            reaper = None
            if cfg.session_idle_timeout_s is not None:
                reaper = tg.create_task(self._reap(cfg.session_idle_timeout_s), name="gateway-reaper")
            if cfg.trajectories_jsonl:
                tg.create_task(self._write_jsonl(cfg.trajectories_jsonl), name="gateway-jsonl")
            await self._closed.wait()
            if reaper is not None:
                reaper.cancel()

    async def _reap(self, timeout_s: float) -> None:
        while True:
            await asyncio.sleep(min(timeout_s / 4, 30.0))
            for session in self.store.idle(time.monotonic(), timeout_s):
                self.store.finish(session, reason="idle")

    def metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition of ``/metrics``: the gateway's own series and its client's."""
        if self._registry is None:
            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(_GatewayCollector(self))
        client_metrics = getattr(self._client, "metrics", None)
        registries = [self._registry] + ([client_metrics.registry] if client_metrics is not None else [])
        return render_metrics(*registries)

    def health(self) -> dict[str, Any]:
        client = self._client
        alive = sum(1 for s in client.servers if s.alive) if client is not None else 0
        return {
            "status": "ok" if self._life.is_open and alive else "unavailable",
            "model": self.model_name,
            "servers_alive": alive,
            "sessions": len(self.store.sessions),
            "in_flight": self._in_flight,
            "served_turns": self.served_turns,
        }


class _GatewayCollector:
    """The gateway's counts, read at scrape time (docs/observability.md lists them)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def collect(self) -> Any:
        gw = self.gw
        sessions = list(gw.store.sessions.values())
        opened = sum(1 for s in sessions if s.state == "open")
        yield GaugeMetricFamily("rollout_gateway_sessions_open", "Sessions open now.", value=opened)
        yield GaugeMetricFamily(
            "rollout_gateway_sessions_finished_waiting",
            "Finished sessions the trainer has not taken yet (counted in max_sessions).",
            value=len(sessions) - opened,
        )
        yield GaugeMetricFamily("rollout_gateway_calls_in_flight", "Model calls in flight.", value=gw._in_flight)
        yield GaugeMetricFamily(
            "rollout_gateway_export_streams", "Open /v1/trajectories/stream consumers.", value=gw.export_streams
        )
        yield CounterMetricFamily("rollout_gateway_turns", "Turns served (one per choice).", value=gw.served_turns)
        yield CounterMetricFamily(
            "rollout_gateway_rejected_busy", "Calls refused with 429 past max_in_flight.", value=gw.rejected_busy
        )
        yield CounterMetricFamily(
            "rollout_gateway_sessions_exported",
            "Sessions whose trajectories the trainer took.",
            value=gw.exported_sessions,
        )
        yield GaugeMetricFamily(
            "rollout_gateway_export_unacked",
            "Records sent on export streams, not yet acknowledged.",
            value=len(gw._unacked),
        )
        yield CounterMetricFamily(
            "rollout_gateway_export_redelivered",
            "Records given back to the queue unacknowledged (ack timeout, consumer gone).",
            value=gw.redelivered_sessions,
        )
        yield CounterMetricFamily(
            "rollout_gateway_connections_refused",
            "Connections answered 503 past max_connections.",
            value=gw._site.refused if gw._site is not None else 0,
        )


async def _drain(task: asyncio.Task[None]) -> None:
    """The gateway's tasks end by themselves once closed (the JSONL writer once drained); bound the wait,
    then cancel."""
    try:
        await asyncio.wait_for(asyncio.shield(task), 60)
    except TimeoutError:
        await cancel_and_wait(task)


def _finite(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GatewayError(400, f"{name} must be a finite number, got {value!r}", param=name, code="invalid_value")
    return float(value)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _load_tokenizer(path: str | None, model_path: str) -> Any:
    from ..models import load_tokenizer  # lazy: transformers

    if path is None and model_path and os.path.isdir(model_path):
        path = model_path
    return load_tokenizer(path)


_encoder = msgspec.json.Encoder()


def _append_jsonl(path: str, trajs: list[Trajectory]) -> None:
    with open(path, "ab") as f:
        for t in trajs:
            f.write(_encoder.encode(t) + b"\n")


def read_trajectories(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Read a ``trajectories_jsonl`` file back into :class:`~rollout_sdk.agents.Trajectory` objects."""
    decoder = msgspec.json.Decoder(Trajectory)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]
