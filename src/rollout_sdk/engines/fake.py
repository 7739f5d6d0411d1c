"""A scriptable fake engine for tests and benchmarks.  No model, no tensors.

It has two modes:

* **instant** (``step_base_s == step_per_seq_s == 0``): ``generate`` answers at once.  The dispatch
  benchmark uses it as the no-op engine, so what it measures is rollout-sdk alone.
* **batched**: a step loop that follows a documented batching cost model.  Each step decodes one token
  for every running request (at most ``max_batch`` of them, the rest wait in FIFO order) and takes::

      step_s = step_base_s + step_per_seq_s * batch_size

  This is the shape of a real decode step: a fixed cost (weights read once per step) plus a per-sequence
  cost (KV reads, sampling).  A slow server is one with a larger ``step_base_s``.

Outputs are deterministic: by default ``max_new_tokens`` tokens ``(last_input + i + 1) % vocab`` (no
EOS, so ``finish_reason='length'``), or whatever a ``responder`` returns for the request (a list of ids;
the fake stops early with ``stop`` when a returned id is an EOS / stop id, as a real engine would).

``gate`` (an asyncio.Event) holds every request before its first token until set, for deterministic
interleavings; ``kill()`` makes the engine die, failing everything in flight with EngineDeadError.

``prefix_cache=True`` models a radix cache the way SGLang's behaves under a burst: a prompt is cached once
the step that prefilled it has run, so requests admitted in the same step all compute it (each result's
``cached_tokens`` says what it took from the cache: all of the prompt but its last token, or nothing;
``prefill_tokens`` counts what was computed), and a step costs ``step_per_prefill_token_s`` per computed
prompt token on top.  With ``prefill_once_min_tokens`` set, a GRPO group's prompt is prefilled once
(engines/prefill.py), as the SGLang engine does.

``kv_capacity_tokens`` models an agent's KV kept through its tool waits (issue 40, as the SGLang engine pins
it, engines/sglang/pins.py): each session's latest sequence (prompt and output but its last token) stays
cached after its turn, in one pool with the running requests' KV; when the pool overflows, the least
recently used unpinned session goes first and pinned ones (``keep_kv_s``) last, the one expected back
latest first.  A session's next turn takes the common prefix from it (``cached_tokens``).
``session_admission`` admits new sessions by that pool (engines/sessions.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._aio import await_unless, cancel_and_wait
from ..errors import (
    EngineDeadError,
    EngineStartupError,
    InvalidRequestError,
    WeightUpdateError,
)
from ..protocol import (
    EngineLimits,
    GenerateRequest,
    GenerateResult,
    InflightMode,
    InitWeightGroup,
    PauseMode,
    SessionHint,
    Timings,
    check_inflight,
    check_weight_version,
)
from ..protocol.segments import append_segments
from .base import Engine, EngineLoad, Gate, NamedTensors
from .prefill import PrefillOnce
from .sessions import SessionBook

__all__ = ["FakeEngine", "FakeEngineConfig"]

Responder = Callable[[GenerateRequest], Sequence[int]]


@dataclass(frozen=True, kw_only=True)
class FakeEngineConfig:
    vocab_size: int = 151936
    max_context: int = 1 << 20
    eos_token_ids: tuple[int, ...] = (0,)
    step_base_s: float = 0.0
    step_per_seq_s: float = 0.0
    max_batch: int = 256
    #: CPU burnt on the event loop for each request as it arrives (a busy wait, seconds): a stand-in for an
    #: engine front end's per-request Python on the server's loop (SGLang's tokenizer manager), for
    #: bench/request_path.py
    request_cost_s: float = 0.0
    #: fail start() with this message (tests of start-up failure)
    fail_start: str | None = None
    #: start() waits until cancelled, logging that it does (a model load that never ends), for the tests of
    #: a stop during start-up (issue 37)
    hang_start: bool = False
    #: fault injection: the engine dies (kill()) once it has accepted this many requests
    die_after_requests: int | None = None
    #: fault injection: init_weight_group blocks a worker thread for good (a collective whose peers never
    #: come), for the tests of a bounded shutdown (issue 25)
    hang_init_weight_group: bool = False
    #: the modelled prefix cache (module docstring) and the prefill cost per computed prompt token
    prefix_cache: bool = False
    step_per_prefill_token_s: float = 0.0
    #: group prompts of at least this many tokens are prefilled once (engines/prefill.py); None: off
    prefill_once_min_tokens: int | None = None
    #: agent sessions (module docstring): the modelled KV pool in tokens (None: no session cache) and the
    #: fraction of it session admission fills (None: off)
    kv_capacity_tokens: int | None = None
    session_admission: float | None = None
    #: named weights and their sizes, for update_weights checks
    weight_shapes: dict[str, tuple[int, ...]] = field(default_factory=lambda: {"w": (4,)})

    @property
    def instant(self) -> bool:
        return self.step_base_s == 0.0 and self.step_per_seq_s == 0.0


def _burn(seconds: float) -> None:
    """Hold the CPU (and the event loop) for ``seconds`` of this thread's CPU time, as Python work would
    (CPU time: on a busy machine the work takes longer, not less)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Req:
    __slots__ = (
        "cached",
        "done",
        "future",
        "kv",
        "kv_version",
        "logprobs",
        "out",
        "prefill_only",
        "req",
        "started_at",
        "stops",
        "t0",
        "target",
        "versions",
    )

    def __init__(
        self,
        req: GenerateRequest,
        target: list[int],
        future: asyncio.Future[GenerateResult],
        eos_token_ids: Sequence[int],
    ) -> None:
        self.req = req
        sp = req.sampling
        # the ids that stop it, once per request (not per token)
        self.stops = frozenset(sp.stop_token_ids if sp.ignore_eos else (*sp.stop_token_ids, *eos_token_ids))
        self.target = target
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[tuple[int, int]] = []
        #: the weight version of its (modelled) KV: set at its prefill, and at a re-prefill after an update
        self.kv_version: int | None = None
        self.kv: list[tuple[int, int]] = []
        self.future = future
        self.t0 = time.perf_counter()
        self.started_at = 0.0
        self.done = False
        self.cached = 0
        self.prefill_only = False


class FakeEngine(Engine):
    backend = "fake"
    reports_steps = True

    def __init__(
        self,
        config: FakeEngineConfig | None = None,
        *,
        responder: Responder | None = None,
        gate: asyncio.Event | None = None,
    ) -> None:
        super().__init__()
        self.config = config or FakeEngineConfig()
        self.responder = responder
        self.gate = gate
        # bounded, so a long benchmark does not grow the server (tests look at the recent ones)
        self.requests_seen: collections.deque[GenerateRequest] = collections.deque(maxlen=10_000)
        self.aborted_rids: collections.deque[str] = collections.deque(maxlen=10_000)
        self.weights: dict[str, list[float]] = {n: [0.0] for n in self.config.weight_shapes}
        self.memory_released: set[str] = set()
        self._limits: EngineLimits | None = None
        self._limits_of: FakeEngineConfig | None = None
        self._reqs: dict[str, _Req] = {}
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []
        self._wake = asyncio.Event()
        self._gate = Gate()  # held by a pause
        self._loop_task: asyncio.Task[None] | None = None
        self._decoded = 0  # tokens emitted (progress())
        #: fault injection: every step takes this many times its modelled time (a stalling engine)
        self.step_scale = 1.0
        self._prefilled: collections.OrderedDict[int, None] = collections.OrderedDict()  # the modelled cache
        #: prompt tokens computed (not taken from the modelled prefix cache), prefill-only passes included
        self.prefill_tokens = 0
        #: tokens in-flight requests recomputed because of a ``reprefill`` weight update (modelled)
        self.reprefilled_tokens = 0
        #: the modelled session cache (module docstring): session -> [sequence, pin rank or None], LRU order
        self._session_kv: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self.session_evictions = 0
        cap, adm = self.config.kv_capacity_tokens, self.config.session_admission
        self.sessions = SessionBook(
            release=self._unpin,
            rerank=self._rerank,
            budget_tokens=int(cap * adm) if cap is not None and adm is not None else None,
        )
        self.prefill_once: PrefillOnce | None = None
        if self.config.prefill_once_min_tokens is not None:
            self.prefill_once = PrefillOnce(self._prefill_prompt, min_tokens=self.config.prefill_once_min_tokens)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.fail_start:
            raise EngineStartupError(self.config.fail_start)
        if self.config.hang_start:
            logging.getLogger("rollout_sdk.engines.fake").warning("fake engine: start() held (hang_start)")
            await asyncio.Event().wait()
        if not self.config.instant:
            self._loop_task = asyncio.create_task(self._step_loop(), name="fake-engine-steps")

    async def close(self) -> None:
        if self.prefill_once is not None:
            await self.prefill_once.close()
        task, self._loop_task = self._loop_task, None
        await cancel_and_wait(task)
        for r in list(self._reqs.values()):
            self._finish(r, "abort")

    @property
    def limits(self) -> EngineLimits:
        c = self.config
        if self._limits is None or self._limits_of is not c:  # read per request by the server: made once
            self._limits_of = c
            self._limits = EngineLimits(
                vocab_size=c.vocab_size, max_context=c.max_context, eos_token_ids=list(c.eos_token_ids)
            )
        return self._limits

    @property
    def model_name(self) -> str:
        return "fake"

    def kill(self, reason: str = "fake engine killed") -> None:
        """Die now: every request in flight fails with EngineDeadError."""
        err = EngineDeadError(reason)
        self._mark_dead(err)
        for r in list(self._reqs.values()):
            self._reqs.pop(r.req.rid, None)
            if not r.future.done():
                r.future.set_exception(err)

    # -- requests ----------------------------------------------------------------------------------

    def _target(self, req: GenerateRequest) -> list[int]:
        if self.responder is not None:
            return list(self.responder(req))
        base = req.input_ids[-1]
        v = self.config.vocab_size
        return [(base + i + 1) % v for i in range(req.sampling.max_new_tokens)]

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if req.rid in self._reqs:
            raise InvalidRequestError("rid", req.rid, "a request with this rid is already in flight")
        check_weight_version(req, self._weight_version)
        self.requests_seen.append(req)
        if self.config.request_cost_s > 0.0:
            _burn(self.config.request_cost_s)
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        r = _Req(req, self._target(req), fut, self.config.eos_token_ids)
        self._reqs[req.rid] = r
        limit = self.config.die_after_requests
        if limit is not None and len(self.requests_seen) >= limit:
            self.kill(f"fault injection: died after {limit} requests")
            return await fut
        if self.prefill_once is not None and not self.config.instant and self.prefill_once.wants(req):
            await await_unless(self.prefill_once.wait(req), fut)  # its group's prefill, unless aborted meanwhile
            if fut.done():
                return fut.result()
        if self.gate is not None and not self.gate.is_set():
            await await_unless(self.gate.wait(), fut)  # the gate, unless the request ends meanwhile (abort)
            if fut.done():
                return fut.result()
        if req.keep_kv_s is not None and req.session_id is not None:
            need = len(req.input_ids) + req.sampling.max_new_tokens
            await await_unless(self.sessions.enter(req.session_id, need), fut)  # admission, unless aborted
            if fut.done():
                return fut.result()
            sid, keep, n = req.session_id, req.keep_kv_s, len(req.input_ids)
            fut.add_done_callback(lambda f: self._left(f, sid, keep, n))
        if self.config.instant:
            await self._gate.wait()
            if not fut.done():
                for _ in r.target:
                    if self._emit(r):
                        break
                else:
                    self._finish(r, "length")
            return await fut
        self._waiting.append(r)
        self._wake.set()
        return await fut

    async def _prefill_prompt(self, req: GenerateRequest) -> None:
        """A prefill-only pass of ``req``'s prompt (PrefillOnce): admitted like a request, ends at its step."""
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        r = _Req(req, [], fut, ())
        r.prefill_only = True
        self._waiting.append(r)
        self._wake.set()
        try:
            await fut
        finally:
            r.done = True

    def _admit_prefill(self, admitted: list[_Req]) -> int:
        """The modelled prefix cache (module docstring): what each admitted request takes from it, and the
        prompt tokens this step computes."""
        keys = [hash(tuple(r.req.input_ids)) for r in admitted]
        computed = 0
        for r, key in zip(admitted, keys, strict=True):
            n = len(r.req.input_ids)
            taken = self._session_cached(r)
            r.cached = taken if taken is not None else (n - 1 if key in self._prefilled else 0)
            computed += n - r.cached
        self._evict_sessions()  # the admitted requests' KV needs room
        for key in keys:  # cached only after this step: requests admitted together all compute it
            self._prefilled[key] = None
            self._prefilled.move_to_end(key)
        while len(self._prefilled) > 65_536:
            self._prefilled.popitem(last=False)
        self.prefill_tokens += computed
        return computed

    # -- the modelled session cache (module docstring) ----------------------------------------------------

    def _left(self, fut: asyncio.Future[GenerateResult], session: str, keep_s: float, prompt: int) -> None:
        ok = not fut.cancelled() and fut.exception() is None and fut.result().finish_reason != "abort"
        out = len(fut.result().output_ids) if ok else 0
        self.sessions.leave(session, keep_s=keep_s, tokens=prompt + out, ok=ok)

    def _session_cached(self, r: _Req) -> int | None:
        """What ``r`` takes from its session's cached sequence (None: not a session request here)."""
        sid = r.req.session_id
        if self.config.kv_capacity_tokens is None or sid is None:
            return None
        entry = self._session_kv.get(sid)
        if entry is None:
            return 0
        self._session_kv.move_to_end(sid)
        ids, n = entry[0], len(r.req.input_ids)
        common = 0
        for a, b in zip(ids, r.req.input_ids, strict=False):
            if a != b:
                break
            common += 1
        return min(common, n - 1)

    def _session_done(self, r: _Req, reason: str) -> None:
        sid = r.req.session_id
        if self.config.kv_capacity_tokens is None or sid is None or reason == "abort" or not r.out:
            return
        keep = r.req.keep_kv_s if r.req.keep_kv_s is not None and self.sessions.holds(sid) else None
        rank = asyncio.get_running_loop().time() + keep if keep is not None else None
        self._session_kv[sid] = [(*r.req.input_ids, *r.out[:-1]), rank]
        self._session_kv.move_to_end(sid)
        self._evict_sessions()

    def _evict_sessions(self) -> None:
        cap = self.config.kv_capacity_tokens
        if cap is None:
            return
        used = sum(len(e[0]) for e in self._session_kv.values())
        # a running request shares the part it took from the cache (as in a radix cache): only the rest is its own
        used += sum(len(r.req.input_ids) + len(r.out) - r.cached for r in self._running if not r.done)
        while used > cap and self._session_kv:
            victim = next((k for k, e in self._session_kv.items() if e[1] is None), None)
            if victim is None:  # only pinned ones left: the one expected back latest
                victim = max(self._session_kv, key=lambda k: self._session_kv[k][1])
            used -= len(self._session_kv.pop(victim)[0])
            self.session_evictions += 1

    def _unpin(self, sessions: list[str]) -> None:
        for s in sessions:
            entry = self._session_kv.get(s)
            if entry is not None:
                entry[1] = None

    def _rerank(self, session: str, rank: float) -> None:
        entry = self._session_kv.get(session)
        if entry is not None and entry[1] is not None:
            entry[1] = rank

    def session_hints(self, hints: Sequence[SessionHint]) -> None:
        self.sessions.hints(hints)

    @property
    def pinned_sessions(self) -> list[str]:
        """Sessions whose KV the modelled cache holds pinned now (tests)."""
        return [k for k, e in self._session_kv.items() if e[1] is not None]

    def session_cached(self, session: str) -> int:
        """Tokens of ``session`` the modelled cache holds (tests)."""
        entry = self._session_kv.get(session)
        return len(entry[0]) if entry is not None else 0

    def _emit(self, r: _Req) -> bool:
        """Append the next target token; return True when the request finished."""
        sp = r.req.sampling
        if not r.out:
            r.started_at = time.perf_counter()
        tok = r.target[len(r.out)]
        r.out.append(tok)
        r.logprobs.append(-0.1 * (1 + len(r.out) % 7))
        append_segments(r.versions, ((self._weight_version, 1),))
        if r.kv_version is None:
            r.kv_version = self._weight_version
        append_segments(r.kv, ((r.kv_version, 1),))
        if tok in r.stops and len(r.out) >= sp.min_new_tokens:
            self._finish(r, "stop", matched=tok)
            return True
        if len(r.out) >= sp.max_new_tokens or len(r.out) >= len(r.target):
            self._finish(r, "length")
            return True
        return False

    def _finish(self, r: _Req, reason: str, matched: int | None = None) -> None:
        if r.done:
            return
        r.done = True
        self._reqs.pop(r.req.rid, None)
        self._session_done(r, reason)
        now = time.perf_counter()
        if not r.future.done():
            r.future.set_result(
                GenerateResult(
                    rid=r.req.rid,
                    output_ids=list(r.out),
                    finish_reason=reason,  # type: ignore[arg-type]
                    prompt_tokens=len(r.req.input_ids),
                    cached_tokens=r.cached,
                    weight_version=self._weight_version,
                    logprobs=list(r.logprobs) if r.req.return_logprobs else None,
                    matched_stop=matched,
                    version_segments=list(r.versions),
                    kv_version_segments=list(r.kv) if r.kv != r.versions else [],
                    timings=Timings(
                        queue_s=(r.started_at or now) - r.t0,
                        ttft_s=(r.started_at or now) - r.t0,
                        total_s=now - r.t0,
                    ),
                )
            )

    async def _step_loop(self) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            await self._gate.wait()
            self._running = [r for r in self._running if not r.done]
            admitted: list[_Req] = []
            while len(self._running) < c.max_batch and self._waiting:
                r = self._waiting.popleft()
                if not r.done:
                    self._running.append(r)
                    admitted.append(r)
            computed = self._admit_prefill(admitted) if c.prefix_cache and admitted else 0
            if not self._running:
                self._wake.clear()
                if not self._waiting:
                    await self._wake.wait()
                continue
            # sleep to a running deadline: the loop's timer rounds each sleep to a millisecond, so a
            # per-step sleep would drift from the model; this keeps the average step exact
            step_s = c.step_base_s + c.step_per_seq_s * len(self._running) + c.step_per_prefill_token_s * computed
            step_s *= self.step_scale
            deadline = max(deadline, loop.time()) + step_s
            await asyncio.sleep(deadline - loop.time())
            if self.paused:
                continue
            stepped: list[str] = []
            for r in self._running:
                if r.prefill_only:
                    r.done = True
                    if not r.future.done():
                        r.future.set_result(None)  # type: ignore[arg-type]
                elif not r.done:
                    if not r.out and r.req.probation:
                        stepped.append(r.req.rid)
                    self._emit(r)
                    self._decoded += 1
            if stepped and self._stepped(stepped):
                await asyncio.sleep(0)  # the server hands over the next probation request (base.py)

    def abort(self, rid: str) -> None:
        r = self._reqs.get(rid)
        if r is not None:
            self.aborted_rids.append(rid)
            self._finish(r, "abort")

    def running_rids(self) -> Sequence[str]:
        return list(self._reqs)

    def progress(self) -> int:
        return self._decoded

    def load(self) -> EngineLoad:
        running = sum(1 for r in self._running if not r.done)
        queued = len(self._reqs) - running
        return EngineLoad(
            running=running,
            queued=max(0, queued),
            queued_tokens=sum(len(r.req.input_ids) + r.req.sampling.max_new_tokens for r in self._waiting),
            max_running_requests=None if self.config.instant else self.config.max_batch,
            kv_used_tokens=sum(len(r.req.input_ids) + len(r.out) for r in self._running if not r.done),
        )

    # -- hooks -------------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._gate.holds("pause")

    async def pause(self, mode: PauseMode = "abort") -> None:
        self._gate.hold("pause")
        if mode == "abort":
            self.abort_all()

    async def resume(self) -> None:
        self._gate.release("pause")

    async def flush_cache(self) -> None:
        return None

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.memory_released.update(tags or ("weights", "kv_cache"))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.memory_released.difference_update(tags or ("weights", "kv_cache"))

    async def init_weight_group(self, msg: InitWeightGroup) -> None:
        if not self.config.hang_init_weight_group:
            raise self._unsupported("init_weight_group")
        logging.getLogger("rollout_sdk.engine").warning("fake: init_weight_group blocks a worker thread for good")
        await asyncio.to_thread(threading.Event().wait)  # never set: the thread cannot be joined

    async def update_weights(
        self, named: NamedTensors, *, version: int | None = None, inflight: InflightMode = "reprefill"
    ) -> None:
        """Between two steps.  ``reprefill``: every started request's KV is modelled as recomputed on the new
        weights (``reprefilled_tokens`` counts it); ``keep``: it keeps the version it had."""
        check_inflight(inflight, False)
        staged: dict[str, list[float]] = {}
        for name, tensor in named:
            if name not in self.config.weight_shapes:
                raise WeightUpdateError(f"unknown parameter {name!r}", applied=False)
            if tuple(tensor.shape) != self.config.weight_shapes[name]:
                raise WeightUpdateError(
                    f"parameter {name!r}: shape {tuple(tensor.shape)} != {self.config.weight_shapes[name]}",
                    applied=False,
                )
            staged[name] = [float(x) for x in tensor.flatten().tolist()]
        self.weights.update(staged)
        if version is not None:
            self._weight_version = version
        if inflight == "reprefill":
            for r in self._reqs.values():
                if r.kv_version is not None and not r.done:
                    r.kv_version = self._weight_version
                    self.reprefilled_tokens += len(r.req.input_ids) + len(r.out) - 1
