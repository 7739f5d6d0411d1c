"""Many requests through one client, results as they complete, ``n`` samples per prompt kept together.

Concurrency::

    producer task (owned by the client; cancelled by aclose() or the client's close)
      pulls the next prompt only when `permits` allow: a permit is one sample in flight or one sample
      of a finished group not yet taken by the consumer, so memory stays bounded by `concurrency`
      whatever the size of the input and the speed of the consumer
      └─ one task per group (TaskGroup) ── n sample coroutines ── client.generate(...)
           puts the finished Group on `queue`
    consumer (``async for group in stream``)
      waits on: `queue`; taking a group gives its n permits back
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from .._aio import cancel_and_wait, first_exception, iterate
from ..errors import ConfigError
from ..protocol import GenerateRequest, GenerateResult, SamplingParams

if TYPE_CHECKING:
    from ..client import RolloutClient

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


class _End:
    pass


Prompt = GenerateRequest | list[int]


class ResultStream:
    """Returned by :meth:`RolloutClient.generate_many`.  Iterate it (``async for``), ideally inside
    ``async with`` so that breaking out of the loop cancels what is still running at once; otherwise
    that happens when the client closes."""

    def __init__(
        self,
        client: RolloutClient,
        requests: Iterable[Prompt] | AsyncIterable[Prompt],
        *,
        n: int,
        sampling: SamplingParams | None,
        concurrency: int,
        timeout: float | None,
        return_exceptions: bool,
    ) -> None:
        if n < 1:
            raise ConfigError("n", n, "must be >= 1")
        if concurrency < n:
            raise ConfigError("concurrency", concurrency, f"must be >= n ({n})")
        self._client = client
        self._requests = requests
        self._n = n
        self._sampling = sampling
        self._timeout = timeout
        self._return_exceptions = return_exceptions
        self._permits = asyncio.Semaphore(concurrency)
        self._queue: asyncio.Queue[Group | BaseException | _End] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._finished = False

    def _start(self) -> None:
        if self._task is None:
            self._task = self._client._own(self._produce(), name="generate-many")

    def __aiter__(self) -> ResultStream:
        self._start()
        return self

    async def __anext__(self) -> Group:
        if self._finished:
            raise StopAsyncIteration
        self._start()
        item = await self._queue.get()
        if isinstance(item, _End):
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        for _ in range(self._n):
            self._permits.release()
        return item

    async def __aenter__(self) -> ResultStream:
        self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every request still running for this stream."""
        self._finished = True
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def collect(self) -> list[Group]:
        """All groups, in input order."""
        groups = [g async for g in self]
        return sorted(groups, key=lambda g: g.index)

    # -- producer ------------------------------------------------------------------------------------

    async def _produce(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                index = 0
                async for prompt in iterate(self._requests):
                    req = self._client._as_request(prompt, self._sampling)
                    for _ in range(self._n):
                        await self._permits.acquire()
                    tg.create_task(self._group(index, req))
                    index += 1
            self._queue.put_nowait(_End())
        except asyncio.CancelledError:
            raise
        except BaseExceptionGroup as eg:
            self._queue.put_nowait(first_exception(eg))
        except BaseException as exc:
            self._queue.put_nowait(exc)

    async def _group(self, index: int, req: GenerateRequest) -> None:
        samples = [_sample_variant(req, k, self._n) for k in range(self._n)]
        outs = await asyncio.gather(
            *(self._client.generate(s, timeout=self._timeout) for s in samples), return_exceptions=True
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
        self._queue.put_nowait(Group(index=index, request=req, results=results, errors=errors))


def _sample_variant(req: GenerateRequest, k: int, n: int) -> GenerateRequest:
    if n == 1:
        return req
    changes: dict[str, Any] = {}
    if req.rid:
        changes["rid"] = f"{req.rid}/{k}"
    if req.sampling.seed is not None:
        changes["sampling"] = msgspec.structs.replace(req.sampling, seed=req.sampling.seed + k)
    return msgspec.structs.replace(req, **changes) if changes else req
