"""Repetitions of two or more sides measured in alternation, and their medians.

Measuring side A then side B every repetition charges any drift through the run (a neighbour's job
starting, a cache warming) to B.  ABBA order (A B, B A, A B, ...) spreads it over both; the medians of the
repetitions, and the median of each repetition's paired ratio, are what the tables print.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from harness.machine import QUIET_PCT, CpuMeter, log, wait_quiet
from harness.stats import median

T = TypeVar("T")


def abba(reps: int, sides: Sequence[T]) -> Iterator[tuple[int, T]]:
    """``(repetition, side)`` in ABBA order: the sides as given in even repetitions, reversed in odd ones."""
    for rep in range(reps):
        for side in sides if rep % 2 == 0 else list(reversed(sides)):
            yield rep, side


def rotate(sides: Sequence[T], rep: int) -> list[T]:
    """The sides in repetition ``rep``'s order: rotated by ``rep``, so each side takes each place in turn."""
    k = rep % len(sides)
    return [*sides[k:], *sides[:k]]


async def alternate(reps: int, sides: Mapping[str, Callable[[int], Awaitable[T]]]) -> dict[str, list[T]]:
    """Await ``sides[name](rep)`` for every repetition in ABBA order; each side's results in repetition order."""
    out: dict[str, list[T]] = {name: [] for name in sides}
    for rep, name in abba(reps, list(sides)):
        out[name].append(await sides[name](rep))
    return out


def medians(results: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    """The median of each of ``keys`` over a side's repetitions (a list of result dicts)."""
    return {k: median(r[k] for r in results) for k in keys}


async def until_quiet(
    run: Callable[[], Awaitable[T]],
    *,
    wait_quiet_s: float,
    retries: int,
    foreign: Callable[[T], float | None] | None = None,
    wait_first: bool = True,
) -> tuple[T, float | None, int]:
    """Run one cell: ``(result, foreign CPU % of a core during it, attempts)``.

    With ``wait_quiet_s > 0`` (``--wait-quiet``) wait for a quiet machine first, and run the cell again, up to
    ``retries`` times (``--retries``), when other processes used more than QUIET_PCT of a core during it.
    ``foreign`` reads that load from the result where the cell measures its own window (and
    ``wait_first=False`` where it waits for quiet itself); otherwise it is measured around ``run``."""
    attempts = 1 + (retries if wait_quiet_s > 0 else 0)
    for attempt in range(attempts):
        if wait_first:
            await wait_quiet(wait_quiet_s)
        meter = CpuMeter()
        meter.start()
        result = await run()
        load = foreign(result) if foreign is not None else meter.stop()
        if load is None or load <= QUIET_PCT or attempt == attempts - 1:
            break
        log(f"other processes used {load:.0f}% of a core during that cell; measuring it again")
    return result, load, attempt + 1
