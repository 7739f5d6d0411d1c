"""The demos' progress bar (``rollout-sdk demo``, ``demo --rl``): trajectories done, and what the engines do.

rollout_progress(rc, total, enabled)  -- async with: a bar, and a ticker task (its child) that sets the
    |                                    bar's postfix from ``rc.stats()`` every second
    `-- on exit: the ticker is cancelled and awaited, then the bar is closed
phase(label)                          -- async with: a line at the start, one every 4 s, one at the end
blocking_phase(label)                 -- with: the same around a block that holds its thread (an import)
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from .._aio import blocking_phase, cancel_and_wait

__all__ = ["blocking_phase", "phase", "rollout_progress"]


class _NoBar:
    def update(self, n: int) -> None:
        return None

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        return None

    def close(self) -> None:
        return None


@contextlib.asynccontextmanager
async def rollout_progress(
    rc: Any, total: int, enabled: bool, *, desc: str = "rollouts", leave: bool = True
) -> AsyncIterator[Any]:
    """A bar of trajectories done (``update(n)``) that also says, every second, how many model turns the
    engines of ``rc`` (a RolloutClient) have answered since it opened: the trajectories of one batch end
    together, so without it the bar would sit at 0 for the whole batch."""
    bar = _progress(total, enabled, desc=desc, leave=leave)
    first = sum(x.completed for x in rc.stats().servers)

    async def tick() -> None:
        while True:
            st = rc.stats()
            done = sum(x.completed for x in st.servers) - first
            bar.set_postfix_str(f"model turns answered {done}, running {st.in_flight}", refresh=True)
            await asyncio.sleep(1.0)

    ticker = asyncio.get_running_loop().create_task(tick(), name="demo-progress")
    try:
        yield bar
    finally:
        await cancel_and_wait(ticker)
        bar.close()


class _LineBar:
    """The bar as plain lines, for an output that is not a terminal (a file, a pipe, a CI log): a ``\\r``
    frame every second would pile up on one line there.  One line per ``every_s`` at most, and one at the
    end."""

    def __init__(self, total: int, desc: str, *, every_s: float = 4.0, out: Any = None) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.out = out or sys.stderr
        self.n = 0
        self.postfix = ""
        self._clock = time.monotonic
        self._t0 = self._last = self._clock()
        self._closed = False

    def _line(self) -> None:
        elapsed = self._clock() - self._t0
        post = f", {self.postfix}" if self.postfix else ""
        print(
            f"{self.desc}: {self.n}/{self.total} trajectories done, {elapsed:.0f}s elapsed{post}",
            file=self.out,
            flush=True,
        )
        self._last = self._clock()

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        if self._clock() - self._last >= self.every_s:
            self._line()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line()


@contextlib.asynccontextmanager
async def phase(label: str, *, every_s: float = 4.0, out: Any = None) -> AsyncIterator[None]:
    """Say that a phase starts, then every ``every_s`` seconds that it still runs, then how long it took:
    the rule of the examples and demos, no silence longer than a few seconds (issue 37).  A ticker task
    (its child) prints; it is cancelled and awaited on exit, whatever the body raised.

    Example::

        async with phase("step 0: generating"):
            groups = await client.generate_many(...).collect()
    """
    stream = out or sys.stdout
    t0 = time.perf_counter()
    print(f"{label} ...", file=stream, flush=True)

    async def tick() -> None:
        while True:
            await asyncio.sleep(every_s)
            print(f"{label} ... still running ({time.perf_counter() - t0:.0f}s)", file=stream, flush=True)

    ticker = asyncio.get_running_loop().create_task(tick(), name=f"phase-{label}")
    try:
        yield
    finally:
        await cancel_and_wait(ticker)
    print(f"{label}: done in {time.perf_counter() - t0:.1f}s", file=stream, flush=True)


def _progress(total: int, enabled: bool, *, desc: str = "rollouts", leave: bool = True) -> Any:
    if not enabled:
        return _NoBar()

    if not sys.stderr.isatty():  # plain lines where a \r frame would not redraw (issue 37)
        return _LineBar(total, desc)
    from tqdm import tqdm  # lazy: cli-start

    # no rate or remaining-time estimate: the trajectories of one batch finish together, so an estimate
    # from the first ones is wrong by orders of magnitude (20 minutes shown for 40 s)
    return tqdm(
        total=total,
        desc=desc,
        mininterval=0.2,
        leave=leave,
        bar_format="{desc}: {n_fmt}/{total_fmt} trajectories done, {elapsed} elapsed{postfix}",
    )
