"""Trajectory export: JSONL round trip (property-based), bad input refused, the demo writes one."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk.agents import Trajectory
from rollout_sdk.export import ExportError, iter_jsonl, read_jsonl, trajectory_from_result, write_jsonl
from rollout_sdk.protocol import GenerateResult, Lifecycle, RoutedExperts, Timings

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
ids = st.lists(st.integers(0, 2**31 - 1), max_size=20)
json_scalar = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | st.text(max_size=10)


@st.composite
def lifecycles(draw: st.DrawFn) -> Lifecycle:
    t0 = draw(st.floats(0, 2e9))
    return Lifecycle(
        queued_at=t0,
        dispatched_at=t0 + draw(st.floats(0, 10)),
        finished_at=t0 + draw(st.floats(10, 20)),
        server_id=draw(st.text(max_size=8)),
        first_token_at=draw(st.none() | st.floats(0, 2e9)),
        attempts=draw(st.integers(1, 5)),
        failed_over_from=draw(st.lists(st.text(max_size=5), max_size=3)),
    )


@st.composite
def routed(draw: st.DrawFn) -> RoutedExperts:
    t, layers, k = draw(st.integers(0, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    return RoutedExperts.from_nested(
        [[[draw(st.integers(0, 255)) for _ in range(k)] for _ in range(layers)] for _ in range(t)]
    )


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    response = draw(ids)
    n = len(response)
    return Trajectory(
        id=draw(st.text(max_size=12)),
        prompt_ids=draw(ids),
        response_ids=response,
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        logprobs=draw(st.lists(finite, min_size=n, max_size=n)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort", "max_turns", "error"])),
        weight_versions=draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 100)), max_size=3)),
        reward=draw(st.none() | finite),
        metadata=draw(st.dictionaries(st.text(max_size=6), json_scalar, max_size=4)),
        metrics=draw(st.dictionaries(st.text(max_size=6), finite, max_size=3)),
        sample_index=draw(st.integers(-1, 10**6)),
        lifecycles=draw(st.lists(lifecycles(), max_size=3)),
        routed_experts=draw(st.lists(routed(), max_size=2)),
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(trajectories(), max_size=5))
def test_jsonl_round_trip(trajs: list[Trajectory]) -> None:
    buf = io.BytesIO()
    assert write_jsonl(trajs, buf) == len(trajs)
    text = buf.getvalue()
    assert text.count(b"\n") == len(trajs)  # one trajectory per line
    back = list(_iter_bytes(text))
    assert back == trajs


def _iter_bytes(data: bytes):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        f.write(data)
        f.flush()
        yield from iter_jsonl(f.name)


def test_append_and_routed_experts_survive(tmp_path: Path) -> None:
    experts = [[[1, 7], [3, 4]], [[0, 2], [5, 6]], [[7, 1], [2, 2]]]
    result = GenerateResult(
        rid="r1",
        output_ids=[5, 6],
        finish_reason="stop",
        prompt_tokens=1,
        weight_version=3,
        logprobs=[-0.5, -1.25],
        timings=Timings(total_s=0.1),
        routed_experts=RoutedExperts.from_nested(experts),
        lifecycle=Lifecycle(queued_at=1.0, dispatched_at=1.5, finished_at=2.0, server_id="s0", attempts=2),
    )
    path = tmp_path / "t.jsonl"
    write_jsonl([trajectory_from_result([9], result, reward=1.0, metadata={"task": "add"})], path)
    write_jsonl([trajectory_from_result([9], result, id="second")], path, append=True)
    first, second = read_jsonl(path)
    assert first.ids == [9, 5, 6] and first.loss_mask == [1, 1] and first.logprobs == [-0.5, -1.25]
    assert first.weight_versions == [(3, 2)] and first.reward == 1.0 and first.metadata == {"task": "add"}
    assert first.lifecycles[0].server_id == "s0" and first.lifecycles[0].attempts == 2
    assert first.routed_experts[0].to_list() == experts
    assert first.routed_experts[0].to_numpy().shape == (3, 2, 2)
    assert second.id == "second"


def test_bad_trajectories_are_refused_by_name(tmp_path: Path) -> None:
    ok = Trajectory(id="a", prompt_ids=[1], response_ids=[2], loss_mask=[1], logprobs=[-1.0], finish_reason="stop")
    bad = Trajectory(
        id="b", prompt_ids=[1], response_ids=[2], loss_mask=[1], logprobs=[-math.inf], finish_reason="stop"
    )
    with pytest.raises(ExportError, match=r"'b'.*logprobs\[0\]"):
        write_jsonl([ok, bad], io.BytesIO())
    ragged = Trajectory(
        id="c", prompt_ids=[], response_ids=[2, 3], loss_mask=[1], logprobs=[0.0, 0.0], finish_reason="stop"
    )
    with pytest.raises(ExportError, match="same length"):
        write_jsonl([ragged], io.BytesIO())
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": "a"}\n')
    with pytest.raises(ExportError, match=r"x.jsonl:1"):
        read_jsonl(path)


def test_routed_experts_reject_inconsistent_data() -> None:
    from rollout_sdk.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"routed_experts\.data"):
        RoutedExperts(num_tokens=2, num_layers=1, top_k=1, data=b"\x00\x00")
    with pytest.raises(InvalidRequestError, match="ragged"):
        RoutedExperts.from_nested([[[1]], [[1, 2]]])


@pytest.mark.slow
async def test_demo_writes_trajectories(tmp_path: Path, tool_model: Path) -> None:
    import io as _io

    from rollout_sdk.demos.generate import DemoConfig, run_demo

    path = tmp_path / "demo.jsonl"
    cfg = DemoConfig(prompts=2, group_size=2, max_new_tokens=4, progress=False, export=str(path))
    await run_demo(cfg, out=_io.StringIO())
    trajs = read_jsonl(path)
    assert len(trajs) == 4
    for t in trajs:
        assert len(t.response_ids) == len(t.logprobs) == len(t.loss_mask) > 0
        assert t.lifecycles and t.lifecycles[0].server_id.startswith("embedded")
        assert t.weight_versions == [(0, len(t.response_ids))]


async def test_rollout_trajectories_carry_lifecycles_and_export(fake_servers, tmp_path: Path) -> None:
    from rollout_sdk import RolloutClient, SamplingParams

    servers = await fake_servers(2)
    async with RolloutClient([s.address for s in servers]) as client:
        sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
        async with client.rollouts([[1, 2, 3], [4, 5]], sampling=sp, group_size=2, batch_groups=2) as stream:
            batch = await anext(aiter(stream))
    trajs = batch.trajectories
    assert len(trajs) == 4
    for t in trajs:
        assert len(t.lifecycles) == 1
        lc = t.lifecycles[0]
        assert lc.server_id in ("fake-0", "fake-1") and lc.queued_at <= lc.dispatched_at <= lc.finished_at
    path = tmp_path / "batch.jsonl"
    assert write_jsonl(trajs, path) == 4
    assert read_jsonl(path) == trajs


def test_every_line_carries_the_schema_version_and_every_default(tmp_path: Path) -> None:
    import json

    from rollout_sdk.rollouts.trajectory import TRAJECTORY_SCHEMA_VERSION

    traj = Trajectory(id="t", prompt_ids=[1], response_ids=[2], loss_mask=[1], logprobs=[-0.5], finish_reason="stop")
    path = tmp_path / "v.jsonl"
    write_jsonl([traj], path)
    line = json.loads(path.read_text())
    assert line["schema_version"] == TRAJECTORY_SCHEMA_VERSION == 1
    assert line["drift"] is None and line["metadata"] == {} and line["lifecycles"] == []  # defaults written
    del line["schema_version"]  # a line from before the field existed loads as version 1
    path.write_text(json.dumps(line) + "\n")
    assert read_jsonl(path)[0].schema_version == 1
