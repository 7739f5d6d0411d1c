"""One request inside the CPU engine: its tokens, its randomness, its future.

What can be derived from the tokens is a property (``num_completion_tokens``, ``token_ids``,
``wants_more_tokens``), never a field kept in step by hand.  The event loop appends tokens; the worker
thread reads a sequence's tokens and sampling parameters between two appends and draws from its ``rng``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable
from typing import Any

from ...protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams, Timings
from ...protocol.segments import append_segments

__all__ = ["Sequence", "vision_fields"]


class Sequence:
    """One request in the engine.  ``done`` is set once, by the loop thread; the worker drops done rows."""

    __slots__ = (
        "cache_ns",
        "cached_tokens",
        "done",
        "future",
        "kv_segments",
        "kv_version",
        "logprobs",
        "max_context",
        "out",
        "prompt",
        "req",
        "rng",
        "segments",
        "stop_ids",
        "t0",
        "t_first",
        "vision",
    )

    def __init__(
        self,
        req: GenerateRequest,
        eos: Iterable[int],
        max_context: int,
        rng: random.Random,
        future: asyncio.Future[GenerateResult],
        vision: Any = None,
        *,
        cache_ns: str = "",
    ) -> None:
        sp = req.sampling
        self.req = req
        #: a request with images: its VisionInputs (models.vision); the prompt is then the expanded ids
        self.vision = vision
        self.prompt = req.input_ids if vision is None else vision.input_ids
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[tuple[int, int]] = []  # (weight_version, num_tokens) runs over ``out``
        #: the weight version of its KV's oldest part: set by the worker at each (re-)prefill of the row
        self.kv_version = 0
        self.kv_segments: list[tuple[int, int]] = []  # (kv_version, num_tokens) runs over ``out``
        self.rng = rng  # drawn from by the worker only
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(eos)
        self.stop_ids = frozenset(stops)
        self.max_context = max_context
        self.future = future
        self.t0 = time.perf_counter()
        self.t_first = 0.0
        self.done = False
        #: the prefix-cache namespace (prefix_cache.py): a lookup never crosses it (the weight version's key)
        self.cache_ns = cache_ns
        #: prompt tokens its first prefill took from the prefix cache (set by the worker)
        self.cached_tokens = 0

    # -- derived state -----------------------------------------------------------------------------

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def sampling(self) -> SamplingParams:
        return self.req.sampling

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.out)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and completion: what a (re-)prefill feeds the model."""
        return self.prompt + self.out

    @property
    def is_penalized(self) -> bool:
        sp = self.req.sampling
        return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0

    @property
    def stops_banned(self) -> bool:
        """Stop ids may not be sampled yet (``min_new_tokens`` not reached)."""
        return bool(self.stop_ids) and len(self.out) < self.req.sampling.min_new_tokens

    # -- the loop thread's side ----------------------------------------------------------------------

    def append(self, token: int, logprob: float, version: int, now: float) -> FinishReason | None:
        """Record one sampled token; return why the sequence ends now, or None."""
        if not self.out:
            self.t_first = now
        self.out.append(token)
        self.logprobs.append(logprob)
        append_segments(self.segments, ((version, 1),))
        append_segments(self.kv_segments, ((self.kv_version, 1),))
        sp = self.req.sampling
        n = len(self.out)
        if token in self.stop_ids and n >= sp.min_new_tokens:
            return "stop"
        if n >= sp.max_new_tokens or len(self.prompt) + n >= self.max_context:
            return "length"
        return None

    def result(self, reason: FinishReason, *, weight_version: int, matched: int | None = None) -> GenerateResult:
        now = time.perf_counter()
        first = self.t_first or now
        return GenerateResult(
            rid=self.rid,
            output_ids=list(self.out),
            finish_reason=reason,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            weight_version=weight_version,
            logprobs=list(self.logprobs) if self.req.return_logprobs else None,
            matched_stop=matched,
            version_segments=list(self.segments),
            kv_version_segments=list(self.kv_segments) if self.kv_segments != self.segments else [],
            timings=Timings(queue_s=first - self.t0, ttft_s=first - self.t0, total_s=now - self.t0),
            **vision_fields(self.vision),
        )

    def __repr__(self) -> str:
        n, m = self.num_prompt_tokens, self.num_completion_tokens
        return f"<Sequence {self.rid} prompt={n} out={m} done={self.done}>"


def vision_fields(vision: Any) -> dict[str, Any]:
    """The result fields of a request with images (none for a text-only one)."""
    return {} if vision is None else dict(vision.result_fields())
