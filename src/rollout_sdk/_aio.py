"""Small asyncio helpers shared by the streaming modules, the engines, the server and the client, and the
one :class:`LifecycleGuard` that the client, the server, the gateway and the bridge keep their phase in; and
:func:`blocking_phase`, the thread that speaks while a block holds its own thread (an import of torch)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import sys
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Self, TypeVar, overload

from .errors import LifecycleError

__all__ = [
    "LifecycleGuard",
    "LifecycleState",
    "OpenedWith",
    "await_unless",
    "blocking_phase",
    "cancel_and_wait",
    "ended_with",
    "first_exception",
    "iterate",
]

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


@overload
async def await_unless(
    aw: Awaitable[T], stop: Awaitable[object], *, error: Callable[[], BaseException], timeout: float | None = None
) -> T: ...


@overload
async def await_unless(
    aw: Awaitable[T], stop: Awaitable[object], *, error: None = None, timeout: float | None = None
) -> T | None: ...


async def await_unless(
    aw: Awaitable[T],
    stop: Awaitable[object],
    *,
    error: Callable[[], BaseException] | None = None,
    timeout: float | None = None,
) -> T | None:
    """Await ``aw`` unless ``stop`` completes first ("the call, unless the engine died meanwhile").

    ``aw`` finishing first: its result is returned (its exception raised).  ``stop`` finishing first (or
    ``aw`` cancelled by someone else, or ``timeout`` seconds passing first): ``aw`` is cancelled and
    ``error()`` is raised, or None is returned when no ``error`` is given.  A result that ``aw`` has when
    the race ends is never dropped: ``aw`` done is ``aw``'s answer, whatever else finished too.
    A coroutine passed as ``aw`` or ``stop`` runs in a task this call owns: it
    is cancelled and waited for before the call returns.  A future or task passed as ``stop`` belongs to the
    caller and is only watched, never cancelled.  The caller's cancellation propagates (after the owned
    tasks are cancelled).
    """
    task = asyncio.ensure_future(aw)
    watch_owned = not isinstance(stop, asyncio.Future)
    watcher = asyncio.ensure_future(stop)
    try:
        await asyncio.wait((task, watcher), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
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


# -- lifecycles ---------------------------------------------------------------------------------------


class OpenedWith:
    """``async with x:`` is ``await x.open()``, then ``await x.aclose()`` on the way out, whatever happened:
    the client's and the gateway's context manager, written once (each defines ``open`` and ``aclose``)."""

    async def open(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class LifecycleState(enum.Enum):
    """Where a component (client, server, gateway, bridge) is in its lifecycle; it never goes back."""

    #: created; open() (or ``async with``, ``serve()``) has not been called
    UNOPENED = "unopened"
    #: opening: finding servers, starting the engine, binding
    OPENING = "opening"
    #: open: it serves or is used
    OPEN = "open"
    #: closing: aborting work, closing sockets
    CLOSING = "closing"
    #: closed for good: a component never reopens
    CLOSED = "closed"


class LifecycleGuard:
    """One component's phase, ``unopened -> opening -> open -> closing -> closed``, and its misuse errors.

    Each transition is one call; a misuse (opening twice, using it when it is not open) raises ``error``
    (a :class:`~rollout_sdk.errors.LifecycleError`) naming the component and its state.  Closing is
    idempotent: :meth:`closing` says whether this call is the one that closes.  (Not ``Lifecycle``: that
    public name is one request's timeline, :class:`rollout_sdk.protocol.Lifecycle`.)
    """

    __slots__ = ("_error", "owner", "state")

    def __init__(self, owner: str, *, error: type[LifecycleError] = LifecycleError) -> None:
        self.owner = owner
        self.state = LifecycleState.UNOPENED
        self._error = error

    def opening(self) -> None:
        """unopened -> opening; a second open raises."""
        if self.state is not LifecycleState.UNOPENED:
            raise self._error(f"a {self.owner} opens once (this one is {self.state.value})", state=self.state.value)
        self.state = LifecycleState.OPENING

    def opened(self) -> None:
        """opening -> open (a close that came meanwhile wins)."""
        if self.state is LifecycleState.OPENING:
            self.state = LifecycleState.OPEN

    def closing(self) -> bool:
        """-> closing; False when it is closing or closed already (the caller has nothing to do)."""
        if self.state in (LifecycleState.CLOSING, LifecycleState.CLOSED):
            return False
        self.state = LifecycleState.CLOSING
        return True

    def closed(self) -> None:
        self.state = LifecycleState.CLOSED

    async def open_with(self, start: Callable[[], Awaitable[None]], teardown: Callable[[], Awaitable[None]]) -> None:
        """``opening``, await ``start()``, ``opened``; when ``start`` fails, ``teardown()`` runs (closing), then
        the component is closed and the failure propagates."""
        self.opening()
        try:
            await start()
        except BaseException:
            self.state = LifecycleState.CLOSING
            try:
                await teardown()
            finally:
                self.closed()
            raise
        self.opened()

    async def close_with(self, teardown: Callable[[], Awaitable[None]]) -> None:
        """``teardown()`` once, between closing and closed; later calls return at once (idempotent close)."""
        if not self.closing():
            return
        try:
            await teardown()
        finally:
            self.closed()

    @property
    def is_open(self) -> bool:
        return self.state is LifecycleState.OPEN

    def check_open(self, hint: str) -> None:
        """Raise unless open: ``"<owner> is <state>: <hint>"``."""
        if self.state is not LifecycleState.OPEN:
            raise self._error(f"{self.owner} is {self.state.value}: {hint}", state=self.state.value)


@contextlib.contextmanager
def ticking(every_s: float, say: Callable[[float], None], *, name: str) -> Iterator[None]:
    """Call ``say(seconds since the block began)`` every ``every_s`` seconds until the block ends, from a
    thread, not a task: the block may hold the event loop (an import, a model load) and a task would wait for
    it in silence.  The thread is joined on the way out, whatever the block raised."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        while not stop.wait(every_s):
            say(time.perf_counter() - t0)

    ticker = threading.Thread(target=tick, name=name)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


@contextlib.contextmanager
def blocking_phase(label: str, *, every_s: float = 4.0, out: Any = None, enabled: bool = True) -> Iterator[None]:
    """:func:`phase` for a block that holds its thread, an example's ``import torch`` (14-20 s on a machine
    at a load of 7, issue 37): it says every ``every_s`` seconds that it still runs (:func:`ticking`).
    ``enabled=False`` says nothing (an example imported by a test, not run)."""
    if not enabled:
        yield
        return
    stream = out or sys.stdout
    t0 = time.perf_counter()
    print(f"{label} ...", file=stream, flush=True)

    def say(elapsed: float) -> None:
        print(f"{label} ... still running ({elapsed:.0f}s)", file=stream, flush=True)

    with ticking(every_s, say, name=f"phase-{label}"):
        yield
    print(f"{label}: done in {time.perf_counter() - t0:.1f}s", file=stream, flush=True)
