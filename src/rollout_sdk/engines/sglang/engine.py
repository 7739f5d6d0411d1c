"""The SGLang backend: an ``sglang.Engine`` driven from our server's running event loop.

SGLang's ``Engine`` methods other than ``async_generate`` are synchronous wrappers that run their own event
loop; inside ours we call its tokenizer manager's coroutines instead (``tm.generate_request``,
``tm.abort_request``, ``tm.update_weights_from_distributed``, ...), as the RL frameworks do.  This module
holds the lifecycle and generation; :mod:`.control` the gate, pause, memory and weight updates;
:mod:`.config` the configuration.  The traps handled here (docs/design.md, "SGLang inside our event
loop", lists them all):

* ``sglang.Engine(...)`` blocks for minutes: it is built in a thread this engine owns and keeps alive
  (its scheduler processes are killed when the thread that forked them exits).  It replaces the root
  logging handlers: ours are put back.  A startup failure becomes EngineStartupError with SGLang's message.
* The tokenizer manager binds to the loop of its first call and installs SIGTERM/SIGQUIT handlers that
  kill this process: :meth:`start` makes that first call itself with a handler class of ours, so SIGQUIT
  (a child died) marks the engine dead and fails its requests instead, and SIGTERM is left to the server.
* Abort matches rids by *prefix*: every request gets a fixed-length uuid rid inside SGLang.
* Cancelling a generate task does not abort in SGLang: our cancel path calls ``abort_request``.
* A request held at the gate (weights changing, memory released, paused) is continued afterwards as
  ``prompt + tokens so far`` with what is left of its budget (:mod:`.control` says why).
* A per-request seed needs ``enable_deterministic_inference``; without it SGLang ignores the seed, so
  seeds are honoured only with ``deterministic=True`` (a warning is logged once otherwise).

Token-in/token-out: ``skip_tokenizer_init=True`` by default; the engine never sees text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from ..._aio import await_unless, cancel_and_wait
from ...errors import EngineDeadError, EngineStartupError, InvalidRequestError
from ...protocol import (
    EngineLimits,
    GenerateRequest,
    GenerateResult,
    InitWeightGroup,
    PauseMode,
    SamplingParams,
    SessionHint,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
    check_weight_version,
)
from ..base import Engine, EngineLoad
from ..prefill import PrefillOnce
from ..sessions import SessionBook
from . import pins, radix_patch
from .config import SglangEngineConfig
from .control import Control, Flight
from .direct import SchedulerPath, Unsupported
from .translate import (
    Done,
    Parts,
    done_from_output,
    expand_images,
    load_from_snapshot,
    prompt_inputs,
    request_error,
    sampling_params,
    score_result,
)
from .window import DecodeWindow

__all__ = ["SglangEngine"]

log = logging.getLogger("rollout_sdk.engines.sglang")
_TORCHRUN_ENV = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
}


class SglangEngine(Engine):
    """An SGLang engine behind the Engine interface (see the module docstring)."""

    backend = "sglang"
    supports_score = True

    def __init__(self, config: SglangEngineConfig, *, launcher: Any = None) -> None:
        """``launcher(**server_args)`` builds what ``sglang.Engine`` would (an object with
        ``tokenizer_manager`` and ``shutdown()``): :class:`.standin.StandinEngine` on a CPU; None: SGLang."""
        super().__init__()
        self.config = config
        self._launcher = launcher
        self._path: SchedulerPath | None = None  # the direct path to the scheduler (direct.py), once started
        self._sid_prefix = uuid.uuid4().hex[:20]
        #: seconds the start-up's warm-up took (config.warmup); None: not run, or it failed
        self.warmup_s: float | None = None
        self._sid_count = 0
        self.supports_routed_experts = bool(config.extra.get("enable_return_routed_experts"))
        self._top_k = 0  # experts per token of an MoE model (num_experts_per_tok), read at start
        self._engine: Any = None
        self._tm: Any = None
        self._limits: EngineLimits | None = None
        # one thread, alive as long as the engine: it builds and shuts down sglang.Engine
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._flights: dict[str, Flight] = {}
        self._control = Control(self)
        self._load = EngineLoad()
        self._load_task: asyncio.Task[None] | None = None
        self._decoded = 0  # progress(): growth of the KV tokens held by running requests, summed
        self._window: DecodeWindow | None = None  # the fast range (window.py), sized at start
        self._prefill: PrefillOnce | None = None
        if config.prefill_once_min_tokens is not None:
            self._prefill = PrefillOnce(self._prefill_prompt, min_tokens=config.prefill_once_min_tokens)
        self._prefill_n = 0
        #: prompt tokens computed by group prefills (their members' results count only their own part)
        self.prefill_once_tokens = 0
        #: prompt tokens continuations (after a checkpoint) computed instead of taking them from the cache
        self.reprefilled_tokens = 0
        self.retraction_reprefilled_tokens = 0  # of continuations of parts SGLang had retracted (control.py)
        self._warned_seed = False
        self.startup_s = 0.0
        #: agent sessions whose KV is kept (engines/sessions.py), and the batched pin changes for SGLang's
        #: scheduler (engines/sglang/pins.py), sent by one task through SGLang's RPC socket
        self._sessions: SessionBook | None = None
        self._pin_ops: list[list[Any]] = []
        self._pin_task: asyncio.Task[None] | None = None
        self._pin_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._closing = False

    # -- what the control side reads (control.Host) -------------------------------------------------

    @property
    def tm(self) -> Any:
        """SGLang's tokenizer manager (None before start)."""
        return self._tm

    @property
    def flights(self) -> dict[str, Flight]:
        return self._flights

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            import sglang  # noqa: F401  # optional: sglang
        except ImportError as exc:
            raise EngineStartupError(f"sglang is not installed ({exc}): pip install 'rollout-sdk[sglang]'") from exc
        loop = asyncio.get_running_loop()
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            # a child that dies during start-up sends SIGQUIT to this process: fail start() instead of dying
            loop.add_signal_handler(signal.SIGQUIT, self._on_child_death, "during start-up")
        if self.config.node_rank > 0:
            os.environ.setdefault("SGLANG_BLOCK_NONZERO_RANK_CHILDREN", "0")
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sglang-engine")
        t0 = time.perf_counter()
        try:
            build = loop.run_in_executor(self._thread, self._build)
            async with asyncio.timeout(self.config.startup_timeout_s):
                self._engine = await await_unless(
                    build,
                    self.wait_dead(),
                    error=lambda: EngineStartupError(f"an SGLang child process died while starting: {self._dead}"),
                )
        except TimeoutError:
            await self._abandon()
            raise EngineStartupError(
                f"SGLang did not start within {self.config.startup_timeout_s:.0f}s (startup_timeout_s)"
            ) from None
        except EngineStartupError:
            await self._abandon()
            raise
        except Exception as exc:
            await self._abandon()
            raise EngineStartupError(f"SGLang failed to start: {type(exc).__name__}: {exc}") from exc
        self.startup_s = time.perf_counter() - t0
        if self.config.node_rank > 0:
            return  # a worker node of a multi-node engine: it serves nothing itself
        tm = self._tm = self._engine.tokenizer_manager
        tm.signal_handler_class = self._signal_handler_class()
        tm.auto_create_handle_loop()  # bind to this loop now, with our signal handlers
        if self.config.request_path == "direct" and self.config.skip_tokenizer_init:
            path = SchedulerPath(tm)
            try:
                path.install()
                self._path = path
            except Unsupported as exc:
                log.warning("requests go through SGLang's tokenizer manager: %s", exc)
        mc = tm.model_config
        eos = sorted(getattr(mc, "hf_eos_token_id", None) or [])
        self._limits = EngineLimits(vocab_size=int(mc.vocab_size), max_context=int(tm.context_len), eos_token_ids=eos)
        hf_text = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
        self._top_k = int(getattr(hf_text, "num_experts_per_tok", 0) or 0)
        if self.supports_routed_experts and self._top_k <= 0:
            self.supports_routed_experts = False  # not an MoE model: refuse the flag instead of failing later
        size = self._decode_window_size(tm.server_args)
        if size is not None:
            self._window = DecodeWindow(size)
        if self.config.incremental_eviction and self._path is not None:
            await self._control.probe_inplace()  # our plugin's scheduler patch: ``keep`` updates in place
        if self.config.warmup:
            await self._warm_up()
        if self.config.freeze_gc:
            await self._freeze_gc()
        if self.config.keep_session_kv:
            await self._start_sessions()
        self._load_task = asyncio.create_task(self._refresh_load(), name="sglang-load")
        log.info("SGLang engine ready in %.1fs: %s", self.startup_s, self.config.model_path)

    async def _start_sessions(self) -> None:
        """Kept session KV: the book, with admission sized from the KV pool SGLang allocated.  Pins reach
        the scheduler in the requests themselves (``custom_params``); releases and re-ranks need SGLang's RPC
        socket and our plugin in its processes (without them pins still work and end by pressure alone)."""
        budget = None
        if self.config.session_admission is not None:
            try:
                snaps = await self._tm.get_loads()
                pool = int(getattr(snaps[0], "max_total_num_tokens", 0) or 0) if snaps else 0
            except Exception:
                pool = 0
            if pool > 0:
                budget = int(pool * self.config.session_admission)
            else:
                log.warning("the KV pool's size is unknown: no session admission")
        self._sessions = SessionBook(release=self._release_pins, rerank=self._rerank_pin, budget_tokens=budget)

    def _pins_reachable(self) -> bool:
        return (
            self.config.incremental_eviction
            and self._launcher is None
            and getattr(self._engine, "send_to_rpc", None) is not None
        )

    def _release_pins(self, sessions: list[str]) -> None:
        self._queue_pin_ops([["release", s] for s in sessions])

    def _rerank_pin(self, session: str, rank: float) -> None:
        self._queue_pin_ops([["rank", session, rank]])

    def _queue_pin_ops(self, ops: list[list[Any]]) -> None:
        if not self._pins_reachable() or self._dead is not None or self._closing:
            return
        self._pin_ops.extend(ops)
        if self._pin_task is None or self._pin_task.done():
            self._pin_task = asyncio.create_task(self._send_pin_ops(), name="sglang-pins")

    async def _send_pin_ops(self) -> None:
        """One RPC at a time, each carrying every change queued meanwhile (at most 4,096)."""
        if self._pin_thread is None:
            self._pin_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sglang-pins")
        loop = asyncio.get_running_loop()
        while self._pin_ops and self._dead is None and not self._closing:
            ops, self._pin_ops = self._pin_ops[:4096], self._pin_ops[4096:]
            try:
                ok = await loop.run_in_executor(self._pin_thread, self._pin_rpc, ops)
                if not ok and not self._closing:
                    log.warning("SGLang's scheduler refused a session pin update (%d ops)", len(ops))
            except Exception:  # advisory: a lost release costs memory until pressure demotes the pin
                log.warning("session pin update failed", exc_info=True)

    def _pin_rpc(self, ops: list[list[Any]]) -> bool:
        """In the pin thread: SGLang's ``collective_rpc`` without its forever-blocking receive (polled, so a
        dead scheduler or our close never strands the thread)."""
        from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send  # optional: sglang

        sock = self._engine.send_to_rpc
        sock_send(sock, RpcReqInput(method="rollout_sdk_sessions", parameters={"ops": ops}))
        while not sock.poll(200):
            if self._closing or self._dead is not None:
                return False
        return bool(getattr(sock_recv(sock), "success", False))

    def session_hints(self, hints: Sequence[SessionHint]) -> None:
        if self._sessions is not None:
            self._sessions.hints(hints)

    @property
    def sessions(self) -> SessionBook | None:
        """The kept agent sessions (engines/sessions.py); None before start or with keep_session_kv off."""
        return self._sessions

    async def _warm_up(self) -> None:
        """The request kinds the SDK sends, once, before serving (``config.warmup``): a group's prefill-only
        request, then two sampling requests with logprobs that take its prompt from the cache and decode in
        one batch; then the cache is flushed and the counters they moved are put back.  Advisory: a failure
        is logged and the engine serves anyway (a broken engine fails its first request instead)."""
        limits = self._limits
        if limits is None or limits.max_context < 10:
            return
        prompt = warmup_prompt(limits.vocab_size, min(64, limits.max_context - 8))
        sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
        once = self.prefill_once_tokens
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.startup_timeout_s):
                await self._prefill_prompt(GenerateRequest(rid=f"warmup/{self._sid_prefix}", input_ids=prompt))
                await asyncio.gather(
                    *(
                        self.generate(
                            GenerateRequest(
                                rid=f"warmup/{self._sid_prefix}/{k}",
                                input_ids=prompt,
                                sampling=sampling,
                                return_logprobs=True,
                            )
                        )
                        for k in range(2)
                    )
                )
                await self._control.flush_cache()
        except Exception:
            log.warning("warming SGLang up failed; serving without", exc_info=True)
            return
        finally:
            self.prefill_once_tokens = once
        self.warmup_s = time.perf_counter() - t0
        log.info("SGLang warmed up in %.1fs", self.warmup_s)

    async def _freeze_gc(self) -> None:
        """SGLang's ``freeze_gc``: ``gc.freeze()`` here and in the scheduler (it only sends a message there).
        Advisory: a failure is logged, never fatal."""
        try:
            async with asyncio.timeout(30):
                await self._tm.freeze_gc()
        except Exception:
            log.warning("freezing the garbage collector failed; continuing without", exc_info=True)

    def _decode_window_size(self, args: Any) -> int | None:
        """The decode window (config.decode_window): "graph" reads the decode CUDA-graph batch SGLang
        resolved (sglang 0.5.16: ``cuda_graph_config.decode``); no graphs, no window."""
        want = self.config.decode_window
        if want is None or isinstance(want, int):
            return want
        decode = getattr(getattr(args, "cuda_graph_config", None), "decode", None)
        backend = str(getattr(decode, "backend", "") or "").lower()
        on_gpu = getattr(args, "device", None) != "cpu"
        if getattr(args, "disable_cuda_graph", False) or "disabled" in backend or not on_gpu:
            return None  # no CUDA graphs: nothing to stay inside
        bs = getattr(decode, "max_bs", None) or getattr(args, "cuda_graph_max_bs_decode", None)
        if not isinstance(bs, int) or bs < 1:
            log.warning("SGLang's decode CUDA-graph batch is unknown: no decode window")
            return None
        return bs

    @property
    def decode_window(self) -> DecodeWindow | None:
        return self._window

    @property
    def prefill_once(self) -> PrefillOnce | None:
        return self._prefill

    def _build(self) -> Any:
        import sglang  # optional: sglang

        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        # SGLang's spawned children inherit os.environ: hide torchrun's rank variables from them, so they
        # set up their own process groups instead of reading ours
        hidden = {k: os.environ.pop(k) for k in list(os.environ) if k in _TORCHRUN_ENV or k.startswith("TORCHELASTIC_")}
        if self.config.incremental_eviction:  # read by our SGLang plugin in the processes SGLang starts
            os.environ.setdefault(radix_patch.ENV, "1")
        try:
            return (self._launcher or sglang.Engine)(**self.config.server_args())
        finally:  # sglang.Engine reconfigures the root logger (basicConfig(force=True)): undo that
            os.environ.update(hidden)
            for h in list(root.handlers):
                root.removeHandler(h)
            for h in handlers:
                root.addHandler(h)
            root.setLevel(level)

    def _signal_handler_class(self) -> type:
        engine = self

        class _Signals:
            def __init__(self, tokenizer_manager: Any) -> None:
                self.tokenizer_manager = tokenizer_manager

            def sigterm_handler(self, signum: Any = None, frame: Any = None) -> None:
                # SIGTERM belongs to the server (it re-installs its own handler once the engine started);
                # should this ever run, ask for a clean stop rather than SGLang's kill-the-process path.
                os.kill(os.getpid(), signal.SIGINT)

            def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
                engine._on_child_death("while running")

        return _Signals

    def _on_child_death(self, when: str) -> None:
        wd = getattr(self._tm, "_subprocess_watchdog", None) if self._tm is not None else None
        procs = [f"{p.name} (exit {p.exitcode})" for p in getattr(wd, "_processes", []) or [] if not p.is_alive()]
        err = EngineDeadError(f"an SGLang child process died {when}: {', '.join(procs) or 'see the engine log'}")
        log.error("%s", err)
        self._mark_dead(err)
        for flight in list(self._flights.values()):
            if flight.task is not None:
                flight.task.cancel()
            flight.wake_up()

    async def _abandon(self) -> None:
        if self._engine is not None:
            await self._shutdown_engine()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None

    async def close(self) -> None:
        self._closing = True
        task, self._load_task = self._load_task, None
        await cancel_and_wait(task)
        pin_task, self._pin_task = self._pin_task, None
        await cancel_and_wait(pin_task)
        if self._sessions is not None:
            self._sessions.close()
        if self._pin_thread is not None:
            self._pin_thread.shutdown(wait=False)  # its poll sees _closing within 0.2 s
            self._pin_thread = None
        if self._prefill is not None:
            await self._prefill.close()
        if self._path is not None:
            self._path.uninstall()
        for flight in list(self._flights.values()):
            flight.user_aborted = True
            if flight.task is not None:
                flight.task.cancel()
            flight.wake_up()
        if self._engine is not None:
            await self._shutdown_engine()
        if self._thread is not None:
            thread, self._thread = self._thread, None
            await asyncio.get_running_loop().run_in_executor(None, thread.shutdown)

    async def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        tm = getattr(engine, "tokenizer_manager", None)
        wd = getattr(tm, "_subprocess_watchdog", None)
        if wd is not None:
            wd.stop()  # so stopping the children is not reported as a crash
        for task in list(getattr(tm, "asyncio_tasks", []) or []):
            task.cancel()
        assert self._thread is not None
        await asyncio.get_running_loop().run_in_executor(self._thread, engine.shutdown)

    # -- identity / load ---------------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise EngineDeadError("the SGLang engine has not started")
        return self._limits

    @property
    def model_name(self) -> str:
        return self.config.model_path

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    def running_rids(self) -> Sequence[str]:
        return list(self._flights)

    def progress(self) -> int:
        """SGLang returns tokens only when a request ends, so progress is read from its scheduler's load
        snapshot: the growth of the KV tokens running requests hold (one per request per decode step)."""
        return self._decoded

    def load(self) -> EngineLoad:
        """SGLang's last load snapshot (at most a second old), with what only this engine knows: nothing of
        ours runs inside SGLang when no part is running (the snapshot may predate the end of a run)."""
        load = self._load
        parts = sum(f.running for f in self._flights.values())
        if load.running + load.queued > parts:
            waiting = min(load.queued, parts)
            load = msgspec.structs.replace(load, running=parts - waiting, queued=waiting)
        if not parts:
            load = msgspec.structs.replace(load, queued_tokens=0)
        window = self._window
        if window is not None:  # the window is the running limit; its waiters are queued (window.py)
            limit = load.max_running_requests
            load = msgspec.structs.replace(
                load,
                queued=load.queued + window.waiting,
                max_running_requests=min(limit, window.size) if limit else window.size,
            )
        return load

    async def _refresh_load(self) -> None:
        """SGLang publishes its scheduler's load in shared memory; read it once a second."""
        while True:
            try:
                snaps = await self._tm.get_loads()
                if snaps:
                    s = snaps[0]
                    before = self._load.kv_used_tokens or 0
                    self._load = load_from_snapshot(s, self.config)
                    # each decode step adds one KV token per running request; finished ones free theirs
                    self._decoded += max(0, (self._load.kv_used_tokens or 0) - before)
            except Exception:  # load is advisory: never let it take the engine down
                log.debug("reading SGLang load failed", exc_info=True)
            await asyncio.sleep(1.0)

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if req.rid in self._flights:
            raise InvalidRequestError("rid", req.rid, "already in flight")
        check_weight_version(req, self._weight_version)
        if req.score_only:
            return await self._score(req)
        base = sampling_params(req.sampling, self.config)
        vision = await expand_images(req, self.config)  # images: the SDK's expansion (translate.py), before the flight
        if req.sampling.seed is not None and not self.config.deterministic and not self._warned_seed:
            self._warned_seed = True
            log.warning("per-request seeds are ignored by SGLang unless deterministic=True")
        flight = self._flights[req.rid] = Flight()
        parts = Parts(req.return_logprobs)
        t0 = time.perf_counter()
        book = self._sessions if req.keep_kv_s is not None and req.session_id is not None else None
        entered = ok = False
        try:
            if book is not None:
                assert req.session_id is not None and req.keep_kv_s is not None
                admitted: list[bool] = []

                async def enter(session: str = req.session_id, n: int = len(req.input_ids)) -> None:
                    await book.enter(session, n + req.sampling.max_new_tokens)
                    admitted.append(True)

                await self._until_aborted(flight, enter())  # session admission (engines/sessions.py)
                entered = bool(admitted)
                if entered:  # the scheduler pins the session where it caches this request (pins.py)
                    base = dict(base, custom_params={pins.KEY: [req.session_id, book.rank(req.keep_kv_s)]})
            if self._prefill is not None and self._prefill.wants(req):
                await self._until_aborted(flight, self._prefill.wait(req))
            if self._window is not None:
                await self._window.enter(flight, stop=self._dead_event)
            while True:
                await self._control.wait_gate(flight)
                if self._dead is not None:
                    raise EngineDeadError(str(self._dead))
                left = req.sampling.max_new_tokens - len(parts.ids)
                if flight.user_aborted or left <= 0:
                    return parts.result(req, "abort" if left > 0 else "length", t0, self._weight_version)
                sp = dict(base, max_new_tokens=left)
                if "min_new_tokens" in sp:
                    sp["min_new_tokens"] = max(0, sp["min_new_tokens"] - len(parts.ids))
                # no await between the gate and the submit: a checkpoint sees every running part
                flight.sid = self._next_sid()
                version = self._weight_version
                kept = self._control.kv_namespace(flight, version)  # keep: the version its KV is cached under
                inputs = prompt_inputs(req, parts, vision)  # input_ids (+ image_data: images)
                seq_len = len(inputs["input_ids"])
                done = await self._run_part(
                    flight, inputs, sp, req, field="sampling", value=req.sampling, extra_key=f"w{flight.kv_key}"
                )
                kv = kept if kept is not None and done.cached_tokens > 0 else None  # a miss recomputed it
                # a continuation of a part that made tokens: what it computed again (a part checkpointed before
                # it started made nothing, and its continuation's prefill is its first)
                again = seq_len if parts.ids else 0
                kind = parts.add(done, version, kv, again, splits=flight.splits)
                flight.splits = []
                computed = max(0, again - 1 - done.cached_tokens) if again else 0
                if again and flight.retracted:  # SGLang retracted it before the update: its own cost (control.py)
                    self.retraction_reprefilled_tokens += computed
                    flight.retracted = False
                else:
                    self.reprefilled_tokens += computed
                if req.return_routed_experts:
                    parts.add_routed(done.routed, seq_len + len(done.ids), self._top_k)
                if kind == "abort" and flight.held and not flight.user_aborted:
                    flight.held = False  # checkpointed: continue from its tokens once the gate opens
                    continue
                ok = kind != "abort"
                return parts.result(req, kind, t0, self._weight_version)
        finally:
            if entered and book is not None and req.session_id is not None:
                book.leave(req.session_id, keep_s=req.keep_kv_s, tokens=len(req.input_ids) + len(parts.ids), ok=ok)
            if self._window is not None:
                self._window.leave(flight)
            if self._flights.get(req.rid) is flight:
                del self._flights[req.rid]

    async def _until_aborted(self, flight: Flight, aw: Any) -> None:
        """Await ``aw`` unless ``flight`` is aborted or the engine dies first (then ``aw`` is cancelled and
        the caller's loop returns the abort or raises EngineDeadError)."""
        task = asyncio.ensure_future(aw)
        try:
            while not task.done() and not flight.user_aborted and self._dead is None:
                flight.wake = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.wait({task, flight.wake}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    flight.wake = None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _prefill_prompt(self, req: GenerateRequest) -> None:
        """A group's prompt, prefilled once (engines/prefill.py): a prefill-only SGLang request
        (``max_new_tokens=0``) that leaves the prompt's KV in the prefix cache.  It is a flight of its own,
        so it waits at the gate, is checkpointed and aborted like any request (a weight update between it
        and the members only costs the members their cache hit)."""
        self._prefill_n += 1
        key = f"prefill/{self._sid_prefix}/{self._prefill_n}"  # no client rid looks like it
        flight = self._flights[key] = Flight()
        try:
            await self._control.wait_gate(flight)
            if self._dead is not None or flight.user_aborted:
                return
            flight.sid = self._next_sid()
            bare = msgspec.structs.replace(req, return_logprobs=False, return_routed_experts=False)
            done = await self._run_part(
                flight,
                {"input_ids": list(req.input_ids)},
                {"max_new_tokens": 0},
                bare,
                field="input_ids",
                value=f"<{len(req.input_ids)} tokens>",
                what="group prefill",
            )
            self.prefill_once_tokens += max(0, len(req.input_ids) - done.cached_tokens)
        finally:
            if self._flights.get(key) is flight:
                del self._flights[key]

    async def _score(self, req: GenerateRequest) -> GenerateResult:
        """Prompt logprobs: a prefill-only request (``max_new_tokens=0``, ``logprob_start_len=0``); SGLang
        returns one prompt logprob per position, the first one ``None`` (no context)."""
        if req.rid in self._flights:
            raise InvalidRequestError("rid", req.rid, "already in flight")
        t0 = time.perf_counter()
        vision = await expand_images(req, self.config)  # images: scored over the SDK's expansion, with pixels
        if req.rid in self._flights:  # checked again: the expansion awaited
            raise InvalidRequestError("rid", req.rid, "already in flight")
        flight = self._flights[req.rid] = Flight()
        try:
            await self._control.wait_gate(flight)
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            flight.sid = self._next_sid()
            version = self._weight_version
            inputs = prompt_inputs(req, Parts(False), vision)
            done = await self._run_part(
                flight,
                inputs,
                {"max_new_tokens": 0},
                req,
                logprob_start_len=0,
                field="input_ids",
                value=f"<{len(req.input_ids)} tokens>",
                what="score request",
            )
        finally:
            if self._flights.get(req.rid) is flight:
                del self._flights[req.rid]
        return score_result(req, done, version, time.perf_counter() - t0, vision)

    async def _run_part(
        self,
        flight: Flight,
        inputs: dict[str, Any],
        sp: dict[str, Any],
        req: GenerateRequest,
        *,
        logprob_start_len: int = -1,
        field: str,
        value: Any,
        what: str = "request",
        extra_key: str | None = None,
    ) -> Done:
        """Submit one part of ``flight`` to SGLang and await its end.  The caller's cancellation aborts the
        part inside SGLang and stays a cancellation (dead engine or not); a cancellation by the engine's
        death is EngineDeadError; SGLang's own errors are mapped by :func:`.translate.request_error`."""
        try:
            key = extra_key if extra_key is not None else f"w{self._control.kv_generation}"
            flight.task = self._submit(flight.sid, inputs, sp, req, logprob_start_len=logprob_start_len, extra_key=key)
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._dead is not None and (me is None or not me.cancelling()):
                raise EngineDeadError(str(self._dead)) from None  # the engine's death cancelled it
            if self._dead is None:
                self.abort_part(flight.sid)  # our caller was cancelled: make SGLang stop too
            if flight.task is not None:
                flight.task.cancel()
            raise
        except Exception as exc:  # SGLang's validation: the caller's error; the rest: this request's
            raise request_error(exc, field, value, what) from exc

    def _submit(
        self,
        sid: str,
        inputs: dict[str, Any],
        sp: dict[str, Any],
        req: GenerateRequest,
        *,
        logprob_start_len: int = -1,
        extra_key: str | None = None,
    ) -> asyncio.Future[Done]:
        """Hand one part to SGLang: the direct path (direct.py) for token ids, the tokenizer manager for
        images (SGLang's multimodal processing lives there) or where the direct path is off.  Raises
        ValueError on what SGLang's own validation refuses."""
        logprobs = req.return_logprobs or logprob_start_len >= 0
        if self._path is not None and "image_data" not in inputs:
            return self._path.submit(
                sid,
                inputs["input_ids"],
                sp,
                return_logprob=logprobs,
                return_routed_experts=req.return_routed_experts,
                logprob_start_len=logprob_start_len,
                extra_key=extra_key,
            )
        from sglang.srt.managers.io_struct import GenerateReqInput  # optional: sglang

        obj = GenerateReqInput(
            rid=sid,
            **inputs,
            sampling_params=sp,
            return_logprob=logprobs,
            logprob_start_len=logprob_start_len,
            return_routed_experts=req.return_routed_experts,
            extra_key=extra_key,
        )
        return asyncio.ensure_future(self._one(obj, logprobs))

    async def _one(self, obj: Any, logprobs: bool) -> Done:
        agen = self._tm.generate_request(obj, None)
        try:
            out: dict[str, Any] = await agen.__anext__()
            return done_from_output(out, logprobs)
        finally:
            await agen.aclose()

    def _next_sid(self) -> str:
        """A fresh SGLang rid: fixed length (32 hex digits: SGLang aborts by rid *prefix*), unique per engine
        start (a random prefix) without a system call per request."""
        self._sid_count += 1
        return f"{self._sid_prefix}{self._sid_count:012x}"

    def is_direct(self, sid: str) -> bool:
        """Whether SGLang request ``sid`` took the direct path (direct.py), not the tokenizer manager's."""
        return self._path is not None and self._path.owns(sid)

    def abort_part(self, sid: str) -> None:
        """Stop one SGLang request (fire and forget; its result comes back with reason abort)."""
        if self._path is not None and self._path.owns(sid):
            self._path.abort(sid)
        elif self._tm is not None:
            self._tm.abort_request(rid=sid)

    def abort(self, rid: str) -> None:
        flight = self._flights.get(rid)
        if flight is None:
            return
        flight.user_aborted = True
        if flight.running:
            self.abort_part(flight.sid)
        flight.wake_up()

    # -- control hooks (control.py) ----------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._control.paused

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._control.pause(mode)

    async def resume(self) -> None:
        await self._control.resume()

    async def flush_cache(self) -> None:
        await self._control.flush_cache()

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        await self._control.release_memory(tags)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await self._control.resume_memory(tags)

    async def set_weight_version(self, version: int) -> None:
        if version != self._weight_version:
            self._control.kv_generation += 1  # weights loaded some other way: a new namespace
        self._weight_version = version
        if self._tm is not None:
            _set_sglang_version(self._tm, version)

    async def init_weight_group(self, msg: InitWeightGroup) -> None:
        await self._control.init_weight_group(msg)

    async def update_weights_distributed(self, msg: UpdateWeightsDistributed) -> None:
        await self._control.update_weights_distributed(msg)

    async def update_weights_from_ipc(self, msg: UpdateWeightsFromIpc) -> None:
        await self._control.update_weights_from_ipc(msg)

    async def destroy_weight_group(self, group_name: str) -> None:
        await self._control.destroy_weight_group(group_name)


def warmup_prompt(vocab_size: int, n: int) -> list[int]:
    """The warm-up's prompt (:meth:`SglangEngine._warm_up`): ``n`` ids spread over the vocabulary, none 0."""
    vocab = max(3, vocab_size)
    return [1 + (i * 7919) % (vocab - 2) for i in range(n)]


def _set_sglang_version(tm: Any, version: int) -> None:
    """SGLang echoes ``server_args.weight_version`` in every result; keep it equal to ours."""
    args = tm.server_args
    try:
        args.override("rollout-sdk", weight_version=str(version))
    except Exception:
        object.__setattr__(args, "weight_version", str(version))
