"""Streaming rollouts over real servers (batching fake engines, lognormal response lengths)."""

from __future__ import annotations

import random

import pytest

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngineConfig

STEP = FakeEngineConfig(step_base_s=0.002, step_per_seq_s=0.00002, max_batch=64)


def lognormal_prompts(n: int, seed: int = 0, median: int = 12, sigma: float = 1.0, cap: int = 200) -> list:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        length = max(1, min(cap, int(rnd.lognormvariate(0, sigma) * median)))
        out.append(GenerateRequest(input_ids=[7, 1000 + i], sampling=SamplingParams(max_new_tokens=length)))
    return out


def _check_complete(trajs, prompts) -> None:
    for t in trajs:
        want = prompts[t.sample_index].sampling.max_new_tokens
        assert len(t.response_ids) == want, (t.sample_index, len(t.response_ids), want)
        assert t.finish_reason == "length"
        assert len(t.logprobs) == len(t.response_ids) == sum(n for _, n in t.weight_versions)


@pytest.mark.parametrize("mode", ["partial", "async", "sync"])
async def test_every_prompt_in_exactly_one_group_across_updates(fake_servers, mode) -> None:
    servers = await fake_servers(2, STEP)
    prompts = lognormal_prompts(60, seed=1)
    seen: list[int] = []
    resumed = 0
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.rollouts(prompts, group_size=2, batch_groups=8, mode=mode, max_staleness=1) as stream:
            async for batch in stream:
                assert len(batch.groups) == 8 or batch.final
                assert all(len(g) == 2 for g in batch.groups)
                seen.extend(batch.sample_indices)
                for t in batch.trajectories:
                    _check_complete([t], prompts)
                    # the staleness bound: no token from weights more than 1 version older than now
                    assert all(batch.weight_version - v <= 1 for v, _ in t.weight_versions)
                resumed += batch.metrics["resumed_segments"]
                assert set(batch.metrics["staleness_histogram"]) <= {0, 1}
                await client.set_weight_version(client.weight_version + 1)  # "train", then new weights
    assert sorted(seen) == list(range(60))  # none lost, none duplicated
    if mode == "partial":
        assert resumed > 0  # some trajectories were cut at a batch and resumed on the next weights


async def test_partial_mode_resumed_trajectories_span_versions(fake_servers) -> None:
    servers = await fake_servers(1, FakeEngineConfig(step_base_s=0.003, max_batch=64))
    prompts = lognormal_prompts(24, seed=3, median=20, sigma=1.2, cap=300)
    spanning = 0
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.rollouts(prompts, batch_groups=4, mode="partial", over_provision=3.0) as stream:
            async for batch in stream:
                for t in batch.trajectories:
                    _check_complete([t], prompts)
                    spanning += len(t.weight_versions) > 1
                await client.set_weight_version(client.weight_version + 1)
    assert spanning > 0


async def test_staleness_zero_requeues_instead_of_mixing_versions(fake_servers) -> None:
    servers = await fake_servers(1, FakeEngineConfig(step_base_s=0.003, max_batch=64))
    prompts = lognormal_prompts(30, seed=5, median=20, sigma=1.2, cap=300)
    seen, requeued = [], 0
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.rollouts(prompts, batch_groups=5, mode="async", max_staleness=0) as stream:
            async for batch in stream:
                seen.extend(batch.sample_indices)
                for t in batch.trajectories:
                    assert [v for v, _ in t.weight_versions] == [batch.weight_version]
                requeued = batch.metrics["requeued_stale"]
                await client.set_weight_version(client.weight_version + 1)
    assert sorted(seen) == list(range(30))
    assert requeued > 0


async def test_filter_drops_groups_and_the_producer_refills(fake_servers) -> None:
    servers = await fake_servers(2, STEP)
    prompts = lognormal_prompts(48, seed=2)

    def keep(group) -> bool:  # e.g. drop groups whose rewards all agree; here: a third of the samples
        return group[0].sample_index % 3 != 0

    yielded: list[int] = []
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.rollouts(prompts, group_size=2, batch_groups=6, filter=keep) as stream:
            batches = [b async for b in stream]
    for b in batches:
        yielded.extend(b.sample_indices)
    assert all(len(b.groups) == 6 for b in batches[:-1])  # full batches despite the drops
    assert sorted(yielded) == [i for i in range(48) if i % 3 != 0]
    assert batches[-1].metrics["filtered"] == 16


async def test_rewards_and_metrics(fake_servers) -> None:
    servers = await fake_servers(2, STEP)
    prompts = lognormal_prompts(16, seed=4)

    async def reward(traj, sample) -> float:
        return float(len(traj.response_ids))

    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.rollouts(prompts, group_size=2, batch_groups=4, reward=reward) as stream:
            batch = await stream.__anext__()
    assert all(t.reward == float(len(t.response_ids)) for t in batch.trajectories)
    m = batch.metrics
    for key in ("wall_s", "model_tokens", "busy_fraction", "staleness_histogram", "groups_in_flight_at_yield"):
        assert key in m
    assert m["model_tokens"] == sum(len(t.response_ids) for t in batch.trajectories)
    assert all(0.0 <= f <= 1.0 for f in m["busy_fraction"].values())
