"""The one streaming producer behind ``generate_many`` and ``rollouts``: samples in, finished groups out.

Lifecycle (httpx's ``ClientState`` style; :class:`StreamState`)::

    UNOPENED ──start() (async with / first iteration)──▶ OPEN ──last group taken / failed──▶ EXHAUSTED
       │                                                  │                                    │
       └───────────────────────── aclose() ───────────────┴──────────────── aclose() ─────────▶ CLOSED

``aclose()`` is idempotent; a CLOSED producer refuses to start or to be taken from again
(StreamClosedError); an EXHAUSTED one keeps answering "no more" (the iterator protocol).

Concurrency and bounds::

    producer task (spawned by the owner: the client, which cancels it on close)
      waits on: `gate` (open unless the consumer paused it: partial mode between batches)
      waits on: `slots` (capacity C): a slot is taken before a sample is pulled and held until the
                consumer *releases* it: after taking the group (async, generate_many) or yielding the
                batch that holds it (sync); a dropped or re-queued group gives it back at once
      pulls the next sample: re-queued ones first, then the source (sync or async iterable)
      └─ TaskGroup ── one task per group: run_group(index, sample) ── puts its outcome on `done`
    consumer: take() waits on `changed`; it returns the next finished group, None once exhausted,
      or raises the producer's error

So at most C groups exist between being started and being released, whatever the speed of the
consumer: `done` never holds more than C groups, and the source is never read ahead by more than C.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._aio import cancel_and_wait, first_exception, iterate
from ..errors import ConfigError, StreamClosedError

__all__ = ["DROP", "REQUEUE", "Producer", "ProducerStatistics", "Spawn", "StreamState"]

R = TypeVar("R")
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class StreamState(enum.Enum):
    """Where a stream (ResultStream, RolloutStream) is in its lifecycle; see the module docstring."""

    #: created; nothing runs until the first ``async with`` or iteration
    UNOPENED = "unopened"
    #: the producer runs; groups can be taken
    OPEN = "open"
    #: every group was taken (or the producer failed and its error was raised): iteration ends
    EXHAUSTED = "exhausted"
    #: aclose() was called: nothing runs, and the stream refuses reuse
    CLOSED = "closed"


class _Outcome(enum.Enum):
    DROP = "drop"
    REQUEUE = "requeue"


#: run_group's answer for a group that is not kept (a filter said no): its slot is freed
DROP = _Outcome.DROP
#: run_group's answer for a group whose sample must run again (staleness): slot freed, sample re-queued
REQUEUE = _Outcome.REQUEUE


@dataclass(frozen=True)
class ProducerStatistics:
    """A snapshot (trio's ``statistics()`` idiom): slots, and where the groups holding them are."""

    #: slots: the most groups between being started and being released
    capacity: int
    #: groups running now (parked ones included)
    in_flight: int
    #: finished groups waiting for the consumer
    buffered: int
    #: samples given back, waiting for a slot to run again
    requeued: int
    #: slots held now (in flight + buffered + taken but not yet released)
    held: int


@dataclass(frozen=True)
class Finished(Generic[R]):
    index: int
    sample: Any
    value: R


class Producer(Generic[R]):
    """Runs ``run_group(index, sample)`` for each sample of ``source``, holding at most ``capacity`` slots."""

    def __init__(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        run_group: Callable[[int, Any], Awaitable[R | _Outcome]],
        *,
        capacity: int,
        spawn: Spawn,
        name: str,
        what: str = "stream",
    ) -> None:
        if capacity < 1:
            raise ConfigError("capacity", capacity, "must be >= 1")
        self.capacity = capacity
        self.state = StreamState.UNOPENED
        self._source = source
        self._run_group = run_group
        self._spawn = spawn
        self._name = name
        self._what = what
        self._slots = asyncio.Semaphore(capacity)
        self._held = 0
        self._done: collections.deque[Finished[R]] = collections.deque()
        self._requeue: collections.deque[tuple[int, Any]] = collections.deque()
        self._in_flight = 0
        self._source_done = False
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._requeued = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def check_usable(self) -> None:
        """StreamClosedError once closed: a stream is iterated once."""
        if self.state is StreamState.CLOSED:
            raise StreamClosedError(
                f"this {self._what} is closed: a stream runs once; make a new one to run the prompts again"
            )

    def start(self) -> None:
        """Start the producer task (once; later calls do nothing).  StreamClosedError when closed."""
        self.check_usable()
        if self.state is StreamState.UNOPENED:
            self._task = self._spawn(self._produce(), self._name)
            self.state = StreamState.OPEN

    async def aclose(self) -> None:
        """Cancel every group still running and refuse reuse.  Idempotent; the caller's cancellation
        propagates."""
        if self.state is StreamState.CLOSED:
            return
        self.state = StreamState.CLOSED
        self._changed.set()  # a consumer waiting in take() wakes and sees CLOSED
        task, self._task = self._task, None
        await cancel_and_wait(task)

    # -- consumer side -----------------------------------------------------------------------------

    @property
    def exhausted(self) -> bool:
        """Nothing more will ever finish: the source is spent and no group runs, waits or is re-queued."""
        return self._source_done and not self._in_flight and not self._requeue and not self._done

    async def take(self) -> Finished[R] | None:
        """The next finished group (its slot stays held until :meth:`release`), or None once exhausted."""
        while True:
            self.check_usable()
            if self._done:
                return self._done.popleft()
            if self._error is not None:
                error, self._error = self._error, None
                self.state = StreamState.EXHAUSTED
                raise error
            if self.state is StreamState.EXHAUSTED or self.exhausted:
                self.state = StreamState.EXHAUSTED
                return None
            self._changed.clear()
            await self._changed.wait()

    def release(self, n: int = 1) -> None:
        """Give back ``n`` slots: the consumer is done with ``n`` taken groups."""
        for _ in range(n):
            self._give_slot()

    def requeue(self, index: int, sample: Any) -> None:
        """Run ``sample`` again (before new ones) and give back the slot of its taken group."""
        self._requeue.append((index, sample))
        self._requeued.set()
        self._give_slot()

    def pause(self) -> None:
        """Start no new group until :meth:`resume` (running ones continue)."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def statistics(self) -> ProducerStatistics:
        return ProducerStatistics(
            capacity=self.capacity,
            in_flight=self._in_flight,
            buffered=len(self._done),
            requeued=len(self._requeue),
            held=self._held,
        )

    # -- producer side -----------------------------------------------------------------------------

    def _give_slot(self) -> None:
        if self._held <= 0:
            raise RuntimeError("released a slot that is not held")
        self._held -= 1
        self._slots.release()

    async def _take_slot(self) -> None:
        await self._slots.acquire()
        self._held += 1

    async def _produce(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                it = iterate(self._source)
                index = 0
                while True:
                    await self._gate.wait()
                    if self._source_done and not self._requeue:
                        self._requeued.clear()
                        await self._requeued.wait()  # only re-queued samples can come now
                        continue
                    await self._take_slot()
                    if not self._gate.is_set():  # paused while waiting for the slot
                        self._give_slot()
                        continue
                    if self._requeue:
                        idx, sample = self._requeue.popleft()
                    elif not self._source_done:
                        try:
                            sample = await anext(it)
                        except StopAsyncIteration:
                            self._source_done = True
                            self._give_slot()
                            self._changed.set()
                            continue
                        idx, index = index, index + 1
                    else:
                        self._give_slot()
                        continue
                    self._in_flight += 1
                    tg.create_task(self._one(idx, sample), name=f"{self._name}-group-{idx}")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._error is None:
                self._error = first_exception(exc)
            self._changed.set()

    async def _one(self, index: int, sample: Any) -> None:
        try:
            outcome = await self._run_group(index, sample)
        except BaseException as exc:
            # recorded before the task group unwinds: take() must never see "nothing in flight, source
            # spent" and report a clean end while the producer is failing
            if not isinstance(exc, asyncio.CancelledError) and self._error is None:
                self._error = exc
            self._changed.set()
            raise
        self._in_flight -= 1
        if outcome is REQUEUE:
            self._requeue.append((index, sample))
            self._requeued.set()
            self._give_slot()
        elif outcome is DROP:
            self._give_slot()
        else:
            self._done.append(Finished(index, sample, outcome))  # type: ignore[arg-type]
        self._changed.set()
