"""Many requests, results as they complete, ``n`` samples per prompt kept together.

Concurrency (the shared producer, :mod:`.producer`)::

    producer task (spawned by the client; cancelled by aclose() or the client's close)
      a slot is one group of n samples, from the moment its prompt is pulled until the consumer takes
      it; capacity = concurrency // n slots, so at most ``concurrency`` samples are in flight or finished
      but not taken, whatever the size of the input and the speed of the consumer
      └─ one task per group (TaskGroup) ── n sample coroutines ── generator.generate(...)
    consumer (``async for group in stream``): takes the next finished group, which frees its slot

Member k of a group is seeded ``sample_seed(seed, member=k)`` (:mod:`.seeds`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ConfigError
from ..protocol import GenerateRequest, GenerateResult, SamplingParams
from .generator import USE_CLIENT_DEFAULT, Generator, Prompt, UseClientDefault, as_request
from .producer import Producer, ProducerStatistics, Spawn, StreamState
from .seeds import sample_seed

__all__ = ["Group", "ResultStream"]


@dataclass(frozen=True)
class Group:
    """The ``n`` samples of one prompt.  ``index`` is the prompt's position in the input."""

    index: int
    request: GenerateRequest
    results: list[GenerateResult]
    errors: list[BaseException | None]

    @property
    def ok(self) -> bool:
        return all(e is None for e in self.errors)


class ResultStream:
    """Returned by :meth:`RolloutClient.generate_many`.  Iterate it once (``async for``), ideally inside
    ``async with`` so that breaking out of the loop cancels what is still running at once; otherwise
    that happens when the client closes.  A closed stream refuses reuse (StreamClosedError)."""

    def __init__(
        self,
        generator: Generator,
        requests: Iterable[Prompt] | AsyncIterable[Prompt],
        *,
        n: int,
        sampling: SamplingParams | None,
        concurrency: int,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        return_exceptions: bool,
        spawn: Spawn,
    ) -> None:
        if n < 1:
            raise ConfigError("n", n, "must be >= 1")
        if concurrency < n:
            raise ConfigError("concurrency", concurrency, f"must be >= n ({n})")
        self._generator = generator
        self._n = n
        self._sampling = sampling
        self._timeout = timeout
        self._return_exceptions = return_exceptions
        self._producer: Producer[Group] = Producer(
            requests, self._group, capacity=concurrency // n, spawn=spawn, name="generate-many", what="ResultStream"
        )

    @property
    def state(self) -> StreamState:
        return self._producer.state

    def statistics(self) -> ProducerStatistics:
        """Slots (groups of n samples) and where they are now."""
        return self._producer.statistics()

    def __aiter__(self) -> ResultStream:
        self._producer.start()
        return self

    async def __anext__(self) -> Group:
        self._producer.start()
        item = await self._producer.take()
        if item is None:
            raise StopAsyncIteration
        self._producer.release()
        return item.value

    async def __aenter__(self) -> ResultStream:
        self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every request still running for this stream.  Idempotent."""
        await self._producer.aclose()

    async def collect(self) -> list[Group]:
        """All groups, in input order."""
        groups = [g async for g in self]
        return sorted(groups, key=lambda g: g.index)

    # -- one group -----------------------------------------------------------------------------------

    async def _group(self, index: int, prompt: Prompt) -> Group:
        req = as_request(prompt, self._sampling)
        samples = [sample_variant(req, k, self._n) for k in range(self._n)]
        outs = await asyncio.gather(
            *(self._generator.generate(s, timeout=self._timeout) for s in samples), return_exceptions=True
        )
        errors: list[BaseException | None] = []
        results: list[GenerateResult] = []
        for o in outs:
            if isinstance(o, BaseException):
                if isinstance(o, asyncio.CancelledError):
                    raise o
                if not self._return_exceptions:
                    raise o
                errors.append(o)
            else:
                errors.append(None)
                results.append(o)
        return Group(index=index, request=req, results=results, errors=errors)


def sample_variant(req: GenerateRequest, k: int, n: int) -> GenerateRequest:
    """Member ``k`` of ``n`` samples of ``req``: its own rid and seed (:func:`.seeds.sample_seed`)."""
    if n == 1:
        return req
    changes: dict[str, Any] = {}
    if req.rid:
        changes["rid"] = f"{req.rid}/{k}"
    if req.sampling.seed is not None:
        changes["sampling"] = msgspec.structs.replace(req.sampling, seed=sample_seed(req.sampling.seed, member=k))
    return msgspec.structs.replace(req, **changes) if changes else req


