"""Repetitions of two or more sides measured in alternation, and their medians.

Measuring side A then side B every repetition charges any drift through the run (a neighbour's job
starting, a cache warming) to B.  ABBA order (A B, B A, A B, ...) spreads it over both; the medians of the
repetitions, and the median of each repetition's paired ratio, are what the tables print.

The GPU benches run a plan instead (:func:`run_plan`): per workload its sides, rotated every repetition,
each pass's row recorded as it comes (a killed run keeps what it had), no repetition begun that would not
fit the time left; :func:`by_side` and :func:`ratios` read the rows back by workload, side and repetition,
:func:`plan_summary` does both for every workload.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from harness.machine import QUIET_PCT, CpuMeter, log, wait_quiet
from harness.stats import median, span

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


#: a plan: per workload, the sides it runs
Plan = Sequence[tuple[str, Sequence[str]]]


async def run_plan(
    plan: Plan,
    reps: int,
    one_pass: Callable[[str, str, int], Awaitable[dict[str, Any]]],
    record: Callable[[dict[str, Any]], None],
    *,
    budget_s: float = float("inf"),
    started: float | None = None,
    margin: float = 1.1,
) -> str | None:
    """Every repetition: each workload's sides in :func:`rotate`'s order, ``await one_pass(side, workload, rep)``
    one at a time.  A pass that raises gives the row ``{"error": ...}`` (one broken pass must not lose the run);
    every row gets ``rep``, ``workload`` and ``mode`` (the side) and goes to ``record``.  No repetition is begun
    when what is left of ``budget_s`` (counted from ``started``, a ``time.perf_counter()``; default now) is
    under ``margin`` x the last repetition's time: then why (also logged), else None."""
    t0 = time.perf_counter() if started is None else started
    for rep in range(reps):
        t_rep = time.perf_counter()
        for workload, sides in plan:
            for side in rotate(list(sides), rep):
                try:
                    row = await one_pass(side, workload, rep)
                except Exception as exc:
                    row = {"error": f"{type(exc).__name__}: {exc}"}
                row.update(rep=rep, workload=workload, mode=side)
                record(row)
        rep_s = time.perf_counter() - t_rep
        left = budget_s - (time.perf_counter() - t0)
        if rep + 1 < reps and left < margin * rep_s:
            why = f"after {rep + 1} reps: {left:.0f}s of --budget-s left, a rep takes {rep_s:.0f}s"
            log(why)
            return why
    return None


def by_side(passes: Sequence[Mapping[str, Any]], key: str = "tok_s") -> dict[str, dict[str, dict[int, Any]]]:
    """The rows of :func:`run_plan` that measured ``key``: workload -> side -> repetition -> row.  Every
    workload run is there, one whose passes all failed with no sides."""
    out: dict[str, dict[str, dict[int, Any]]] = {p["workload"]: {} for p in passes}
    for p in passes:
        if key in p:
            out[p["workload"]].setdefault(p["mode"], {})[p["rep"]] = p
    return out


def ratios(
    sides: Mapping[str, Mapping[int, Mapping[str, Any]]], pairs: Sequence[tuple[str, str]], key: str = "tok_s"
) -> dict[str, dict[str, float]]:
    """``"num/den"``: the :func:`harness.stats.span` of the per-repetition ratios of ``key``, for each pair of
    sides both measured in some repetition (``sides``: one workload's part of :func:`by_side`)."""
    out: dict[str, dict[str, float]] = {}
    for num, den in pairs:
        if num == den or num not in sides or den not in sides:
            continue
        rs = [sides[num][r][key] / sides[den][r][key] for r in sides[num] if r in sides[den]]
        if rs:
            out[f"{num}/{den}"] = span(rs)
    return out


def plan_summary(
    passes: Sequence[Mapping[str, Any]],
    side: Callable[[Mapping[int, Any]], Any],
    pairs: Sequence[tuple[str, str]],
    key: str = "tok_s",
) -> dict[str, dict[str, Any]]:
    """Per workload of :func:`run_plan`'s rows: ``side(rows by repetition)`` for each side, the :func:`ratios`
    of ``key`` for ``pairs``, and ``all_ok``: every pass of the workload, failed ones too, was ``ok``."""
    out: dict[str, dict[str, Any]] = {}
    for workload, by in by_side(passes, key).items():
        row: dict[str, Any] = {name: side(reps) for name, reps in by.items()}
        row.update(ratios(by, pairs, key))
        row["all_ok"] = all(p.get("ok") for p in passes if p["workload"] == workload)
        out[workload] = row
    return out
