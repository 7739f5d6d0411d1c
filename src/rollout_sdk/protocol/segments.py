"""Version segments: which weights made which tokens, as ``(version, n)`` runs in token order.

One helper appends runs, merging a run into the previous one when the version is the same; every
place that accumulates tokens uses it: the engines as they generate (the CPU engine, the fake, SGLang's
parts), and across results a continuation's segments and a trajectory's turns.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import GenerateResult

__all__ = ["append_segments", "result_segments"]


def result_segments(result: GenerateResult) -> list[tuple[int, int]]:
    """The runs of one result: its ``version_segments``, or all its tokens on ``weight_version``."""
    if result.version_segments:
        return list(result.version_segments)
    return [(result.weight_version, len(result.output_ids))] if result.output_ids else []


def append_segments(runs: list[tuple[int, int]], segments: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Append ``segments`` to ``runs`` in place (merging equal neighbouring versions); returns ``runs``."""
    for version, n in segments:
        if n <= 0:
            continue
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + n)
        else:
            runs.append((version, n))
    return runs
