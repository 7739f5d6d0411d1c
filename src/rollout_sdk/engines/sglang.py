"""The SGLang backend: an ``sglang.Engine`` driven from our server's running event loop.

SGLang's ``Engine`` methods other than ``async_generate`` are synchronous wrappers that run their own event
loop; inside ours we call its tokenizer manager's coroutines instead (``tm.generate_request``,
``tm.abort_request``, ``tm.update_weights_from_distributed``, ...), as the RL frameworks do.  The
things below cost other projects real bugs (../shared/PITFALLS.md, docs/design.md), so each is handled here:

* ``sglang.Engine(...)`` blocks for minutes: it is built in a thread this engine owns and keeps alive
  (its scheduler processes are killed when the thread that forked them exits).  It replaces the root
  logging handlers: ours are put back.  A startup failure becomes EngineStartupError with SGLang's message.
* The tokenizer manager binds to the loop of its first call and installs SIGTERM/SIGQUIT handlers that
  kill this process: :meth:`start` makes that first call itself with a handler class of ours, so SIGQUIT
  (a child died) marks the engine dead and fails its requests instead, and SIGTERM is left to the server.
* Abort matches rids by *prefix*: every request gets a fixed-length uuid rid inside SGLang.
* Cancelling a generate task does not abort in SGLang: our cancel path calls ``abort_request``.
* ``flush_cache=True`` inside a weight update asserts in the scheduler (killing it) unless idle: updates
  go with ``flush_cache=False`` and a separate ``flush_cache`` call whose result is checked.
* Bumping the weight version never aborts in-flight requests (``abort_all_requests=False``).
* SGLang returns a request's tokens only when it ends, so it cannot say where in a request the weights
  changed.  Every weight change therefore happens with nothing running inside SGLang: new requests wait at
  this engine's gate, running ones are *checkpointed* (aborted inside SGLang, their tokens so far kept) and
  continued after the change as ``prompt + tokens so far`` with the remaining budget.  Each part is tagged
  with the version it ran on, so ``version_segments`` are exact; the continuation is re-prefilled on the new
  weights (SGLang's ``retract``).  ``pause('retract')`` and ``pause('in_place')`` hold requests the same way
  (SGLang's own ``in_place`` keeps stale KV and hides the split point); ``pause('abort')`` returns them.
* SGLang does not refuse a bad update: an unknown name is logged and skipped, a wrong shape fails half way
  through a bucket.  Every update is checked against the model's manifest (HF names and shapes, built from
  its config) first; a refused distributed update still receives the broadcast (the trainer is already
  sending) under names SGLang skips, so nothing loads and the group stays usable.
* ``release_memory_occupation`` asserts that the scheduler is idle: requests are held at the gate first.
* A per-request seed needs ``enable_deterministic_inference``; without it SGLang ignores the seed, so
  seeds are honoured only with ``deterministic=True`` (a warning is logged once otherwise).

Token-in/token-out: ``skip_tokenizer_init=True`` by default; the engine never sees text.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._aio import cancel_and_wait
from ..errors import (
    ConfigError,
    EngineBusyError,
    EngineDeadError,
    EngineStartupError,
    InvalidRequestError,
    RemoteError,
    UnsupportedOperationError,
    WeightUpdateError,
)
from ..protocol import (
    EngineLimits,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    RoutedExperts,
    SamplingParams,
    TensorMeta,
    Timings,
)
from .base import Engine, EngineLoad

__all__ = ["SglangEngine", "SglangEngineConfig"]

log = logging.getLogger("rollout_sdk.engines.sglang")
T = TypeVar("T")
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


@dataclass(frozen=True, kw_only=True)
class SglangEngineConfig:
    """What :class:`SglangEngine` builds ``sglang.Engine`` from.  ``server_args()`` is the one place
    where SGLang's arguments are made."""

    model_path: str
    tp_size: int = 1
    #: first GPU of this engine's TP group (GPU = base_gpu_id + tp_rank)
    base_gpu_id: int = 0
    #: multi-node TP: nodes this engine spans, this node's index, and the torch.distributed address
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    mem_fraction_static: float | None = 0.8
    #: None lets SGLang choose; set it where FA3 is not installed ("triton" or "flashinfer")
    attention_backend: str | None = None
    sampling_backend: str | None = None
    #: "auto" loads the checkpoint; "dummy" makes random weights of the config's shape (benchmarks)
    load_format: str = "auto"
    dtype: str = "auto"
    context_length: int | None = None
    max_running_requests: int | None = None
    #: sleep/wake (release/resume memory) needs the memory saver
    enable_memory_saver: bool = True
    #: keep a host copy of the weights so they survive release/resume
    weights_cpu_backup: bool = True
    #: per-request seeds (and batch-invariant kernels) at some cost in speed
    deterministic: bool = False
    skip_tokenizer_init: bool = True
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    random_seed: int = 0
    log_level: str = "warning"
    #: seconds allowed for the engine to start (model load, KV allocation, CUDA graphs)
    startup_timeout_s: float = 1200.0
    #: any other ServerArgs field, passed through unchanged
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError("tp_size", self.tp_size, "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("node_rank", self.node_rank, f"must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("dist_init_addr", self.dist_init_addr, "is required when nnodes > 1")

    def server_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "base_gpu_id": self.base_gpu_id,
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "load_format": self.load_format,
            "dtype": self.dtype,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "enable_memory_saver": self.enable_memory_saver,
            "enable_weights_cpu_backup": self.enable_memory_saver and self.weights_cpu_backup,
            "enable_deterministic_inference": self.deterministic,
            "disable_cuda_graph": self.disable_cuda_graph,
            "disable_radix_cache": self.disable_radix_cache,
            "random_seed": self.random_seed,
            "log_level": self.log_level,
        }
        optional = {
            "dist_init_addr": self.dist_init_addr,
            "mem_fraction_static": self.mem_fraction_static,
            "attention_backend": self.attention_backend,
            "sampling_backend": self.sampling_backend,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "cuda_graph_max_bs_decode": self.cuda_graph_max_bs,
        }
        args.update({k: v for k, v in optional.items() if v is not None})
        args.update(self.extra)
        return args


class _Flight:
    """One request of ours: possibly several SGLang requests (parts), one per weight version."""

    __slots__ = ("held", "sid", "task", "user_aborted", "wake")

    def __init__(self) -> None:
        self.sid = ""
        self.task: asyncio.Future[dict[str, Any]] | None = None
        self.held = False  # checkpointed: its abort result means "continue after the gate opens"
        self.user_aborted = False
        self.wake: asyncio.Future[None] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class _Parts:
    """The parts of one request, joined: ids, logprobs and (version, tokens) segments."""

    def __init__(self, logprobs: bool) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] | None = [] if logprobs else None
        self.segments: list[tuple[int, int]] = []
        self.queue_s: float | None = None
        self.e2e_s = 0.0
        self.count = 0
        self.matched: int | None = None
        self.routed: Any = None  # int32 [tokens, layers, top_k] over the sequence so far (MoE replay)

    def add_routed(self, meta: dict[str, Any], seq_len: int, top_k: int) -> None:
        """SGLang's routed experts of one part: base64 int32 ``[seq_len - 1, layers, top_k]`` (the last token
        is never fed forward).  A later part re-prefills the sequence; keep what earlier parts measured and
        take only the new positions from it."""
        import numpy as np

        b64 = meta.get("routed_experts")
        if b64 is None:
            raise RemoteError("SGLang returned no routed experts (start it with enable_return_routed_experts)")
        flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
        tokens = max(0, seq_len - 1)
        if tokens == 0 or top_k <= 0 or flat.size % (tokens * top_k):
            raise RemoteError(f"routed experts of {flat.size} ids do not fit {tokens} tokens x top_k {top_k}")
        arr = flat.reshape(tokens, flat.size // (tokens * top_k), top_k)
        self.routed = arr if self.routed is None else np.concatenate([self.routed, arr[len(self.routed) :]])

    def add(self, out: dict[str, Any], version: int) -> str:
        meta = out.get("meta_info", {})
        ids = list(out.get("output_ids") or [])
        self.ids += ids
        if self.logprobs is not None:
            lps = [float(lp) if lp is not None else 0.0 for lp, *_ in meta.get("output_token_logprobs") or []]
            self.logprobs += lps[: len(ids)]
        if ids:
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1] = (version, self.segments[-1][1] + len(ids))
            else:
                self.segments.append((version, len(ids)))
        if self.queue_s is None:
            self.queue_s = float(meta.get("queue_time") or 0.0)
        self.e2e_s = float(meta.get("e2e_latency") or 0.0)
        self.count += 1
        fr = meta.get("finish_reason") or {}
        self.matched = fr.get("matched") if isinstance(fr.get("matched"), int) else None
        kind = fr.get("type", "abort")
        return kind if kind in ("stop", "length", "abort") else "abort"


class SglangEngine(Engine):
    """An SGLang engine behind the Engine interface (see the module docstring)."""

    backend = "sglang"
    supports_score = True

    def __init__(self, config: SglangEngineConfig) -> None:
        super().__init__()
        self.config = config
        self.supports_routed_experts = bool(config.extra.get("enable_return_routed_experts"))
        self._top_k = 0  # experts per token of an MoE model (num_experts_per_tok), read at start
        self._engine: Any = None
        self._tm: Any = None
        self._limits: EngineLimits | None = None
        # one thread, alive as long as the engine: it builds and shuts down sglang.Engine
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._flights: dict[str, _Flight] = {}
        self._paused = False
        # why new requests wait at the gate: "pause", "update", "release"; open when empty
        self._holds: set[str] = set()
        self._manifest: dict[str, tuple[int, ...]] | None = None  # built at the first update
        self._manifest_tried = False
        self._released: set[str] = set()
        self._load = EngineLoad()
        self._load_task: asyncio.Task[None] | None = None
        self._warned_seed = False
        self._groups: set[str] = set()
        self.startup_s = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            import sglang  # noqa: F401
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
            fut = loop.run_in_executor(self._thread, self._build)
            build = asyncio.ensure_future(fut)
            died = asyncio.ensure_future(self._dead_event.wait())
            async with asyncio.timeout(self.config.startup_timeout_s):
                await asyncio.wait([build, died], return_when=asyncio.FIRST_COMPLETED)
            died.cancel()
            if not build.done():
                raise EngineStartupError(f"an SGLang child process died while starting: {self._dead}")  # noqa: TRY301
            self._engine = build.result()
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
        mc = tm.model_config
        eos = sorted(getattr(mc, "hf_eos_token_id", None) or [])
        self._limits = EngineLimits(vocab_size=int(mc.vocab_size), max_context=int(tm.context_len), eos_token_ids=eos)
        hf_text = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
        self._top_k = int(getattr(hf_text, "num_experts_per_tok", 0) or 0)
        if self.supports_routed_experts and self._top_k <= 0:
            self.supports_routed_experts = False  # not an MoE model: refuse the flag instead of failing later
        self._load_task = asyncio.create_task(self._refresh_load(), name="sglang-load")
        log.info("SGLang engine ready in %.1fs: %s", self.startup_s, self.config.model_path)

    def _build(self) -> Any:
        import sglang

        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        # SGLang's spawned children inherit os.environ: hide torchrun's rank variables from them, so they
        # set up their own process groups instead of reading ours
        hidden = {k: os.environ.pop(k) for k in list(os.environ) if k in _TORCHRUN_ENV or k.startswith("TORCHELASTIC_")}
        try:
            return sglang.Engine(**self.config.server_args())
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
            _wake(flight)

    async def _abandon(self) -> None:
        if self._engine is not None:
            await self._shutdown_engine()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None

    async def close(self) -> None:
        task, self._load_task = self._load_task, None
        await cancel_and_wait(task)
        for flight in list(self._flights.values()):
            flight.user_aborted = True
            if flight.task is not None:
                flight.task.cancel()
            _wake(flight)
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

    def load(self) -> EngineLoad:
        return self._load

    async def _refresh_load(self) -> None:
        """SGLang publishes its scheduler's load in shared memory; read it once a second."""
        while True:
            try:
                snaps = await self._tm.get_loads()
                if snaps:
                    s = snaps[0]
                    self._load = EngineLoad(
                        running=int(s.num_running_reqs),
                        queued=int(s.num_waiting_reqs),
                        queued_tokens=int(getattr(s, "num_waiting_uncached_tokens", 0) or 0),
                        kv_usage=float(s.token_usage) if s.token_usage is not None else None,
                    )
            except Exception:  # load is advisory: never let it take the engine down
                log.debug("reading SGLang load failed", exc_info=True)
            await asyncio.sleep(1.0)

    # -- generation --------------------------------------------------------------------------------

    def _sampling(self, sp: SamplingParams) -> dict[str, Any]:
        if sp.min_new_tokens and self.config.skip_tokenizer_init:
            raise InvalidRequestError(
                "sampling.min_new_tokens", sp.min_new_tokens, "needs an SGLang engine with skip_tokenizer_init=False"
            )
        out: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "min_p": sp.min_p,
            "repetition_penalty": sp.repetition_penalty,
            "frequency_penalty": sp.frequency_penalty,
            "presence_penalty": sp.presence_penalty,
            "ignore_eos": sp.ignore_eos,
        }
        if sp.min_new_tokens:
            out["min_new_tokens"] = sp.min_new_tokens
        if sp.stop_token_ids:
            out["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.seed is not None:
            if self.config.deterministic:
                out["sampling_seed"] = sp.seed
            elif not self._warned_seed:
                self._warned_seed = True
                log.warning("per-request seeds are ignored by SGLang unless deterministic=True")
        return out

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if req.rid in self._flights:
            raise InvalidRequestError("rid", req.rid, "already in flight")
        from sglang.srt.managers.io_struct import GenerateReqInput

        if req.score_only:
            return await self._score(req)
        base = self._sampling(req.sampling)
        flight = self._flights[req.rid] = _Flight()
        parts = _Parts(req.return_logprobs)
        t0 = time.perf_counter()
        try:
            while True:
                await self._wait_gate(flight)
                if self._dead is not None:
                    raise EngineDeadError(str(self._dead))
                left = req.sampling.max_new_tokens - len(parts.ids)
                if flight.user_aborted or left <= 0:
                    return self._result(req, parts, "abort" if left > 0 else "length", t0)
                sp = dict(base, max_new_tokens=left)
                if "min_new_tokens" in sp:
                    sp["min_new_tokens"] = max(0, sp["min_new_tokens"] - len(parts.ids))
                # no await between the gate and the submit: a checkpoint sees every running part
                flight.sid = uuid.uuid4().hex  # fixed length: SGLang aborts by rid prefix
                version = self._weight_version
                obj = GenerateReqInput(
                    rid=flight.sid,
                    input_ids=[*req.input_ids, *parts.ids],
                    sampling_params=sp,
                    return_logprob=req.return_logprobs,
                    return_routed_experts=req.return_routed_experts,
                )
                seq_len = len(obj.input_ids)
                flight.task = task = asyncio.ensure_future(self._one(obj))
                try:
                    out = await asyncio.shield(task)
                except asyncio.CancelledError:
                    if self._dead is not None:
                        raise EngineDeadError(str(self._dead)) from None
                    self._tm.abort_request(rid=flight.sid)  # our caller was cancelled: make SGLang stop too
                    task.cancel()
                    raise
                except ValueError as exc:  # SGLang's own validation (context length, parameter ranges)
                    raise InvalidRequestError("sampling", req.sampling, str(exc)) from exc
                except Exception as exc:
                    raise RemoteError(f"SGLang failed the request: {type(exc).__name__}: {exc}") from exc
                kind = parts.add(out, version)
                if req.return_routed_experts:
                    n_out = len(out.get("output_ids") or [])
                    parts.add_routed(out.get("meta_info", {}), seq_len + n_out, self._top_k)
                if kind == "abort" and flight.held and not flight.user_aborted:
                    flight.held = False  # checkpointed: continue from its tokens once the gate opens
                    continue
                return self._result(req, parts, kind, t0)
        finally:
            if self._flights.get(req.rid) is flight:
                del self._flights[req.rid]

    async def _score(self, req: GenerateRequest) -> GenerateResult:
        """Prompt logprobs: a prefill-only request (``max_new_tokens=0``, ``logprob_start_len=0``); SGLang
        returns ``input_token_logprobs`` as ``(logprob, id, text)``, the first one ``None`` (no context)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        flight = self._flights[req.rid] = _Flight()
        t0 = time.perf_counter()
        try:
            await self._wait_gate(flight)
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            flight.sid = uuid.uuid4().hex
            version = self._weight_version
            obj = GenerateReqInput(
                rid=flight.sid,
                input_ids=list(req.input_ids),
                sampling_params={"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=0,
            )
            flight.task = task = asyncio.ensure_future(self._one(obj))
            try:
                out = await asyncio.shield(task)
            except asyncio.CancelledError:
                if self._tm is not None:
                    self._tm.abort_request(rid=flight.sid)
                task.cancel()
                raise
            except ValueError as exc:
                raise InvalidRequestError("input_ids", f"<{len(req.input_ids)} tokens>", str(exc)) from exc
            except Exception as exc:
                raise RemoteError(f"SGLang failed the score request: {type(exc).__name__}: {exc}") from exc
        finally:
            if self._flights.get(req.rid) is flight:
                del self._flights[req.rid]
        meta = out.get("meta_info", {})
        entries = list(meta.get("input_token_logprobs") or [])
        if len(entries) == len(req.input_ids):
            entries = entries[1:]
        if len(entries) != len(req.input_ids) - 1 or any(e[0] is None for e in entries):
            raise RemoteError(f"SGLang returned {len(entries)} prompt logprobs for {len(req.input_ids)} tokens")
        return GenerateResult(
            rid=req.rid,
            output_ids=[],
            finish_reason="stop",
            prompt_tokens=len(req.input_ids),
            weight_version=version,
            prompt_logprobs=[float(e[0]) for e in entries],
            timings=Timings(queue_s=float(meta.get("queue_time") or 0.0), total_s=time.perf_counter() - t0),
        )

    async def _one(self, obj: Any) -> dict[str, Any]:
        agen = self._tm.generate_request(obj, None)
        try:
            out: dict[str, Any] = await agen.__anext__()
            return out
        finally:
            await agen.aclose()

    def _result(self, req: GenerateRequest, parts: _Parts, kind: str, t0: float) -> GenerateResult:
        total = time.perf_counter() - t0
        return GenerateResult(
            rid=req.rid,
            output_ids=parts.ids,
            finish_reason=kind,  # type: ignore[arg-type]
            prompt_tokens=len(req.input_ids),
            weight_version=parts.segments[-1][0] if parts.segments else self._weight_version,
            logprobs=parts.logprobs,
            matched_stop=parts.matched,
            version_segments=parts.segments,
            routed_experts=_routed(parts.routed),
            timings=Timings(
                queue_s=parts.queue_s or 0.0,
                ttft_s=0.0,
                total_s=parts.e2e_s if parts.count == 1 and parts.e2e_s else total,
            ),
        )

    def abort(self, rid: str) -> None:
        flight = self._flights.get(rid)
        if flight is None:
            return
        flight.user_aborted = True
        if flight.running and self._tm is not None:
            self._tm.abort_request(rid=flight.sid)
        _wake(flight)

    # -- the gate: where requests wait while weights change, memory is released or the engine is paused ---

    async def _wait_gate(self, flight: _Flight) -> None:
        while self._holds and not flight.user_aborted and self._dead is None:
            flight.wake = asyncio.get_running_loop().create_future()
            try:
                await flight.wake
            finally:
                flight.wake = None

    def _hold(self, why: str) -> None:
        self._holds.add(why)

    def _release(self, why: str) -> None:
        self._holds.discard(why)
        if not self._holds:
            for flight in list(self._flights.values()):
                _wake(flight)

    async def _checkpoint(self, *, hold: bool) -> None:
        """Stop every running part inside SGLang (the gate is closed, so no new one starts).  ``hold``: each
        continues from its tokens when the gate opens; otherwise each returns its partial tokens."""
        while True:
            running = [f for f in self._flights.values() if f.running]
            if not running:
                return
            for f in running:
                f.held = hold and not f.user_aborted
                self._tm.abort_request(rid=f.sid)
            # an abort can miss a part SGLang has not registered yet: abort again until all have ended
            await self._tm_call(asyncio.wait([f.task for f in running if f.task is not None], timeout=0.5))

    @contextlib.asynccontextmanager
    async def _quiesced(self) -> AsyncIterator[None]:
        """Nothing runs inside SGLang within: running parts are checkpointed and continue afterwards."""
        self._hold("update")
        try:
            await self._checkpoint(hold=True)
            yield
        finally:
            self._release("update")

    # -- pause / memory ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self, mode: PauseMode = "abort") -> None:
        self._require_alive()
        self._hold("pause")
        self._paused = True
        await self._checkpoint(hold=mode != "abort")

    async def resume(self) -> None:
        self._require_alive()
        self._paused = False
        self._release("pause")

    async def flush_cache(self) -> None:
        self._require_alive()
        out = await self._tm_call(self._tm.flush_cache(timeout_s=60.0))
        if not getattr(out, "success", False):
            raise EngineBusyError(f"SGLang could not flush its cache: {getattr(out, 'message', out)}")

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self._require_alive()
        if not self.config.enable_memory_saver:
            raise UnsupportedOperationError("release_memory needs SglangEngineConfig(enable_memory_saver=True)")
        self._hold("release")  # new requests wait while memory is gone (SGLang asserts it is idle)
        running = sum(f.running for f in self._flights.values())
        if running:
            if not self._released:
                self._release("release")
            raise EngineBusyError(f"cannot release memory with {running} request(s) running (pause first)")
        tags = list(tags or ("weights", "kv_cache"))
        todo = [t for t in tags if t not in self._released]
        if "weights" in todo:
            todo.append("cuda_graph")  # SGLang keeps graphs apart; they go with the weights
        if todo:
            await self._tm_call(self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=todo), None))
            self._released.update(todo)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self._require_alive()
        wanted = set(tags or ("weights", "kv_cache"))
        if "weights" in wanted:
            wanted.add("cuda_graph")
        todo = [t for t in ("cuda_graph", "weights", "kv_cache") if t in wanted and t in self._released]
        if todo:  # resuming a tag that was not released is fatal in SGLang: only what we released
            await self._tm_call(self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=todo), None))
            self._released.difference_update(todo)
        if not self._released:
            self._release("release")

    async def _tm_call(self, coro: Awaitable[T]) -> T:
        """Await a tokenizer-manager control call, failing at once if the engine dies meanwhile: SGLang's
        own control calls wait forever for a scheduler that died."""
        self._require_alive()
        task = asyncio.ensure_future(coro)
        dead = asyncio.ensure_future(self._dead_event.wait())
        try:
            await asyncio.wait([task, dead], return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled() or not task.done():
            raise EngineDeadError(str(self._dead))
        return task.result()

    def _require_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._tm is None:
            raise EngineDeadError("the SGLang engine has not started")

    # -- weights -----------------------------------------------------------------------------------

    async def set_weight_version(self, version: int) -> None:
        self._weight_version = version
        if self._tm is not None:
            _set_sglang_version(self._tm, version)

    async def init_weight_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        self._require_alive()
        ok, msg = await self._tm_call(
            self._tm.init_weights_update_group(
                InitWeightsUpdateGroupReqInput(
                    master_address=master_address,
                    master_port=master_port,
                    rank_offset=rank_offset,
                    world_size=world_size,
                    group_name=group_name,
                    backend=backend,
                ),
                None,
            )
        )
        if not ok:
            raise WeightUpdateError(f"SGLang could not join weight group {group_name!r}: {msg}", applied=False)
        self._groups.add(group_name)

    async def _problems(self, buckets: list[list[TensorMeta]]) -> list[str]:
        """What the model's manifest refuses in this update (empty if the manifest cannot be built)."""
        if self._manifest is None and not self._manifest_tried:
            from ..weights.manifest import hf_parameter_shapes

            self._manifest_tried = True
            try:
                self._manifest = await asyncio.to_thread(hf_parameter_shapes, self.config.model_path)
            except Exception as exc:  # an architecture transformers does not know: SGLang checks alone
                log.warning("no weight manifest for %s, updates are not pre-checked: %s", self.config.model_path, exc)
        if self._manifest is None:
            return []
        from ..weights.manifest import check_metas

        return check_metas(self._manifest, buckets)

    async def update_weights_distributed(
        self, *, group_name: str, buckets: list[list[TensorMeta]], version: int | None, flush_cache: bool
    ) -> None:
        self._require_alive()
        if group_name not in self._groups:
            raise WeightUpdateError(f"no weight group {group_name!r}: call init_weight_group first", applied=False)
        problems = await self._problems(buckets)
        if problems:
            # the trainer is broadcasting already: receive every bucket under names SGLang skips, load nothing
            await self._receive_distributed(group_name, _discarded(buckets))
            raise WeightUpdateError("; ".join(problems), applied=False)
        async with self._quiesced():
            await self._receive_distributed(group_name, buckets)
            await self._finish_update(version, flush_cache)

    async def _receive_distributed(self, group_name: str, buckets: list[list[TensorMeta]]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        for i, bucket in enumerate(buckets):
            ok, msg = await self._tm_call(
                self._tm.update_weights_from_distributed(
                    UpdateWeightsFromDistributedReqInput(
                        names=[m.name for m in bucket],
                        dtypes=[m.dtype for m in bucket],
                        shapes=[list(m.shape) for m in bucket],
                        group_name=group_name,
                        load_format="flattened_bucket",
                        flush_cache=False,  # True asserts in the scheduler unless idle
                        abort_all_requests=False,
                    ),
                    None,
                )
            )
            _check_bucket(ok, msg, i, len(buckets))

    async def update_weights_from_ipc(
        self, *, handles: list[bytes], buckets: list[list[TensorMeta]], version: int | None, flush_cache: bool
    ) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        from ..weights.ipc import sglang_bucket_payload

        self._require_alive()
        if self.config.tp_size > 1:
            # each TP rank must map a bucket on its own GPU; one handle (one GPU) for all ranks kills the
            # scheduler with a CUDA error (seen on the H200s)
            raise WeightUpdateError(
                f"colocated (IPC) updates need one CUDA handle per TP rank and this engine has "
                f"tp_size={self.config.tp_size}: use method='distributed'",
                applied=False,
            )
        if len(handles) != len(buckets):
            raise WeightUpdateError(f"{len(handles)} handles for {len(buckets)} buckets", applied=False)
        problems = await self._problems(buckets)
        if problems:
            raise WeightUpdateError("; ".join(problems), applied=False)
        async with self._quiesced():
            for i, (handle, bucket) in enumerate(zip(handles, buckets, strict=True)):
                payload = sglang_bucket_payload(handle, bucket)
                ok, msg = await self._tm_call(
                    self._tm.update_weights_from_tensor(
                        UpdateWeightsFromTensorReqInput(
                            serialized_named_tensors=[payload] * self.config.tp_size,
                            load_format="flattened_bucket",
                            flush_cache=False,
                            abort_all_requests=False,
                        ),
                        None,
                    )
                )
                _check_bucket(ok, msg, i, len(buckets))
            await self._finish_update(version, flush_cache)

    async def _finish_update(self, version: int | None, flush_cache: bool) -> None:
        if flush_cache:  # quiesced: nothing runs, so SGLang can drop KV computed with the old weights
            await self.flush_cache()
        if version is not None:
            await self.set_weight_version(version)

    async def destroy_weight_group(self, group_name: str) -> None:
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        if group_name in self._groups and self._tm is not None and self._dead is None:
            ok, msg = await self._tm_call(
                self._tm.destroy_weights_update_group(DestroyWeightsUpdateGroupReqInput(group_name=group_name), None)
            )
            if not ok:
                raise WeightUpdateError(f"SGLang could not leave weight group {group_name!r}: {msg}")
        self._groups.discard(group_name)


def _check_bucket(ok: bool, msg: str, i: int, n: int) -> None:
    """A bucket that passed the manifest check and still failed may have loaded in part (SGLang loads tensor
    by tensor and says so): the engine is then half updated."""
    if not ok:
        raise WeightUpdateError(f"SGLang failed bucket {i + 1}/{n}: {msg}", applied=None)


def _discarded(buckets: list[list[TensorMeta]]) -> list[list[TensorMeta]]:
    """The same buckets (dtypes, shapes: the same bytes on the wire) under names no model has: SGLang's
    ``load_weights`` logs and skips unknown names, so receiving them loads nothing."""
    return [
        [TensorMeta(name=f"rollout_sdk_discarded_{i}_{k}", dtype=m.dtype, shape=m.shape) for k, m in enumerate(b)]
        for i, b in enumerate(buckets)
    ]


def _routed(arr: Any) -> RoutedExperts | None:
    """SGLang's int32 routing as the wire's compact int16 (expert ids are far below 32768)."""
    if arr is None:
        return None
    import numpy as np

    t, layers, k = arr.shape
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int16).max):
        raise RemoteError(f"routed expert ids outside int16: [{arr.min()}, {arr.max()}]")
    return RoutedExperts(num_tokens=t, num_layers=layers, top_k=k, data=arr.astype("<i2").tobytes())


def _wake(flight: _Flight) -> None:
    if flight.wake is not None and not flight.wake.done():
        flight.wake.set_result(None)


def _set_sglang_version(tm: Any, version: int) -> None:
    """SGLang echoes ``server_args.weight_version`` in every result; keep it equal to ours."""
    args = tm.server_args
    try:
        args.override("rollout-sdk", weight_version=str(version))
    except Exception:
        object.__setattr__(args, "weight_version", str(version))
