"""The engine's fast range: at most ``size`` requests of ours decode inside SGLang at once.

SGLang decodes a batch through a captured CUDA graph only up to ``cuda_graph_max_bs``; above it every
step launches its kernels one by one.  On an H200 a 0.5B engine with 1,024 long requests in flight ran
~1.6x slower than with 512 (docs/benchmarks.md), and SGLang's own running limit (thousands, sized from
the KV pool) does not stop that.  The window keeps the running batch inside the graphs: a request takes a
place before its first part is submitted and gives it back when it ends; the rest wait here, first come
first served, and enter the moment a place frees, without a round trip to any client (so the engine
refills as fast as from its own queue).

::

    generate(req) ── enter(flight) ── a place free?  yes ──▶ submit parts ... ── leave(flight)
                                      no ──▶ queued: waits on flight.wake, woken by
                                             leave() of another flight (handed its place),
                                             abort (user_aborted) or engine death ──▶ returns without one

A request waiting here is reported as queued (``EngineLoad.queued``), and the window is the running limit
the engine reports (``max_running_requests``), so clients size their in-flight windows to it.
Event-loop local; no lock.
"""

from __future__ import annotations

import asyncio
import collections

from .control import Flight

__all__ = ["DecodeWindow"]


class DecodeWindow:
    """Places in the engine's decode batch (see the module docstring)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"decode window size must be >= 1, got {size}")
        self.size = size
        self.taken = 0
        self._queue: collections.deque[Flight] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def enter(self, flight: Flight, *, stop: asyncio.Event | None = None) -> None:
        """Take a place for ``flight`` (``flight.slot`` becomes True), or return without one when it is
        aborted (``user_aborted``) or ``stop`` is set (the engine died).  A cancelled caller leaves the
        queue, and gives back a place handed to it meanwhile."""
        if flight.slot:
            return
        if not self._queue and self.taken < self.size:
            self.taken += 1
            flight.slot = True
            return
        self._queue.append(flight)
        try:
            while not flight.slot and not flight.user_aborted and not (stop is not None and stop.is_set()):
                flight.wake = asyncio.get_running_loop().create_future()
                try:
                    await flight.wake
                finally:
                    flight.wake = None
        finally:
            if not flight.slot:
                try:
                    self._queue.remove(flight)
                except ValueError:
                    pass

    def leave(self, flight: Flight) -> None:
        """Give ``flight``'s place back (no-op without one): handed to the first waiter, if any."""
        if not flight.slot:
            return
        flight.slot = False
        while self._queue:
            nxt = self._queue.popleft()
            if nxt.user_aborted:
                nxt.wake_up()
                continue
            nxt.slot = True  # the place moves on without being freed: nobody can take it in between
            nxt.wake_up()
            return
        self.taken -= 1

    def resize(self, size: int) -> None:
        """A new size; waiters are let in while places are free."""
        self.size = max(1, size)
        while self._queue and self.taken < self.size:
            nxt = self._queue.popleft()
            self.taken += 1
            nxt.slot = True
            nxt.wake_up()
