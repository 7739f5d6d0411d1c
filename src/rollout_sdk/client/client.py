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

The members themselves (the sockets, servers joining and leaving while the client runs, which of them are
admitted) are the :class:`~rollout_sdk.client.fleet.Fleet`'s, in ``fleet.py``; what the client is told and
reports are in ``config.py`` and ``stats.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec

from .._aio import LifecycleGuard, OpenedWith, await_unless, cancel_and_wait, ended_with
from ..auth import Credentials
from ..discovery import Discovery, EmbeddedServers, StaticServers
from ..discovery.env import discovery_from_env
from ..errors import (
    ClientStateError,
    ConfigError,
    InvalidRequestError,
    NoServersError,
    RemoteError,
    RequestTimeoutError,
    RolloutError,
)
from ..protocol import (
    MAX_SESSION_HINTS,
    FlushCache,
    GenerateRequest,
    GenerateResult,
    InflightMode,
    PauseGeneration,
    ReleaseMemory,
    ResumeGeneration,
    ResumeMemory,
    SamplingParams,
    ServerInfo,
    SessionHint,
    SessionHints,
    SetWeightVersion,
    check_inflight,
    encode,
    expect_sampling,
    flushes,
)
from ..protocol.checks import expect, expect_ids
from ..protocol.engine_config import CpuEngineConfig
from ..rollouts.generator import USE_CLIENT_DEFAULT, Prompt, UseClientDefault, as_request
from ..rollouts.group import Agent, RewardFn, resolve_group_size
from ..rollouts.results import ResultStream
from ..rollouts.stream import GroupFilter, RolloutMode, RolloutStream
from .config import ClientConfig, ClientState
from .connection import ServerConnection
from .fleet import Fleet
from .scheduler import Scheduler
from .stats import ClientStats, ServerStatus, percentile, server_status
from .weight_sync import WeightSync, WeightSyncSettings, broadcast_control, update_weights_ipc

if TYPE_CHECKING:
    from .metrics import ClientMetrics

__all__ = ["PauseMode", "RolloutClient", "WeightMethod"]

log = logging.getLogger("rollout_sdk.client")
T = TypeVar("T")
PauseMode = Literal["abort", "hold", "retract", "in_place"]
WeightMethod = Literal["distributed", "ipc"]
_DEFAULT_SAMPLING = SamplingParams()  # frozen: shared by every request that names no sampling


def _check_call_args(
    *,
    sampling: Any,
    session_id: Any = None,
    timeout: Any = USE_CLIENT_DEFAULT,
    retries: Any = USE_CLIENT_DEFAULT,
) -> None:
    """The types of a call's arguments, checked as it is made: one line naming the argument (issue 37)."""
    expect_sampling(sampling)
    expect("session_id", session_id, str, optional=True)
    if not isinstance(timeout, UseClientDefault):
        expect("timeout", timeout, float, optional=True)
        if timeout is not None and not 0 < timeout < math.inf:
            raise InvalidRequestError("timeout", timeout, "must be > 0 seconds (None: no timeout)")
    if not isinstance(retries, UseClientDefault):
        expect("retries", retries, int)
        if retries < 0:
            raise InvalidRequestError("retries", retries, "must be >= 0")


class RolloutClient(OpenedWith):
    """The rollout client.

    Example::

        async with RolloutClient() as client:                     # embedded CPU engine
            result = await client.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=32))

        async with RolloutClient(servers=["tcp://10.0.0.5:40123"]) as client:
            async for group in client.generate_many(prompts, group_size=8):
                ...

    ``servers`` (addresses) or ``discovery`` (a :class:`~rollout_sdk.discovery.Discovery`) say where the
    servers are; with neither, ``RolloutClient()`` starts the embedded default, a CPU-engine server in this
    process (configure its engine with ``engine=CpuEngineConfig(...)``).  The other keyword arguments
    (``options``) are the fields of :class:`ClientConfig` and :class:`SchedulerConfig`; each one given
    replaces the value in ``config`` (default: ``ClientConfig()``), through :meth:`ClientConfig.with_options`.

    ``credentials`` (:class:`~rollout_sdk.auth.Credentials`) authenticate the client to servers that
    require it; by default they come from the discovery (the embedded default makes its own) or the
    environment (``ROLLOUT_SDK_CREDENTIALS``, ``ROLLOUT_SDK_SECRET_FILE``); see docs/security.md.
    """

    def __init__(
        self,
        servers: Sequence[str] | None = None,
        *,
        discovery: Discovery | None = None,
        engine: CpuEngineConfig | None = None,
        config: ClientConfig | None = None,
        credentials: Credentials | None = None,
        **options: Any,
    ) -> None:
        if servers is not None and discovery is not None:
            raise ConfigError("servers", servers, "give servers or discovery, not both")
        if engine is not None and not isinstance(engine, CpuEngineConfig):
            raise ConfigError("engine", engine, f"must be a CpuEngineConfig (got {type(engine).__name__})")
        if config is not None and not isinstance(config, ClientConfig):
            raise ConfigError("config", config, f"must be a ClientConfig (got {type(config).__name__})")
        self.config = (config or ClientConfig()).with_options(**options)
        if discovery is None:
            if servers is not None:
                discovery = StaticServers(servers)
            else:
                discovery = _default_discovery(engine, self.config.num_embedded_servers)
        elif engine is not None:
            raise ConfigError("engine", engine, "only configures the embedded default (no servers/discovery)")
        self._discovery = discovery
        self._credentials = credentials
        self._life = LifecycleGuard("RolloutClient", error=ClientStateError)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that opened it: its tasks live there
        self._scheduler = Scheduler(self.config.scheduler)
        self._supervisor: asyncio.Task[None] | None = None
        self._owned: set[asyncio.Task[Any]] = set()
        self._broken: BaseException | None = None
        self._rid_prefix = uuid.uuid4().hex[:10]
        self._rid_counter = itertools.count()
        self._weight_sync: WeightSync | None = None
        self._weight_sync_settings: WeightSyncSettings | None = None
        self._weight_sync_generation = 0
        #: the last weight version pushed through this client
        self.weight_version = 0
        #: the members: joining, admission, leaving; the sockets (docs/design.md, "Fleet membership")
        self._fleet = Fleet(
            self._scheduler,
            self.config,
            own=lambda coro, name: self._own(coro, name=name),
            check_open=self._check_open,
            is_open=lambda: self._life.is_open,
            pushed_version=lambda: self.weight_version,
        )
        from .metrics import ClientMetrics  # door: prometheus

        #: Prometheus metrics (its own registry: ``client.metrics.registry``; see docs/observability.md)
        self.metrics: ClientMetrics = ClientMetrics(lambda: (self.stats(), self.weight_version))
        self._scheduler.on_result = self.metrics.observe_result

    # -- lifecycle ---------------------------------------------------------------------------------

    async def open(self) -> None:
        """Find and connect to the servers.  Called by ``async with``; a client opens once."""
        self._loop = asyncio.get_running_loop()
        await self._life.open_with(self._open, self._teardown)

    async def _open(self) -> None:
        cfg = self.config
        _say_embedded_model(self._discovery)  # before the engine starts: it takes seconds on a small machine
        addresses = await self._discovery.open(cfg.discovery_timeout_s)
        creds = _resolve_credentials(self._credentials, self._discovery)
        self._fleet.open(addresses, creds)
        ready = asyncio.Event()
        sup = self._supervisor = asyncio.get_running_loop().create_task(self._supervise(ready), name="rollout-client")
        stopped = ClientStateError("the client's supervisor stopped before it was ready")
        await await_unless(ready.wait(), sup, error=lambda: ended_with(sup, stopped))
        await asyncio.gather(*(c.handshake(cfg.connect_timeout_s) for c in self._scheduler.servers))
        # the servers found at open define the fleet's weights; later members must match them
        self.weight_version = max([self.weight_version, *(c.reported_version for c in self._scheduler.servers)])

    async def _supervise(self, ready: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._fleet.start(tg)  # every member's loops, and those of members that join later
                watch = getattr(self._discovery, "watch", None)
                if watch is not None:
                    tg.create_task(self._fleet.follow(watch), name="rollout-client-discovery")
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
            self._fleet.stop()

    async def aclose(self) -> None:
        """Abort this client's requests, stop its tasks, close its sockets.  Idempotent."""
        await self._life.close_with(self._teardown)

    @property
    def state(self) -> ClientState:
        return self._life.state

    async def _teardown(self) -> None:
        """Release everything, in order.  If the caller is cancelled meanwhile, the rest of the
        teardown still runs (nothing is leaked), then the cancellation propagates."""
        cancelled: asyncio.CancelledError | None = None
        if self._weight_sync is not None:
            sync, self._weight_sync = self._weight_sync, None
            try:
                await asyncio.wait_for(sync.close(), 30)
            except asyncio.CancelledError as exc:
                cancelled = exc
            except Exception:
                log.warning("closing the weight sync failed", exc_info=True)
        owned = list(self._owned)
        for task in owned:
            task.cancel()
        for task in owned:
            try:
                await cancel_and_wait(task)
            except asyncio.CancelledError as exc:
                cancelled = exc
            except Exception:
                log.warning("a task of the client failed while closing", exc_info=True)
        for conn in self._scheduler.servers:
            conn.abort_all()
            conn.mark_dead("client closed", ClientStateError("the RolloutClient was closed"))
        supervisor, self._supervisor = self._supervisor, None
        try:
            await cancel_and_wait(supervisor)
        except asyncio.CancelledError as exc:
            cancelled = exc
        except Exception:
            pass  # the supervisor's failure was logged (and recorded in _broken) when it happened
        await self._fleet.close()  # every channel it opened, then the ZMQ context
        await self._discovery.close()
        if cancelled is not None:
            raise cancelled

    def _check_open(self) -> None:
        self._life.check_open("use it inside 'async with RolloutClient() as client'")
        if self._broken is not None:
            raise ClientStateError(f"RolloutClient failed: {self._broken!r}")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous call outside any loop (abort(), stats() from a thread)
            return
        if running is not self._loop:
            # its tasks live on the loop it was opened on, which is not running now: awaiting would hang
            raise ClientStateError(
                "this RolloutClient was opened on another event loop: use it on the loop that opened it (with "
                "pytest-asyncio, give a client fixture and the tests that use it the same loop scope)"
            )

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
        return as_request(prompt, sampling, session_id)

    async def generate(
        self,
        request: Prompt,
        /,
        *,
        sampling: SamplingParams | None = None,
        session_id: str | None = None,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        retries: int | UseClientDefault = USE_CLIENT_DEFAULT,
    ) -> GenerateResult:
        """Generate one response.

        ``request`` is a :class:`GenerateRequest` or a list of token ids (then ``sampling`` and
        ``session_id`` apply).  Cancelling the awaiting task, or ``timeout`` (seconds) expiring, aborts the
        request on its server (RequestTimeoutError for the timeout).  When the server dies the request is
        retried on another one ``retries`` times (default: the client's ``retries``), then fails with
        ServerUnavailableError / EngineDeadError.
        """
        self._check_open()
        _check_call_args(sampling=sampling, session_id=session_id, timeout=timeout, retries=retries)
        if isinstance(request, list) and request:  # the common case, built (and validated) once with its rid
            if not all(type(t) is int for t in request):  # one pass; the slow path names the bad id
                expect_ids("input_ids", request)
            req = GenerateRequest(
                input_ids=list(request),  # our own copy: the caller may reuse its list
                sampling=sampling if sampling is not None else _DEFAULT_SAMPLING,
                session_id=session_id,
                rid=f"{self._rid_prefix}-{next(self._rid_counter)}",
            )
        else:
            req = self._as_request(request, sampling, session_id)
            if not req.rid:
                req = msgspec.structs.replace(req, rid=f"{self._rid_prefix}-{next(self._rid_counter)}")
        payload = encode(req)
        timeout = self.config.timeout_s if isinstance(timeout, UseClientDefault) else timeout
        retries = self.config.retries if isinstance(retries, UseClientDefault) else retries
        if timeout is None:
            return await self._scheduler.run(req, payload, retries)
        try:
            async with asyncio.timeout(timeout) as scope:
                return await self._scheduler.run(req, payload, retries)
        except TimeoutError:
            if scope.expired():
                raise RequestTimeoutError(f"request {req.rid} timed out after {timeout}s (aborted)") from None
            raise

    async def score(
        self,
        input_ids: Sequence[int],
        /,
        *,
        session_id: str | None = None,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        retries: int | UseClientDefault = USE_CLIENT_DEFAULT,
    ) -> list[float]:
        """The logprob of every token of ``input_ids`` given the tokens before it, without generating.

        Entry ``i`` is ``log p(input_ids[i + 1] | input_ids[: i + 1])`` under the served weights (one fewer
        than the ids: the first token has no context): reference-model or teacher logprobs for a trainer.
        Use :meth:`generate` with ``GenerateRequest(..., score_only=True)`` for the whole result (weight
        version, lifecycle).
        """
        req = GenerateRequest(input_ids=list(input_ids), score_only=True, session_id=session_id)
        result = await self.generate(req, timeout=timeout, retries=retries)
        if result.prompt_logprobs is None:
            raise RemoteError(f"server {result.server_id} answered a score request without prompt logprobs")
        return result.prompt_logprobs

    def generate_many(
        self,
        requests: Iterable[Prompt] | AsyncIterable[Prompt],
        *,
        group_size: int | None = None,
        n: int | None = None,
        sampling: SamplingParams | None = None,
        concurrency: int | None = None,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        return_exceptions: bool = False,
    ) -> ResultStream:
        """Run many prompts, ``group_size`` samples each (``n`` is its deprecated old name); iterate the
        groups as they complete.

        ``concurrency`` caps the samples in flight plus those finished but not yet taken (default: every
        server's in-flight cap together).  Sample k of a seeded prompt is seeded
        ``sample_seed(seed, member=k)`` (rollout_sdk.rollouts.seeds), as in every other API.  Without
        ``return_exceptions`` the first failed sample ends the stream with its error.

        Example::

            async with client.generate_many(prompts, group_size=4) as stream:
                async for group in stream:
                    train_on(group.results)
        """
        self._check_open()
        _check_call_args(sampling=sampling, timeout=timeout)
        expect("group_size", group_size, int, optional=True)
        expect("concurrency", concurrency, int, optional=True)
        expect("return_exceptions", return_exceptions, bool)
        if concurrency is not None and concurrency < 1:
            raise InvalidRequestError("concurrency", concurrency, "must be >= 1")
        if isinstance(requests, (str, bytes)) or not isinstance(requests, (Iterable, AsyncIterable)):
            raise InvalidRequestError("requests", requests, "must be an iterable of prompts (token id lists)")
        if isinstance(requests, (list, tuple)) and requests and isinstance(requests[0], int):
            raise InvalidRequestError(
                "requests", requests, "is one prompt (a list of ints): generate_many takes a list of prompts, [ids]"
            )
        n = resolve_group_size(group_size, n, where="generate_many", default=1)
        if concurrency is None:
            concurrency = max(n, self._scheduler.window())
        return ResultStream(
            self,
            requests,
            n=n,
            sampling=sampling,
            concurrency=concurrency,
            timeout=timeout,
            return_exceptions=return_exceptions,
            spawn=self._spawn,
        )

    def rollouts(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        *,
        agent: Agent | None = None,
        sampling: SamplingParams | None = None,
        group_size: int = 1,
        batch_groups: int = 32,
        mode: RolloutMode = "async",
        over_provision: float = 1.5,
        max_staleness: int | None = None,
        reward: RewardFn | None = None,
        filter: GroupFilter | None = None,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
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
            spawn=self._spawn,
            load=self._in_flight_by_server,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._own(coro, name=name)

    def _in_flight_by_server(self) -> dict[str, int]:
        return {s.server_id: s.in_flight for s in self._scheduler.servers}

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

    # -- membership (client/fleet.py) -----------------------------------------------------------

    async def add_server(self, address: str, *, timeout: float | None = None) -> ServerStatus:
        """Add the server at ``address`` while the client runs; returns its status once it has answered.

        It takes requests as soon as it serves the fleet's weight version (:meth:`fleet_weight_version`).
        A server on older weights stays out, with the reason in :meth:`stats`, until the next
        :meth:`update_weights` brings it up to date (the weight group is re-formed with it), or until it
        reports the fleet's version by any other path.  ``timeout``: how long to wait for it to answer
        (default ``connect_timeout_s``).  Adding an address already in the fleet returns its status.
        """
        return server_status(await self._fleet.add(address, timeout))

    async def remove_server(self, address: str, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take the server at ``address`` out of the fleet.

        No new request goes there.  ``drain=True``: the requests in flight there finish (waiting at most
        ``timeout`` seconds, default no bound), then the server leaves; what is still running then, or
        everything with ``drain=False``, is aborted there and moves to another server (as a failover,
        within the call's ``retries``).  Sessions that lived there move at their next request, once, and
        the move is counted in :meth:`stats` (``sessions_moved``, ``prefix_tokens_lost``).
        """
        await self._fleet.remove(address, drain=drain, timeout=timeout)

    def fleet_weight_version(self) -> int:
        """The weight version a server must serve to be routed to: the newest this client pushed or saw
        its admitted servers serve (another client may push weights)."""
        return self._fleet.weight_version()

    # -- control: trainer embedding ----------------------------------------------------------------

    def _live(self, *, admitted_only: bool = False) -> list[ServerConnection]:
        self._check_open()
        live = [s for s in self._scheduler.servers if s.alive and (s.admitted or not admitted_only)]
        if not live:
            raise NoServersError(self._scheduler._no_servers_message())
        return live

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation on every server.

        ``abort``: in-flight requests return now with ``finish_reason='abort'`` and their tokens so far.
        ``retract`` (alias ``hold``): they are held, their KV cache dropped, and they continue after
        :meth:`resume` (re-prefilled, so on the new weights after an update).  ``in_place``: held with their
        KV cache as is (SGLang engines serve it as ``retract``, to keep version segments exact).  New
        requests wait in this client until :meth:`resume`, bounded by their own timeout (the client's
        ``timeout_s``, None by default: they wait as long as the pause lasts).
        """
        wire = {"hold": "retract"}.get(mode, mode)
        if wire not in ("abort", "retract", "in_place"):
            raise ConfigError("mode", mode, "must be 'abort', 'hold'/'retract' or 'in_place'")
        live = self._live()
        for conn in live:  # before the pause lands: nothing new is sent meanwhile
            conn.set_paused(True)
        await broadcast_control(live, lambda s: PauseGeneration(s.next_call_id(), wire))  # type: ignore[arg-type]

    async def resume(self) -> None:
        """Continue generation after :meth:`pause`."""
        live = self._live()
        await broadcast_control(live, lambda s: ResumeGeneration(s.next_call_id()))
        for conn in live:
            conn.set_paused(False)

    async def flush_cache(self) -> None:
        await broadcast_control(self._live(), lambda s: FlushCache(s.next_call_id()))

    async def session_hints(self, hints: Sequence[SessionHint]) -> None:
        """Tell the servers holding these agent sessions what comes next (``GenerateRequest.keep_kv_s``): a
        session ``ended`` (its kept KV is released now, not at its lease's end), or it waits on a tool for
        about ``wait_s`` seconds (kept KV expected back later is demoted first under memory pressure).
        Advisory: a session this client has not placed, or a server that is gone, is skipped; an ended
        session's placement is forgotten."""
        by_server: dict[ServerConnection, list[SessionHint]] = {}
        for h in hints:
            if not isinstance(h, SessionHint):
                raise InvalidRequestError("hints", h, "must be SessionHint values")
            conn = self.scheduler.session_server(h.session_id)
            if conn is not None and conn.accepting:
                by_server.setdefault(conn, []).append(h)
            if h.ended:
                self.scheduler.forget_session(h.session_id)
        for conn, batch in by_server.items():
            for i in range(0, len(batch), MAX_SESSION_HINTS):
                with contextlib.suppress(RolloutError):  # advisory: a lost hint costs memory, not results
                    await conn.call(SessionHints(conn.next_call_id(), batch[i : i + MAX_SESSION_HINTS]))

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
        backend: str = WeightSyncSettings.backend,
        master_address: str = WeightSyncSettings.master_address,
        group_name: str = WeightSyncSettings.group_name,
        device: Any = WeightSyncSettings.device,
        timeout_s: float = WeightSyncSettings.timeout_s,
    ) -> WeightSync:
        """Join this process (rank 0) and every live engine in a weight-update group.

        ``backend="nccl"`` with ``device="cuda:N"`` on GPUs; ``gloo`` moves CPU tensors.  Call once; then
        :meth:`update_weights` broadcasts through it.  The defaults are :class:`WeightSyncSettings`'.
        """
        if self._weight_sync is not None:
            raise ClientStateError("a weight sync exists already; close_weight_sync() first")
        settings = WeightSyncSettings(
            backend=backend, master_address=master_address, group_name=group_name, device=device, timeout_s=timeout_s
        )
        self._weight_sync = await WeightSync.create(self._live(), settings)
        self._weight_sync_settings = settings
        self._weight_sync_generation = 0
        return self._weight_sync

    async def _weight_sync_for_members(self) -> WeightSync:
        """The weight group, re-formed first when the fleet changed since it was made.

        A process group has a fixed world size: a member that died makes its broadcasts fail, and a newcomer
        is not in it.  So the group is re-formed with the servers alive now (newcomers included) at the next
        update, which then brings every member to the same version (docs/design.md, "Fleet membership").
        """
        sync = self._weight_sync
        if sync is None or self._weight_sync_settings is None:
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
        settings = self._weight_sync_settings.regrouped(self._weight_sync_generation)
        log.info("re-forming the weight group with %d server(s)", len(members))
        self._weight_sync = await WeightSync.create(members, settings)
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
        method: WeightMethod = "distributed",
        bucket_bytes: int = 512 << 20,
        pause: PauseMode | None = None,
        flush_cache: bool | None = None,
        inflight: InflightMode = "reprefill",
    ) -> dict[str, float]:
        """Push new weights (HF parameter names) into every engine and tag later results with ``version``.

        ``distributed``: broadcast in flattened buckets over the group made by :meth:`init_weight_sync`.
        ``ipc``: colocated engines on this GPU map CUDA buckets by IPC handle (no copy through the host).
        ``pause``: pause with this mode around the update (``hold`` keeps in-flight requests and continues
        them on the new weights; ``abort`` returns them now); None updates between decode steps.
        ``inflight``: what requests in flight do (docs/trainer.md, "In-flight updates"): ``reprefill``
        (exact: each goes on as ``prompt + tokens so far`` on the new weights, its KV recomputed) or ``keep``
        (each goes on with the KV it has, computed under older weights: nothing recomputed; each result's
        ``kv_version_segments`` says which tokens were sampled from older KV).  Either way no later request
        reuses KV computed under older weights (the prefix cache is keyed by weight version).
        ``flush_cache``: also drop the old KV at once (default: yes for ``reprefill``, no for ``keep``,
        where it would drop what the requests go on with).
        A refused update (unknown name, wrong shape) leaves every engine on its old weights and raises
        WeightUpdateError; an engine left half-updated is marked dead.  Returns timings and bytes.
        """
        check_inflight(inflight, bool(flush_cache))
        flush = flushes(inflight, flush_cache)
        t0 = time.perf_counter()
        ok = False
        if pause is not None:
            await self.pause(pause)
        try:
            if method == "distributed":
                sync = await self._weight_sync_for_members()
                stats = await sync.update(
                    named, version=version, bucket_bytes=bucket_bytes, flush_cache=flush, inflight=inflight
                )
            elif method == "ipc":
                stats = await update_weights_ipc(
                    self._live(),
                    named,
                    version=version,
                    bucket_bytes=bucket_bytes,
                    flush_cache=flush,
                    inflight=inflight,
                    hold=pause is None,  # a caller's pause already holds them
                )
            else:
                raise ConfigError("method", method, "must be 'distributed' or 'ipc'")
            ok = True
        finally:
            if pause is not None:
                await self.resume()
            self.metrics.observe_weight_update(method, time.perf_counter() - t0, ok=ok)
        self.weight_version = version
        self._fleet.admit_all()  # servers that were waiting for these weights now have them
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
            servers=[server_status(c) for c in s.servers],
            in_flight=sum(c.in_flight for c in s.servers),
            waiting=s.num_waiting,
            completed=sum(c.completed for c in s.servers),
            aborted=sum(c.aborted for c in s.servers),
            errors=sum(c.errors for c in s.servers),
            retried=s.retried,
            latency_p50_s=percentile(lat, 0.5),
            latency_p90_s=percentile(lat, 0.9),
            latency_p99_s=percentile(lat, 0.99),
            sessions_moved=s.sessions_moved,
            prefix_tokens_lost=s.prefix_tokens_lost,
            retired=[server_status(c) for c in self._fleet.retired],
        )


def _resolve_credentials(explicit: Credentials | None, discovery: Discovery) -> Credentials | None:
    """``credentials=``, else what the discovery hands out (the embedded default's own keys), else the
    environment (``ROLLOUT_SDK_CREDENTIALS`` / the job secret), else none (a loopback server without auth)."""
    if explicit is not None:
        return explicit
    found = getattr(discovery, "credentials", None)
    if isinstance(found, Credentials):
        return found
    return Credentials.from_env()


_said_embedded = False


def _say_embedded_model(discovery: Discovery) -> None:
    """Once per process: ``RolloutClient()`` with no servers serves a random-weight model; say so."""
    global _said_embedded
    if _said_embedded or not isinstance(discovery, EmbeddedServers):
        return
    if discovery.engine is not None and discovery.engine.model_path is not None:
        return
    _said_embedded = True
    log.warning(
        "RolloutClient(): no servers given: starting the embedded CPU engine with the tiny Qwen2 model "
        "(Qwen2.5's tokenizer, RANDOM weights: its tokens are noise; a few seconds); pass servers=[...] or "
        "engine=CpuEngineConfig(model_path=...) for a real model"
    )


def _default_discovery(engine: CpuEngineConfig | None, num: int) -> Discovery:
    """The embedded default, unless this process runs under ``rollout_sdk.launch`` (torchrun)."""
    found = discovery_from_env()
    if found is not None:
        if engine is not None:
            raise ConfigError("engine", engine, "ignored: servers come from the torchrun job")
        return found
    return EmbeddedServers(engine, num_servers=num)
