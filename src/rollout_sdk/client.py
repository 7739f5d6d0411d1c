"""``RolloutClient``: the object users hold.  ``async with RolloutClient() as client: ...``

Lifecycle (httpx-style, explicit)::

    UNOPENED ──__aenter__/open()──▶ OPEN ──aclose()/__aexit__──▶ CLOSED
                                                   (aclose is idempotent; a closed client never reopens)

Opening finds the servers (explicit addresses, a discovery object, or, with no arguments, an embedded
CPU-engine server started in this process), connects a DEALER socket to each, waits for each to answer
(``connect_timeout_s``), and starts one supervisor task that runs every connection's reader, heartbeat and
monitor loops in a task group.  The supervisor is a plain task owned by the client, not a task group held
open across ``__aenter__``/``__aexit__``, so the client works when those run in different tasks (as in
pytest-asyncio fixtures) and under plain ``asyncio.run``.

Closing aborts this client's requests on every server, fails what still waits with ClientStateError,
cancels the supervisor and every stream, closes the sockets and stops embedded servers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from . import _transport
from ._aio import await_unless, cancel_and_wait, ended_with
from ._connection import ServerConnection
from ._control import WeightSync, broadcast_control, update_weights_ipc
from ._stream import Prompt, ResultStream
from .discovery import Discovery, EmbeddedServers, StaticServers
from .engines.cpu import CpuEngineConfig
from .errors import ClientStateError, ConfigError, NoServersError, RequestTimeoutError
from .policies import Policy
from .protocol import (
    FlushCache,
    GenerateRequest,
    GenerateResult,
    PauseGeneration,
    ReleaseMemory,
    ResumeGeneration,
    ResumeMemory,
    SamplingParams,
    ServerInfo,
    SetWeightVersion,
    encode,
)
from .rollouts import RolloutStream
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["ClientConfig", "ClientStats", "RolloutClient", "ServerStatus"]

log = logging.getLogger("rollout_sdk.client")
T = TypeVar("T")
_UNSET: Any = object()


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Everything a :class:`RolloutClient` can be told.  Pass fields as keyword arguments to the client."""

    #: routing policy: "least_load", "round_robin", or a Policy object
    policy: str | Policy = "least_load"
    #: requests kept in flight on one server; more wait in the client (back-pressure)
    max_in_flight_per_server: int = 512
    #: requests allowed to wait in the client; QueueFullError beyond
    max_waiting: int = 1_000_000
    #: session affinity: stay on the session's server while its load <= (1+margin)*min + slack
    affinity_margin: float = 0.5
    affinity_slack: int = 8
    #: default per-call timeout in seconds (None: no timeout)
    timeout_s: float | None = None
    #: times a request is retried on another server when its server dies
    retries: int = 1
    heartbeat_interval_s: float = 1.0
    #: a server that answers no heartbeat for this long is marked dead
    heartbeat_timeout_s: float = 10.0
    #: how long open() waits for servers to be found and to answer
    connect_timeout_s: float = 120.0
    #: embedded default only: how many in-process CPU servers to start
    num_embedded_servers: int = 1

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ConfigError("retries", self.retries, "must be >= 0")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigError("timeout_s", self.timeout_s, "must be > 0 or None")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval_s", self.heartbeat_interval_s, "must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "heartbeat_timeout_s", self.heartbeat_timeout_s, "must be larger than heartbeat_interval_s"
            )
        if self.connect_timeout_s <= 0:
            raise ConfigError("connect_timeout_s", self.connect_timeout_s, "must be > 0")
        self.scheduler_config()  # validates the scheduler's fields

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy,
            max_in_flight_per_server=self.max_in_flight_per_server,
            max_waiting=self.max_waiting,
            affinity_margin=self.affinity_margin,
            affinity_slack=self.affinity_slack,
        )


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


class RolloutClient:
    """The rollout client.

    Example::

        async with RolloutClient() as client:                     # embedded CPU engine
            result = await client.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=32))

        async with RolloutClient(servers=["tcp://10.0.0.5:40123"]) as client:
            async for group in client.generate_many(prompts, n=8):
                ...

    ``servers`` (addresses) or ``discovery`` (a :class:`~rollout_sdk.discovery.Discovery`) say where the
    servers are; with neither, ``RolloutClient()`` starts the embedded default, a CPU-engine server in this
    process (configure its engine with ``engine=CpuEngineConfig(...)``).  Other keyword arguments are
    :class:`ClientConfig` fields.
    """

    def __init__(
        self,
        servers: Sequence[str] | None = None,
        *,
        discovery: Discovery | None = None,
        engine: CpuEngineConfig | None = None,
        config: ClientConfig | None = None,
        **options: Any,
    ) -> None:
        if servers is not None and discovery is not None:
            raise ConfigError("servers", servers, "give servers or discovery, not both")
        fields = {f.name for f in dataclasses.fields(ClientConfig)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(f"RolloutClient() got unexpected keyword argument(s): {', '.join(unknown)}")
        base = config or ClientConfig()
        self.config = dataclasses.replace(base, **options) if options else base
        if discovery is None:
            if servers is not None:
                discovery = StaticServers(servers)
            else:
                discovery = _default_discovery(engine, self.config.num_embedded_servers)
        elif engine is not None:
            raise ConfigError("engine", engine, "only configures the embedded default (no servers/discovery)")
        self._discovery = discovery
        self._state = "unopened"
        self._scheduler = Scheduler(self.config.scheduler_config())
        self._ctx: Any = None
        self._supervisor: asyncio.Task[None] | None = None
        self._owned: set[asyncio.Task[Any]] = set()
        self._broken: BaseException | None = None
        self._rid_prefix = uuid.uuid4().hex[:10]
        self._rid_counter = itertools.count()
        self._weight_sync: WeightSync | None = None
        self._weight_sync_args: dict[str, Any] | None = None
        self._weight_sync_generation = 0
        #: the last weight version pushed through this client
        self.weight_version = 0
        # membership (docs/design.md, "Fleet membership")
        self._member_seq = itertools.count()
        self._tg: asyncio.TaskGroup | None = None
        self._conn_tasks: dict[ServerConnection, asyncio.Task[None]] = {}
        self._retired: collections.deque[ServerConnection] = collections.deque(maxlen=256)
        self._joining: dict[str, asyncio.Task[ServerConnection]] = {}

    # -- lifecycle ---------------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Find and connect to the servers.  Called by ``async with``; a client opens once."""
        if self._state != "unopened":
            raise ClientStateError(f"a RolloutClient opens once (this one is {self._state})")
        self._state = "opening"
        try:
            await self._open()
        except BaseException:
            await self._teardown()
            self._state = "closed"
            raise
        self._state = "open"

    async def _open(self) -> None:
        cfg = self.config
        addresses = await self._discovery.open(cfg.connect_timeout_s)
        self._ctx = _transport.new_context()
        for addr in addresses:
            self._scheduler.add(self._new_connection(addr))
        ready = asyncio.Event()
        sup = self._supervisor = asyncio.get_running_loop().create_task(self._supervise(ready), name="rollout-client")
        stopped = ClientStateError("the client's supervisor stopped before it was ready")
        await await_unless(ready.wait(), sup, error=lambda: ended_with(sup, stopped))
        await asyncio.gather(*(c.handshake(cfg.connect_timeout_s) for c in self._scheduler.servers))
        # the servers found at open define the fleet's weights; later members must match them
        self.weight_version = max([self.weight_version, *(c.reported_version for c in self._scheduler.servers)])

    def _new_connection(self, address: str) -> ServerConnection:
        cfg = self.config
        conn = ServerConnection(
            next(self._member_seq),
            address,
            _transport.DealerChannel(self._ctx, address),
            on_change=self._on_server_change,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            on_replaced=self._on_replaced,
        )
        if self._tg is not None:
            self._start_connection(conn)
        return conn

    def _start_connection(self, conn: ServerConnection) -> None:
        assert self._tg is not None
        self._conn_tasks[conn] = self._tg.create_task(conn.run(), name=f"server-{conn.index}")

    async def _supervise(self, ready: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for conn in self._scheduler.servers:
                    self._start_connection(conn)
                watch = getattr(self._discovery, "watch", None)
                if watch is not None:
                    tg.create_task(self._follow_discovery(watch), name="rollout-client-discovery")
                tg.create_task(asyncio.Event().wait(), name="rollout-client-keepalive")  # servers may all leave
                ready.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("rollout client supervisor failed")
            self._broken = exc
            for conn in self._scheduler.servers:
                conn.mark_dead(f"client failed: {exc!r}")
            raise
        finally:
            self._tg = None

    async def aclose(self) -> None:
        """Abort this client's requests, stop its tasks, close its sockets.  Idempotent."""
        if self._state in ("closed", "closing"):
            return
        self._state = "closing"
        try:
            await self._teardown()
        finally:
            self._state = "closed"

    async def _teardown(self) -> None:
        if self._weight_sync is not None:
            sync, self._weight_sync = self._weight_sync, None
            try:
                await asyncio.wait_for(sync.close(), 30)
            except Exception:
                log.warning("closing the weight sync failed", exc_info=True)
        owned = list(self._owned)
        for task in owned:
            task.cancel()
        if owned:
            await asyncio.gather(*owned, return_exceptions=True)
        for conn in self._scheduler.servers:
            conn.abort_all()
            conn.mark_dead("client closed", ClientStateError("the RolloutClient was closed"))
        if self._supervisor is not None:
            self._supervisor.cancel()
            try:
                await self._supervisor
            except BaseException:
                pass
            self._supervisor = None
        for conn in self._scheduler.servers:
            await conn.channel.close()
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            await asyncio.to_thread(ctx.term)  # bounded by the sockets' linger
        await self._discovery.close()

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClientStateError(
                f"RolloutClient is {self._state}: use it inside 'async with RolloutClient() as client'"
            )
        if self._broken is not None:
            raise ClientStateError(f"RolloutClient failed: {self._broken!r}")

    def _own(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Start a task owned by this client: cancelled and awaited by aclose()."""
        self._check_open()
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._owned.add(task)
        task.add_done_callback(self._owned.discard)
        return task

    # -- requests ----------------------------------------------------------------------------------

    def _as_request(
        self, prompt: Prompt, sampling: SamplingParams | None = None, session_id: str | None = None
    ) -> GenerateRequest:
        if isinstance(prompt, GenerateRequest):
            req = prompt
            changes: dict[str, Any] = {}
            if sampling is not None:
                changes["sampling"] = sampling
            if session_id is not None:
                changes["session_id"] = session_id
            if changes:
                req = msgspec.structs.replace(req, **changes)
        elif isinstance(prompt, list | tuple):
            req = GenerateRequest(
                input_ids=list(prompt),
                sampling=sampling if sampling is not None else SamplingParams(),
                session_id=session_id,
            )
        else:
            raise TypeError(f"a prompt is a GenerateRequest or a list of token ids, not {type(prompt).__name__}")
        return req

    async def generate(
        self,
        request: Prompt,
        /,
        *,
        sampling: SamplingParams | None = None,
        session_id: str | None = None,
        timeout: float | None = _UNSET,
        retries: int | None = None,
    ) -> GenerateResult:
        """Generate one response.

        ``request`` is a :class:`GenerateRequest` or a list of token ids (then ``sampling`` and
        ``session_id`` apply).  Cancelling the awaiting task, or ``timeout`` (seconds) expiring, aborts the
        request on its server (RequestTimeoutError for the timeout).  When the server dies the request is
        retried on another one ``retries`` times (default: the client's ``retries``), then fails with
        ServerUnavailableError / EngineDeadError.
        """
        self._check_open()
        req = self._as_request(request, sampling, session_id)
        if not req.rid:
            req = msgspec.structs.replace(req, rid=f"{self._rid_prefix}-{next(self._rid_counter)}")
        payload = encode(req)
        timeout = self.config.timeout_s if timeout is _UNSET else timeout
        retries = self.config.retries if retries is None else retries
        if timeout is None:
            return await self._scheduler.run(req, payload, retries)
        try:
            async with asyncio.timeout(timeout) as scope:
                return await self._scheduler.run(req, payload, retries)
        except TimeoutError:
            if scope.expired():
                raise RequestTimeoutError(f"request {req.rid} timed out after {timeout}s (aborted)") from None
            raise

    def generate_many(
        self,
        requests: Iterable[Prompt] | AsyncIterable[Prompt],
        *,
        n: int = 1,
        sampling: SamplingParams | None = None,
        concurrency: int | None = None,
        timeout: float | None = _UNSET,
        return_exceptions: bool = False,
    ) -> ResultStream:
        """Run many prompts, ``n`` samples each; iterate the groups as they complete.

        ``concurrency`` caps the samples in flight plus those finished but not yet taken (default: every
        server's in-flight cap together).  Seeded prompts get seeds ``seed, seed+1, ...`` for their n
        samples.  Without ``return_exceptions`` the first failed sample ends the stream with its error.

        Example::

            async with client.generate_many(prompts, n=4) as stream:
                async for group in stream:
                    train_on(group.results)
        """
        self._check_open()
        if concurrency is None:
            concurrency = max(n, self.config.max_in_flight_per_server * max(1, len(self._scheduler.servers)))
        return ResultStream(
            self,
            requests,
            n=n,
            sampling=sampling,
            concurrency=concurrency,
            timeout=self.config.timeout_s if timeout is _UNSET else timeout,
            return_exceptions=return_exceptions,
        )

    def rollouts(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        *,
        agent: Any = None,
        sampling: SamplingParams | None = None,
        group_size: int = 1,
        batch_groups: int = 32,
        mode: str = "async",
        over_provision: float = 1.5,
        max_staleness: int | None = None,
        reward: Any = None,
        filter: Any = None,
        timeout: float | None = None,
    ) -> RolloutStream:
        """Stream batches of finished groups while keeping every engine busy (docs/streaming.md).

        ``source`` yields samples: chat samples for ``agent`` (e.g. a ToolAgent), or prompts (token id
        lists / GenerateRequests) generated once each with ``sampling`` when ``agent`` is None.  Each
        sample becomes a group of ``group_size`` trajectories; each batch holds ``batch_groups`` groups.
        ``mode``: ``sync`` (batch-gather baseline), ``async`` (continuous refill, unfinished groups keep
        running across batches) or ``partial`` (continuous refill, unfinished groups are aborted at each
        batch and resume from their tokens on the next weights).  ``max_staleness``: at most that many
        weight versions between a trajectory's first token and the batch it is yielded in.  ``filter``: a
        predicate on a finished group (False drops it and the producer refills).  Use it as
        ``async with client.rollouts(...) as stream: async for batch in stream: ...``.
        """
        self._check_open()
        return RolloutStream(
            self,
            source,
            agent=agent,
            sampling=sampling,
            group_size=group_size,
            batch_groups=batch_groups,
            mode=mode,
            over_provision=over_provision,
            max_staleness=max_staleness,
            reward=reward,
            filter=filter,
            timeout=timeout,
        )

    def abort(self, rid: str) -> bool:
        """Abort one in-flight request by rid: its ``generate`` returns ``finish_reason='abort'`` with the
        tokens so far (unlike cancelling, which raises).  False when no server holds that rid."""
        self._check_open()
        return any(conn.abort(rid) for conn in self._scheduler.servers)

    async def abort_all(self) -> None:
        """Abort every request of this client on every server (their callers get abort results)."""
        self._check_open()
        for conn in self._scheduler.servers:
            conn.abort_all()

    # -- membership --------------------------------------------------------------------------------

    async def add_server(self, address: str, *, timeout: float | None = None) -> ServerStatus:
        """Add the server at ``address`` while the client runs; returns its status once it has answered.

        It takes requests as soon as it serves the fleet's weight version (:meth:`fleet_weight_version`).
        A server on older weights stays out, with the reason in :meth:`stats`, until the next
        :meth:`update_weights` brings it up to date (the weight group is re-formed with it), or until it
        reports the fleet's version by any other path.  ``timeout``: how long to wait for it to answer
        (default ``connect_timeout_s``).  Adding an address already in the fleet returns its status.
        """
        self._check_open()
        StaticServers([address])  # validates the address
        for conn in self._scheduler.servers:
            if conn.address == address and not conn.replaced:
                return self._status(conn)
        task = self._joining.get(address)
        if task is None:
            task = self._own(self._join(address, timeout), name=f"join {address}")
            self._joining[address] = task
            task.add_done_callback(lambda _t: self._joining.pop(address, None))
        return self._status(await asyncio.shield(task))

    async def _join(self, address: str, timeout: float | None) -> ServerConnection:
        conn = self._new_connection(address)
        try:
            await conn.handshake(self.config.connect_timeout_s if timeout is None else timeout)
        except BaseException:
            await self._retire(conn, "did not answer when added")
            raise
        # a restarted server takes its slot: the dead member of that name leaves the fleet for good
        for old in list(self._scheduler.servers):
            if not old.alive and old.server_id == conn.server_id:
                await self._retire(old, f"replaced by {conn.address} ({conn.incarnation})")
        self._admit(conn)
        self._scheduler.add(conn)
        log.info(
            "server %s (%s, %s) joined: %s",
            conn.server_id,
            address,
            conn.incarnation,
            "admitted" if conn.admitted else conn.admission,
        )
        return conn

    async def remove_server(self, address: str, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take the server at ``address`` out of the fleet.

        No new request goes there.  ``drain=True``: the requests in flight there finish (waiting at most
        ``timeout`` seconds, default no bound), then the server leaves; what is still running then, or
        everything with ``drain=False``, is aborted there and moves to another server (as a failover,
        within the call's ``retries``).  Sessions that lived there move at their next request, once, and
        the move is counted in :meth:`stats` (``sessions_moved``, ``prefix_tokens_lost``).
        """
        self._check_open()
        conns = [c for c in self._scheduler.servers if c.address == address]
        if not conns:
            raise ConfigError("address", address, "is not a server of this client")
        for conn in conns:
            conn.removing = True
            if drain and conn.alive:
                try:
                    async with asyncio.timeout(timeout):
                        await conn.wait_idle()
                except TimeoutError:
                    log.info(
                        "server %s: %d request(s) still running after %ss; moving them",
                        conn.server_id,
                        conn.in_flight,
                        timeout,
                    )
            await self._retire(conn, "removed from the fleet")

    async def _retire(self, conn: ServerConnection, reason: str) -> None:
        """Leave the fleet for good: what waits on it fails over, its loops stop, its socket closes."""
        conn.removing = True
        conn.abort_all()  # nothing keeps running there for this client
        conn.mark_dead(reason)
        conn.dead_reason = reason
        self._scheduler.remove(conn)
        task = self._conn_tasks.pop(conn, None)
        if task is not None:
            await cancel_and_wait(task)
        await conn.channel.close()
        self._retired.append(conn)

    def _on_replaced(self, conn: ServerConnection) -> None:
        """A new process answers at a member's address: retire the member, admit the newcomer."""
        if self._state == "open":
            self._own(self._replace(conn), name=f"replace {conn.address}")

    async def _replace(self, conn: ServerConnection) -> None:
        await self._retire(conn, conn.dead_reason)
        try:
            await self.add_server(conn.address)
        except Exception as exc:
            log.warning("the new server at %s did not join: %s", conn.address, exc)

    async def _follow_discovery(self, watch: Callable[[], AsyncIterator[str]]) -> None:
        """Servers that register after open (a restarted rank, a new node) join without anyone asking."""
        async for address in watch():
            if self._state != "open" or any(c.address == address and c.alive for c in self._scheduler.servers):
                continue  # a same-address restart is caught by its new incarnation (_on_replaced)
            self._own(self._join_quietly(address), name=f"join {address}")

    async def _join_quietly(self, address: str) -> None:
        try:
            await self.add_server(address)
        except Exception as exc:
            log.warning("server %s registered but did not join: %s", address, exc)

    def fleet_weight_version(self) -> int:
        """The weight version a server must serve to be routed to: the newest this client pushed or saw
        its admitted servers serve (another client may push weights)."""
        seen = [c.reported_version for c in self._scheduler.servers if c.alive and c.admitted]
        return max([self.weight_version, *seen])

    def _admit(self, conn: ServerConnection) -> None:
        want = self.fleet_weight_version()
        if conn.reported_version == want:
            conn.admitted, conn.admission = True, ""
        else:
            conn.admitted = False
            conn.admission = (
                f"serves weight version {conn.reported_version}, the fleet is at {want}: "
                "waits for the next update_weights()"
            )

    def _on_server_change(self, conn: ServerConnection) -> None:
        if conn.alive and not conn.admitted and conn in self._scheduler.servers:
            self._admit(conn)
        self._scheduler.on_server_change(conn)

    def _admit_all(self) -> None:
        for conn in self._scheduler.servers:
            if conn.alive and not conn.admitted:
                self._admit(conn)
                self._scheduler.on_server_change(conn)

    # -- control: trainer embedding ----------------------------------------------------------------

    def _live(self, *, admitted_only: bool = False) -> list[ServerConnection]:
        self._check_open()
        live = [s for s in self._scheduler.servers if s.alive and (s.admitted or not admitted_only)]
        if not live:
            raise NoServersError(self._scheduler._no_servers_message())
        return live

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation on every server.

        ``abort``: in-flight requests return now with ``finish_reason='abort'`` and their tokens so far.
        ``retract`` (alias ``hold``): they are held, their KV cache dropped, and they continue after
        :meth:`resume` (re-prefilled, so on the new weights after an update).  ``in_place``: held with their
        KV cache as is (SGLang engines serve it as ``retract``, to keep version segments exact).  New
        requests wait in this client until :meth:`resume`, bounded by their own timeout (the client's
        ``timeout_s``, None by default: they wait as long as the pause lasts).
        """
        mode = {"hold": "retract"}.get(mode, mode)
        if mode not in ("abort", "retract", "in_place"):
            raise ConfigError("mode", mode, "must be 'abort', 'hold'/'retract' or 'in_place'")
        live = self._live()
        for conn in live:  # before the pause lands: nothing new is sent meanwhile
            conn.set_paused(True)
        await broadcast_control(live, lambda s: PauseGeneration(s.next_call_id(), mode))  # type: ignore[arg-type]

    async def resume(self) -> None:
        """Continue generation after :meth:`pause`."""
        live = self._live()
        await broadcast_control(live, lambda s: ResumeGeneration(s.next_call_id()))
        for conn in live:
            conn.set_paused(False)

    async def flush_cache(self) -> None:
        await broadcast_control(self._live(), lambda s: FlushCache(s.next_call_id()))

    async def release_memory(self, tags: Sequence[str] | None = None, *, wait: bool = False) -> None:
        """Free the engines' GPU memory (``weights``, ``kv_cache``; all by default) for a colocated trainer.

        Refused with EngineBusyError while requests are in flight, unless ``wait`` (then it waits for them).
        New requests wait in this client until :meth:`resume_memory` (bounded by their own timeout).
        """
        t = list(tags) if tags is not None else None
        live = self._live()
        for conn in live:
            conn.set_released(True)
        try:
            await broadcast_control(
                live,
                lambda s: ReleaseMemory(s.next_call_id(), t, wait),  # type: ignore[arg-type]
            )
        except BaseException:
            for conn in live:
                conn.set_released(False)
            raise

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back; the engines serve with the weights they had (or were sent since)."""
        t = list(tags) if tags is not None else None
        live = self._live()
        await broadcast_control(live, lambda s: ResumeMemory(s.next_call_id(), t))  # type: ignore[arg-type]
        for conn in live:
            conn.set_released(False)

    async def set_weight_version(self, version: int) -> None:
        """Tag what the engines generate from now on with ``version`` (never aborts in-flight work)."""
        # a label, not weights: servers still waiting for weights keep waiting
        await broadcast_control(self._live(admitted_only=True), lambda s: SetWeightVersion(s.next_call_id(), version))
        self.weight_version = version

    async def init_weight_sync(
        self,
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        group_name: str = "rollout_weights",
        device: Any = None,
        timeout_s: float = 300.0,
    ) -> WeightSync:
        """Join this process (rank 0) and every live engine in a weight-update group.

        ``backend="nccl"`` with ``device="cuda:N"`` on GPUs; ``gloo`` moves CPU tensors.  Call once; then
        :meth:`update_weights` broadcasts through it.
        """
        if self._weight_sync is not None:
            raise ClientStateError("a weight sync exists already; close_weight_sync() first")
        args: dict[str, Any] = dict(
            backend=backend, master_address=master_address, group_name=group_name, device=device, timeout_s=timeout_s
        )
        self._weight_sync = await WeightSync.create(self._live(), **args)
        self._weight_sync_args = args
        self._weight_sync_generation = 0
        return self._weight_sync

    async def _weight_sync_for_members(self) -> WeightSync:
        """The weight group, re-formed first when the fleet changed since it was made.

        A process group has a fixed world size: a member that died makes its broadcasts fail, and a newcomer
        is not in it.  So the group is re-formed with the servers alive now (newcomers included) at the next
        update, which then brings every member to the same version (docs/design.md, "Fleet membership").
        """
        sync = self._weight_sync
        if sync is None or self._weight_sync_args is None:
            raise ClientStateError("call init_weight_sync() before update_weights(method='distributed')")
        members = self._live()
        if {id(s) for s in members} == {id(s) for s in sync.servers}:
            return sync
        self._weight_sync = None
        try:
            await sync.close()
        except Exception:
            log.warning("closing the old weight group failed (a member is gone); re-forming anyway", exc_info=True)
        self._weight_sync_generation += 1
        args = dict(self._weight_sync_args)
        args["group_name"] = f"{args['group_name']}.{self._weight_sync_generation}"
        log.info("re-forming the weight group with %d server(s)", len(members))
        self._weight_sync = await WeightSync.create(members, **args)
        return self._weight_sync

    async def close_weight_sync(self) -> None:
        sync, self._weight_sync = self._weight_sync, None
        if sync is not None:
            await sync.close()

    async def update_weights(
        self,
        named: Iterable[tuple[str, Any]],
        *,
        version: int,
        method: str = "distributed",
        bucket_bytes: int = 512 << 20,
        pause: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, float]:
        """Push new weights (HF parameter names) into every engine and tag later results with ``version``.

        ``distributed``: broadcast in flattened buckets over the group made by :meth:`init_weight_sync`.
        ``ipc``: colocated engines on this GPU map CUDA buckets by IPC handle (no copy through the host).
        ``pause``: pause with this mode around the update (``hold`` keeps in-flight requests and continues
        them on the new weights; ``abort`` returns them now); None updates between decode steps.
        A refused update (unknown name, wrong shape) leaves every engine on its old weights and raises
        WeightUpdateError; an engine left half-updated is marked dead.  Returns timings and bytes.
        """
        if pause is not None:
            await self.pause(pause)
        try:
            if method == "distributed":
                sync = await self._weight_sync_for_members()
                stats = await sync.update(named, version=version, bucket_bytes=bucket_bytes, flush_cache=flush_cache)
            elif method == "ipc":
                stats = await update_weights_ipc(
                    self._live(), named, version=version, bucket_bytes=bucket_bytes, flush_cache=flush_cache
                )
            else:
                raise ConfigError("method", method, "must be 'distributed' or 'ipc'")
        finally:
            if pause is not None:
                await self.resume()
        self.weight_version = version
        self._admit_all()  # servers that were waiting for these weights now have them
        return stats

    # -- introspection -----------------------------------------------------------------------------

    @property
    def servers(self) -> list[ServerConnection]:
        return list(self._scheduler.servers)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def server_info(self) -> list[ServerInfo]:
        return [c.info for c in self._scheduler.servers if c.info is not None]

    @property
    def model_path(self) -> str:
        """The model the (first) server serves: a local directory for the embedded default."""
        infos = self.server_info()
        return infos[0].model if infos else ""

    def stats(self) -> ClientStats:
        s = self._scheduler
        lat = sorted(s.latencies)
        return ClientStats(
            servers=[self._status(c) for c in s.servers],
            in_flight=sum(c.in_flight for c in s.servers),
            waiting=s.num_waiting,
            completed=sum(c.completed for c in s.servers),
            aborted=sum(c.aborted for c in s.servers),
            errors=sum(c.errors for c in s.servers),
            retried=s.retried,
            latency_p50_s=_pct(lat, 0.5),
            latency_p90_s=_pct(lat, 0.9),
            latency_p99_s=_pct(lat, 0.99),
            sessions_moved=s.sessions_moved,
            prefix_tokens_lost=s.prefix_tokens_lost,
            retired=[self._status(c) for c in self._retired],
        )

    def _status(self, c: ServerConnection) -> ServerStatus:
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
            latency_p50_s=_pct(sorted(c.latencies), 0.5),
        )


def _pct(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[i]


def _default_discovery(engine: CpuEngineConfig | None, num: int) -> Discovery:
    """The embedded default, unless this process runs under ``rollout_sdk.launch`` (torchrun)."""
    from .launch_env import discovery_from_env

    found = discovery_from_env()
    if found is not None:
        if engine is not None:
            raise ConfigError("engine", engine, "ignored: servers come from the torchrun job")
        return found
    return EmbeddedServers(engine, num_servers=num)
