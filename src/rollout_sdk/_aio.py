"""Small asyncio helpers shared by the streaming modules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "first_exception", "iterate"]

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


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task this object owns and wait until it has finished unwinding.

    The task's own cancellation is expected and swallowed; the *caller's* is not: if the task calling
    this is cancelled while it waits, CancelledError propagates (asyncio's contract), and the owned
    task, already cancelled, finishes unwinding on its own.  Any other exception of the task propagates.
    """
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling() > 0:
            raise  # we are being cancelled ourselves, not (only) the task we cancelled
