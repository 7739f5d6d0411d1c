"""Partial rollouts: continue an aborted generation later, on newer weights, keeping per-segment versions.

When a trainer pauses with ``mode="abort"`` (or a streaming producer cuts the tail of a batch), every
in-flight request comes back with ``finish_reason="abort"`` and the tokens it had.  A
:class:`Continuation` turns that into a resumable unit of work::

    cont = Continuation(request)
    result = await client.generate(cont.next_request())        # aborted half-way
    cont.add(result)
    ... update weights ...
    result = await client.generate(cont.next_request(current_version=client.weight_version, max_staleness=2))
    cont.add(result)
    final = cont.result()     # all tokens, logprobs, version_segments [(v1, n1), (v2, n2)]

The request continued is the prompt plus the tokens so far, asking for what is left of the original
``max_new_tokens``; the seed, if any, becomes ``sample_seed(seed, segment=k)`` for the k-th resumption
(:mod:`.seeds`), so a resumed sample is not a replay and is the same whoever resumes it.
``next_request`` refuses (StalenessError) when the first token's weights are more than ``max_staleness``
versions behind ``current_version``: the bound the client enforces when admitting the work again.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import StalenessError
from ..protocol import GenerateRequest, GenerateResult, Timings
from ..protocol.segments import append_segments, result_segments
from .seeds import sample_seed

__all__ = ["Continuation"]


class Continuation:
    """The segments of one generation that may be aborted and resumed any number of times."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[tuple[int, int]] = []
        self.aborts = 0
        self.finish_reason: str | None = None
        self.matched_stop: int | None = None
        self.total_s = 0.0
        self._last: GenerateResult | None = None
        self._first: GenerateResult | None = None  # its prompt expansion (requests with images)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None and self.finish_reason != "abort"

    @property
    def remaining(self) -> int:
        return self.request.sampling.max_new_tokens - len(self.output_ids)

    @property
    def first_version(self) -> int | None:
        return self.segments[0][0] if self.segments else None

    def staleness(self, current_version: int) -> int:
        """How many versions the first token's weights are behind ``current_version`` (0 before any)."""
        first = self.first_version
        return 0 if first is None else current_version - first

    def next_request(self, *, current_version: int | None = None, max_staleness: int | None = None) -> GenerateRequest:
        """The request that continues this generation (the original one before any token)."""
        if self.done:
            raise ValueError(f"generation {self.request.rid!r} already finished ({self.finish_reason})")
        if max_staleness is not None and current_version is not None:
            lag = self.staleness(current_version)
            if lag > max_staleness:
                raise StalenessError(
                    f"generation started on weights v{self.first_version}; resuming on v{current_version} is "
                    f"{lag} versions later (max_staleness={max_staleness})"
                )
        if not self.output_ids:
            return self.request
        sp = self.request.sampling
        sampling = msgspec.structs.replace(
            sp,
            max_new_tokens=max(1, self.remaining),
            min_new_tokens=max(0, sp.min_new_tokens - len(self.output_ids)),
            seed=sample_seed(sp.seed, segment=self.aborts),
        )
        return msgspec.structs.replace(
            self.request, input_ids=self.request.input_ids + self.output_ids, sampling=sampling, rid=""
        )

    def add(self, result: GenerateResult) -> None:
        """Record one segment's result (aborted or final)."""
        self.output_ids.extend(result.output_ids)
        lps = result.logprobs if result.logprobs is not None else [0.0] * len(result.output_ids)
        self.logprobs.extend(lps)
        append_segments(self.segments, result_segments(result))
        self.total_s += result.timings.total_s
        self.finish_reason = result.finish_reason
        if result.finish_reason == "abort":
            self.aborts += 1
            if self.remaining <= 0:  # aborted exactly at the end: it is complete
                self.finish_reason = "length"
        self.matched_stop = result.matched_stop
        self._last = result
        if self._first is None:
            self._first = result

    def result(self) -> GenerateResult:
        """The whole generation as one result, its tokens tagged by the weights that made them."""
        if self._last is None:
            raise ValueError("no segment recorded yet")
        last, first = self._last, self._first or self._last
        vision: dict[str, Any] = {}
        if first.input_ids is not None:
            vision = {
                "input_ids": first.input_ids,
                "image_spans": first.image_spans,
                "image_grid_thw": first.image_grid_thw,
            }
        return GenerateResult(
            rid=self.request.rid or last.rid,
            output_ids=list(self.output_ids),
            finish_reason=self.finish_reason or last.finish_reason,  # type: ignore[arg-type]
            prompt_tokens=len(first.input_ids) if first.input_ids is not None else len(self.request.input_ids),
            weight_version=last.weight_version,
            logprobs=list(self.logprobs) if self.request.return_logprobs else None,
            matched_stop=self.matched_stop,
            version_segments=list(self.segments),
            timings=Timings(total_s=self.total_s),
            server_id=last.server_id,
            **vision,
        )
