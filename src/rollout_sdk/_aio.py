"""Small asyncio helpers shared by the streaming modules, the engines, the server and the client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar, overload

__all__ = ["await_unless", "cancel_and_wait", "ended_with", "first_exception", "iterate"]

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
    """Cancel a task this object owns and wait until it has finished unwinding."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@overload
async def await_unless(aw: Awaitable[T], stop: Awaitable[object], *, error: Callable[[], BaseException]) -> T: ...


@overload
async def await_unless(aw: Awaitable[T], stop: Awaitable[object], *, error: None = None) -> T | None: ...


async def await_unless(
    aw: Awaitable[T], stop: Awaitable[object], *, error: Callable[[], BaseException] | None = None
) -> T | None:
    """Await ``aw`` unless ``stop`` completes first ("the call, unless the engine died meanwhile").

    ``aw`` finishing first: its result is returned (its exception raised).  ``stop`` finishing first (or
    ``aw`` cancelled by someone else): ``aw`` is cancelled and ``error()`` is raised, or None is returned
    when no ``error`` is given.  A coroutine passed as ``aw`` or ``stop`` runs in a task this call owns: it
    is cancelled and waited for before the call returns.  A future or task passed as ``stop`` belongs to the
    caller and is only watched, never cancelled.  The caller's cancellation propagates (after the owned
    tasks are cancelled).
    """
    task = asyncio.ensure_future(aw)
    watch_owned = not isinstance(stop, asyncio.Future)
    watcher = asyncio.ensure_future(stop)
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        leftover = [t for t in ((task, True), (watcher, watch_owned)) if t[1] and not t[0].done()]
        for t, _ in leftover:
            t.cancel()
        if leftover:
            await asyncio.wait([t for t, _ in leftover])
    if task.done() and not task.cancelled():
        return task.result()
    if error is not None:
        raise error()
    return None


def ended_with(task: asyncio.Future[Any], fallback: BaseException) -> BaseException:
    """The exception a finished task ended with, or ``fallback`` when it returned or was cancelled."""
    if task.done() and not task.cancelled():
        exc = task.exception()
        if exc is not None:
            return exc
    return fallback
