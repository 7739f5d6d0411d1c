"""The few statistics the benchmarks report: percentiles, medians, median [min-max], step-cost curves."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Iterable, Sequence

#: a decode step's time as a function of the batch size
StepFn = Callable[[int], float]


def pct(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) by rank, ``nan`` for no values: ``sorted(values)[int(q * n)]``."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def median(values: Iterable[float]) -> float:
    """The median (mean of the middle two for an even count); ``nan`` for no values."""
    v = list(values)
    return statistics.median(v) if v else float("nan")


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)``: how the tables write repetitions, ``median [min-max]``."""
    return median(values), min(values), max(values)


def span(values: Sequence[float], ndigits: int | None = 3) -> dict[str, float]:
    """:func:`spread` as a result records it: ``{"median", "min", "max"}``, each rounded to ``ndigits``."""
    med, lo, hi = spread(values)
    return {"median": round(med, ndigits), "min": round(lo, ndigits), "max": round(hi, ndigits)}


def interpolate(points: dict[int, float]) -> StepFn:
    """Piecewise-linear step time over the calibrated batch sizes (flat beyond the ends)."""
    xs = sorted(points)
    ys = [points[x] for x in xs]

    def step(b: int) -> float:
        if b <= xs[0]:
            return ys[0]
        if b >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_left(xs, b)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)

    return step
