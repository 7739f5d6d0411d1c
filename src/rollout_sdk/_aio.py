"""Small asyncio helpers shared by the streaming modules."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TypeVar

__all__ = ["first_exception", "iterate"]

T = TypeVar("T")


async def iterate(items: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
    """Iterate a sync or async iterable asynchronously."""
    if isinstance(items, AsyncIterable):
        async for x in items:
            yield x
    else:
        for x in items:
            yield x


def first_exception(exc: BaseException) -> BaseException:
    """The first leaf of a (nested) exception group: what a task group's caller should see."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
