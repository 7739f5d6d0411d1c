"""The CPU engine: a Hugging Face causal LM on CPU with continuous batching.  The embedded default.

Concurrency::

    event loop thread                                   worker thread (one: owns the ModelRunner)
    ─────────────────                                   ─────────────────────────────────────────
    generate(req) ── (images: decoded, processed, marks expanded in a thread, models.vision; at most
                     max_image_expansions requests at once, the rest wait: decoded pixels are large)
                     adds a Sequence to the Scheduler, wakes the step loop, awaits its future
    abort(rid)    ── resolves the future now (tokens so far), marks it done; the worker drops the row
    step loop     ── waits on: work to do (wake event) and its gate open (no pause, no released memory)
                     Scheduler.schedule(): new seqs (≤ max_running rows, ≤ max_prefill_tokens)
                     awaits ─────────────────────────▶ ModelRunner.step(): drop done rows, decode one
                                                       token for every running row, prefill the new
                  ◀──────────────────── tokens ─────── ones, sample (the GIL is released inside torch
                     Sequence.append(), resolves the    ops, so the loop keeps serving while it runs)
                     futures of finished seqs
    weight update / memory ─ queued on the same worker, so they run between two steps, never inside one

The prefix cache (:mod:`.prefix_cache`, ``prefix_cache_tokens``) keeps finished requests' KV by token
prefix; ``cached_tokens`` of a result says what its prefill took from it.  Agent sessions (``keep_kv_s``,
engines/sessions.py) pin their latest context in it through a tool wait, as the SGLang engine pins its
radix cache: the session book's leases, hints and releases go to the cache from the loop.

Modules: :mod:`.scheduler` (waiting queue, admission), :mod:`.sequence` (one request), :mod:`.batch`
(running rows and the KV-cache surgery), :mod:`.model_runner` (model, step, sampling, weights),
:mod:`.prefix_cache` (finished rows' KV by prefix, session pins).
(bench/cpu_batching.py measures this loop against transformers' own continuous-batching manager;
docs/design.md says why this one is kept.)

Vision-language models (Qwen2.5-VL, docs/multimodal.md): a request's images are expanded before it is
queued; its prefill runs the vision tower and scatters the image features into its embeddings, with
multimodal RoPE positions per row (``ModelRunner._mrope_positions``); image rows and text rows share batches.

Sampling honours every SamplingParams field.  A request's randomness comes from its own generator (seeded
by ``seed`` when given), one uniform draw per token turned into a token by inverse-CDF, so a seeded
request reproduces token for token whatever else shares its batch.  Logprobs are those of the sampled
tokens under the distribution after penalties and temperature, before top-k/top-p/min-p.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, TypeVar

from ..._aio import cancel_and_wait
from ...errors import (
    EngineBusyError,
    EngineDeadError,
    EngineStartupError,
    InvalidRequestError,
    RequestFailedError,
    WeightUpdateError,
)
from ...models.vision import IMAGE_PAD_ID, VisionInputs
from ...protocol import (
    EngineLimits,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InflightMode,
    InitWeightGroup,
    PauseMode,
    SessionHint,
    UpdateWeightsDistributed,
    check_inflight,
    check_weight_version,
)
from ...protocol.engine_config import CpuEngineConfig
from ...weights import Rendezvous, init_weight_group, receive_buckets
from ...weights.group import destroy_weight_group
from ...weights.manifest import check_metas, parameter_shapes
from ..base import Engine, EngineLoad, Gate, NamedTensors, prompt_score_result
from ..sessions import SessionBook
from .model_runner import ModelRunner, StepOutput
from .scheduler import Scheduler
from .sequence import Sequence

__all__ = ["CpuEngine"]

log = logging.getLogger("rollout_sdk.engines.cpu")
T = TypeVar("T")


class CpuEngine(Engine):
    """A transformers causal LM on CPU with continuous batching (see the module docstring)."""

    backend = "cpu"
    reports_steps = True
    supports_score = True

    def __init__(self, config: CpuEngineConfig | None = None) -> None:
        super().__init__()
        self.config = config or CpuEngineConfig()
        self._runner = ModelRunner(self.config)
        self._scheduler = Scheduler(self.config)
        self._decoded = 0  # tokens emitted (progress())
        self._prefilled = 0  # tokens prefilled, cache hits excluded (prefill_progress())
        self._limits: EngineLimits | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._wake = asyncio.Event()
        self._gate = Gate()  # held by a pause and while memory is released
        self._updating = asyncio.Lock()
        self._step_idle = asyncio.Event()
        self._step_idle.set()
        self._released: set[str] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._rng = random.Random(self.config.seed)
        self._groups: dict[str, Any] = {}
        self._expansions = asyncio.Semaphore(self.config.max_image_expansions)
        cache = self._runner.prefix_cache
        #: agent sessions whose KV the prefix cache keeps (engines/sessions.py; no session admission here)
        self.sessions = SessionBook(release=cache.release, rerank=cache.rerank)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpu-engine")
        try:
            self._limits = await self._in_worker(self._runner.load)
        except Exception as exc:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise EngineStartupError(f"cannot load model {self.config.model_path or '<tiny>'}: {exc}") from exc
        self._loop_task = asyncio.create_task(self._step_loop(), name="cpu-engine-steps")

    async def close(self) -> None:
        task, self._loop_task = self._loop_task, None
        await cancel_and_wait(task)
        for s in list(self._scheduler.seqs.values()):
            self._finish(s, "abort")
        self.sessions.close()
        if self._executor is not None:
            ex, self._executor = self._executor, None
            ex.submit(self._runner.close)
            await asyncio.get_running_loop().run_in_executor(None, ex.shutdown)
        for group in self._groups.values():
            _destroy_group(group)
        self._groups.clear()

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise EngineDeadError("the CPU engine is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise EngineDeadError("the CPU engine has not started")
        return self._limits

    @property
    def model_name(self) -> str:
        return self._runner.model_path

    @property
    def model(self) -> Any:
        """The underlying transformers model (for tests and reference checks)."""
        return self._runner.model

    # -- requests ----------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        check_weight_version(req, self._weight_version)
        if req.score_only:
            return await self._score(req)
        if req.rid in self._scheduler.seqs:
            raise InvalidRequestError("rid", req.rid, "a request with this rid is already in flight")
        vision = await self._expand_images(req)
        if req.rid in self._scheduler.seqs:  # checked again: the expansion awaited
            raise InvalidRequestError("rid", req.rid, "a request with this rid is already in flight")
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        seed = req.sampling.seed
        rng = random.Random(seed if seed is not None else self._rng.getrandbits(63))
        limits = self.limits
        seq = Sequence(req, limits.eos_token_ids, limits.max_context, rng, fut, vision, cache_ns=self._cache_ns())
        if req.keep_kv_s is not None and req.session_id is not None and self._runner.prefix_cache.enabled:
            await self._keep_session(req.session_id, req.keep_kv_s, len(seq.prompt), req.sampling.max_new_tokens, fut)
        self._scheduler.add(seq)
        self._wake.set()
        return await fut

    def _cache_ns(self) -> str:
        """The prefix-cache namespace of a request submitted now (prefix_cache.py): lookups never cross it.  The
        worker sets it again at each prefill, to the version of the weights it is prefilled on (issue 41)."""
        return self._runner.cache_ns

    # -- agent sessions (engines/sessions.py) ----------------------------------------------------------

    async def _keep_session(
        self, session: str, keep_s: float, prompt: int, budget: int, fut: asyncio.Future[GenerateResult]
    ) -> None:
        """A turn with ``keep_kv_s``: its session is kept (its latest context pinned in the prefix cache)
        until the session book releases it."""
        book = self.sessions
        await book.enter(session, prompt + budget)  # no admission budget here: never waits
        self._runner.prefix_cache.keep(session, book.rank(keep_s))
        fut.add_done_callback(lambda f: self._left(f, session, keep_s, prompt))

    def _left(self, fut: asyncio.Future[GenerateResult], session: str, keep_s: float, prompt: int) -> None:
        ok = not fut.cancelled() and fut.exception() is None and fut.result().finish_reason != "abort"
        out = len(fut.result().output_ids) if ok else 0
        self.sessions.leave(session, keep_s=keep_s, tokens=prompt + out, ok=ok)
        if ok and self.sessions.holds(session):  # the lease starts now: expected back within keep_s
            self._runner.prefix_cache.keep(session, self.sessions.rank(keep_s))

    def session_hints(self, hints: Seq[SessionHint]) -> None:
        self.sessions.hints(hints)

    async def _expand_images(self, req: GenerateRequest) -> VisionInputs | None:
        """A request to a vision-language model: its images decoded and processed, its marks expanded (in
        a thread: decoding and resizing are blocking), the context checked on the expanded prompt."""
        processor = self._runner.vision
        if processor is None:
            if req.images:
                raise InvalidRequestError(
                    "images", f"<{len(req.images)} images>", f"model {self.model_name!r} takes no images"
                )
            return None
        if not req.images and IMAGE_PAD_ID not in req.input_ids:
            return None
        # at most max_image_expansions at once, each holding its decoded pixels; the slot is released when
        # the thread's work ends (a cancelled request's expansion still runs to its end, still counted)
        await self._expansions.acquire()
        try:
            fut = asyncio.get_running_loop().run_in_executor(None, processor.expand, req.input_ids, list(req.images))
        except BaseException:
            self._expansions.release()
            raise
        fut.add_done_callback(self._expansion_done)
        vision: VisionInputs = await asyncio.shield(fut)
        n, ctx = len(vision.input_ids), self.limits.max_context
        if n > ctx or (not req.score_only and n + req.sampling.max_new_tokens > ctx):
            raise InvalidRequestError(
                "images",
                f"<{len(req.images)} images: {n} prompt tokens>",
                f"the expanded prompt exceeds the context ({ctx})",
            )
        return vision

    def _expansion_done(self, fut: asyncio.Future[Any]) -> None:
        self._expansions.release()
        if not fut.cancelled():
            fut.exception()  # retrieved: a request cancelled meanwhile does not leave it unread

    async def _score(self, req: GenerateRequest) -> GenerateResult:
        """Prompt logprobs: one forward over the prompt on the worker, between two decode steps (so on one
        set of weights), after a pause has been lifted."""
        t0 = time.perf_counter()
        vision = await self._expand_images(req)
        seq = None
        if vision is not None:
            fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
            seq = Sequence(req, (), self.limits.max_context, random.Random(0), fut, vision)
        prompt = req.input_ids if vision is None else vision.input_ids
        await self._gate.wait()
        if "weights" in self._released:
            raise EngineBusyError("weights are released; resume_memory(['weights']) first")
        queued = time.perf_counter() - t0
        logprobs, version = await self._in_worker(self._runner.score_prompt, prompt, seq)
        total = time.perf_counter() - t0
        return prompt_score_result(req, logprobs, weight_version=version, queue_s=queued, total_s=total, vision=vision)

    def abort(self, rid: str) -> None:
        seq = self._scheduler.seqs.get(rid)
        if seq is not None:
            self._finish(seq, "abort")

    def running_rids(self) -> Seq[str]:
        return list(self._scheduler.seqs)

    def load(self) -> EngineLoad:
        return self._scheduler.load()

    def progress(self) -> int:
        return self._decoded

    def prefill_progress(self) -> int:
        return self._prefilled

    def _finish(self, seq: Sequence, reason: FinishReason, matched: int | None = None) -> None:
        if seq.done:
            return
        seq.done = True
        self._scheduler.forget(seq)
        if not seq.future.done():
            seq.future.set_result(seq.result(reason, weight_version=self._weight_version, matched=matched))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """This request alone failed inside the engine; the engine goes on."""
        if seq.done:
            return
        log.warning("CPU engine: request %s failed on its own: %s: %s", seq.rid, type(exc).__name__, exc)
        seq.done = True
        self._scheduler.forget(seq)
        if not seq.future.done():
            err = RequestFailedError(f"the CPU engine failed this request: {type(exc).__name__}: {exc}")
            seq.future.set_exception(err)

    # -- the step loop -----------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        batch = self._runner.batch
        try:
            while True:
                if not self._gate.is_open:
                    await self._gate.wait()
                    continue
                admit = self._scheduler.schedule(batch.num_live)
                if not admit and not batch.num_live:
                    if batch.num_rows:  # idle: free the KV cache of the rows that finished last
                        await self._in_worker(self._runner.drop_done)
                    self._wake.clear()
                    if not self._scheduler.waiting:
                        await self._wake.wait()
                    continue
                self._step_idle.clear()
                try:
                    out = await self._in_worker(self._runner.step, admit)
                finally:
                    self._step_idle.set()
                if self._stepped(self._record(out)):
                    await asyncio.sleep(0)  # the server hands over the next probation request (base.py)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("CPU engine step failed with no request to blame; the engine is dead")
            err = EngineDeadError(f"CPU engine failed: {type(exc).__name__}: {exc}")
            self._mark_dead(err)
            for s in list(self._scheduler.seqs.values()):
                self._scheduler.forget(s)
                s.done = True
                if not s.future.done():
                    s.future.set_exception(err)

    def _record(self, out: StepOutput) -> list[str]:
        """Apply one step's tokens; return the rids of probation requests this step admitted (base.py)."""
        version, emitted, failed, prefilled = out
        for seq, exc in failed:
            self._fail(seq, exc)
        now = time.perf_counter()
        self._decoded += len(emitted)
        self._prefilled += prefilled
        stepped: list[str] = []
        for seq, tok, lp in emitted:
            if seq.done:
                continue
            if not seq.out and seq.req.probation:
                stepped.append(seq.req.rid)
            reason = seq.append(tok, lp, version, now)
            if reason is not None:
                self._finish(seq, reason, tok if reason == "stop" else None)
        return stepped

    # -- pause / memory / weights --------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._gate.holds("pause")

    async def pause(self, mode: PauseMode = "abort") -> None:
        self._gate.hold("pause")
        await self._step_idle.wait()
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            self._scheduler.requeue_front(await self._in_worker(self._runner.retract))

    async def resume(self) -> None:
        self._gate.release("pause")
        self._wake.set()

    async def flush_cache(self) -> None:
        """Empty the prefix cache (kept sessions stay kept: their next finished turn is pinned again)."""
        await self._in_worker(self._runner.prefix_cache.clear)

    async def release_memory(self, tags: Seq[str] | None = None) -> None:
        tags = list(tags or ("weights", "kv_cache"))
        if self._scheduler.seqs and not self.paused:
            raise EngineBusyError(f"cannot release memory with {len(self._scheduler.seqs)} request(s) in flight")
        # held by pause('retract') they keep only their tokens (re-prefilled on resume); in place, their KV
        held_kv = self._runner.batch.num_live
        if held_kv:
            raise EngineBusyError(
                f"cannot release memory: {held_kv} request(s) held in place keep their KV cache "
                "(pause with mode='hold' or 'abort' first)"
            )
        self._gate.hold("memory")
        self._released.update(tags)
        await self._step_idle.wait()
        await self._in_worker(self._runner.release, tags)

    async def resume_memory(self, tags: Seq[str] | None = None) -> None:
        tags = list(tags or ("weights", "kv_cache"))
        await self._in_worker(self._runner.restore, tags)
        self._released.difference_update(tags)
        if not self._released and self._gate.release("memory"):
            self._wake.set()

    async def set_weight_version(self, version: int) -> None:
        await self._in_worker(self._runner.set_version, version)
        self._weight_version = version

    async def update_weights(
        self, named: NamedTensors, *, version: int | None = None, inflight: InflightMode = "reprefill"
    ) -> None:
        check_inflight(inflight, False)
        if "weights" in self._released:
            raise WeightUpdateError("weights are released; resume_memory(['weights']) first", applied=False)
        await self._apply(list(named), version, inflight)

    async def _apply(self, named: list[Any], version: int | None, inflight: InflightMode) -> None:
        """Load weights between two steps.  ``keep``: running rows go on with their KV; ``reprefill``: they
        are re-prefilled on the new weights (``prompt + tokens so far``) in the next step: the step loop is
        held until they are queued again, so none is left out of both the batch and the queue."""
        async with self._updating:  # control calls run concurrently: one weight change at a time
            if inflight == "keep":
                await self._in_worker(self._runner.apply_weights, named, version, "keep")
            else:
                self._gate.hold("update")
                try:
                    await self._step_idle.wait()
                    retracted = await self._in_worker(self._runner.apply_weights, named, version, "reprefill")
                    self._scheduler.requeue_front(retracted)
                finally:
                    if self._gate.release("update"):
                        self._wake.set()
            if version is not None:
                self._weight_version = version

    async def init_weight_group(self, msg: InitWeightGroup) -> None:
        if msg.group_name in self._groups:
            raise WeightUpdateError(f"weight group {msg.group_name!r} already exists", applied=False)
        # Blocking rendezvous: runs in the default thread pool, not on the loop nor the model worker.
        group = await asyncio.to_thread(init_weight_group, Rendezvous.of(msg), rank=msg.rank_offset)
        self._groups[msg.group_name] = group

    async def update_weights_distributed(self, msg: UpdateWeightsDistributed) -> None:
        group = self._groups.get(msg.group_name)
        if group is None:
            raise WeightUpdateError(f"no weight group {msg.group_name!r}: call init_weight_group first", applied=False)
        problems = check_metas(parameter_shapes(self._runner.model), msg.buckets)
        # The collective must run on every rank even when the update is refused, or the sender hangs.
        named = await asyncio.to_thread(receive_buckets, group, msg.buckets)
        if problems:
            raise WeightUpdateError("; ".join(problems), applied=False)
        await self._apply(named, msg.version, msg.inflight)

    async def destroy_weight_group(self, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is not None:
            await asyncio.to_thread(_destroy_group, group)


def _destroy_group(group: Any) -> None:
    try:
        destroy_weight_group(group)
    except Exception:  # pragma: no cover - best effort at teardown
        log.debug("destroying weight group failed", exc_info=True)
