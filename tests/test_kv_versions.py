"""Issue 41's bookkeeping of KV versions: ``mixed_tokens`` against its per-token definition, and trajectories
that keep the KV-version runs of their turns."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk.protocol import GenerateResult, mixed_tokens


def _tokens(runs: list[tuple[int, int]]) -> list[int]:
    return [v for v, n in runs for _ in range(n)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=8), st.data())
def test_mixed_tokens_counts_the_tokens_whose_weights_and_kv_differ(runs: list[tuple[int, int]], data: Any) -> None:
    """Run-walking ``mixed_tokens`` against its per-token definition, on any two run lists over the same tokens."""
    n = sum(k for _, k in runs)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=6)))
    kv_versions = data.draw(st.lists(st.integers(0, 4), min_size=len(cuts) + 1, max_size=len(cuts) + 1))
    bounds = [0, *cuts, n]
    kv = [(kv_versions[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]
    want = sum(a != b for a, b in zip(_tokens(runs), _tokens(kv), strict=True))
    assert mixed_tokens(runs, kv) == want
    assert mixed_tokens(runs, []) == 0


def test_a_trajectory_says_which_tokens_were_sampled_from_older_kv() -> None:
    """Turns joined into a trajectory keep the KV-version runs next to the version runs (a ``keep`` update
    during the second turn), and a trajectory without one has none."""
    from rollout_sdk.agents import TrajectoryBuilder

    def result(rid: str, n: int, segs: list[tuple[int, int]], kv: list[tuple[int, int]]) -> GenerateResult:
        return GenerateResult(
            rid=rid,
            output_ids=list(range(n)),
            finish_reason="stop",
            prompt_tokens=3,
            weight_version=segs[-1][0],
            version_segments=segs,
            kv_version_segments=kv,
        )

    b = TrajectoryBuilder([1, 2, 3], "t")
    b.add_turn(result("a", 4, [(1, 4)], []), index=0, generate_s=0.0)
    b.add_context([9, 9])
    b.add_turn(result("b", 6, [(1, 2), (2, 4)], [(1, 6)]), index=1, generate_s=0.0)
    traj = b.build("stop")
    assert traj.weight_versions == [(1, 6), (2, 4)] and traj.kv_weight_versions == [(1, 10)]
    assert traj.mixed_kv_tokens == 4
    plain = TrajectoryBuilder([1], "p")
    plain.add_turn(result("c", 3, [(5, 3)], []), index=0, generate_s=0.0)
    assert plain.build("stop").kv_weight_versions == [] and plain.build("stop").mixed_kv_tokens == 0
