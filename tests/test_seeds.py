"""One seed scheme for every API: distinct per group member, turn and resumed segment; the same sample
whichever API produced it; reproducible from the request's seed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_sdk import GenerateAgent, GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.agents import rollout_group
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.rollouts.seeds import sample_seed

REQ = GenerateRequest(input_ids=[5, 6, 7], sampling=SamplingParams(seed=7, max_new_tokens=6))


def record_seeds(client: RolloutClient) -> list[int | None]:
    """Wrap the client's generate to record the seed of every request it sends."""
    seen: list[int | None] = []
    inner = client.generate

    async def generate(request, /, **kw):
        seen.append(request.sampling.seed)
        return await inner(request, **kw)

    client.generate = generate  # type: ignore[method-assign]
    return seen


def test_seed_function_properties() -> None:
    assert sample_seed(None, member=3) is None
    assert sample_seed(7) == 7  # member 0, turn 0, first segment: the request's own seed
    seeds = {sample_seed(7, member=m, turn=t, segment=s) for m in range(8) for t in range(8) for s in range(4)}
    assert len(seeds) == 8 * 8 * 4  # all distinct
    assert all(0 <= s <= 2**63 - 1 for s in seeds)
    # composable, in the order member -> turn -> segment (a continuation re-derives its request's seed)
    assert sample_seed(sample_seed(7, member=2, turn=1), segment=3) == sample_seed(7, member=2, turn=1, segment=3)
    # no additive collisions: seed 7 member 1 is not seed 8 member 0
    assert sample_seed(7, member=1) != 8
    with pytest.raises(ValueError, match="member"):
        sample_seed(7, member=-1)


@pytest.mark.parametrize("mode", ["sync", "async", "partial"])
async def test_every_api_sends_the_same_distinct_member_seeds(fake_servers, mode) -> None:
    servers = await fake_servers(1, FakeEngineConfig())
    want = [sample_seed(7, member=k) for k in range(4)]
    assert len(set(want)) == 4
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        seen = record_seeds(client)
        [group] = await client.generate_many([REQ], group_size=4).collect()
        assert sorted(seen) == sorted(want), "generate_many"
        seen.clear()
        async with client.rollouts([REQ], group_size=4, batch_groups=1, mode=mode) as stream:
            [batch] = [b async for b in stream]
        assert sorted(seen) == sorted(want), f"rollouts(mode={mode})"
        seen.clear()
        await rollout_group(client, GenerateAgent(), REQ, group_size=4)
        assert sorted(seen) == sorted(want), "rollout_group"
        seen.clear()
        again = await client.generate_many([REQ], group_size=4).collect()  # reproducible
        assert sorted(seen) == sorted(want)
    assert len(batch.groups[0]) == 4
    assert len(group.results) == len(again[0].results) == 4


async def test_agent_turns_and_resumed_segments_follow_the_scheme(fake_servers) -> None:
    """Partial mode cuts every trajectory at each batch: the resumed segments get their own seeds."""
    servers = await fake_servers(1, FakeEngineConfig(step_base_s=0.003, max_batch=64))
    prompts = [
        GenerateRequest(input_ids=[9, i], sampling=SamplingParams(seed=100 + i, max_new_tokens=40 + 30 * i))
        for i in range(6)
    ]
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        seen = record_seeds(client)
        async with client.rollouts(prompts, group_size=2, batch_groups=1, mode="partial", over_provision=6.0) as stream:
            async for _ in stream:
                await client.set_weight_version(client.weight_version + 1)
    allowed = {
        sample_seed(100 + i, member=k, segment=s): (i, k, s) for i in range(6) for k in range(2) for s in range(64)
    }
    assert set(seen) <= set(allowed), "every seed is sample_seed(seed, member=k, segment=s)"
    coords = [allowed[s] for s in seen]
    assert len(coords) == len(set(coords)), "no seed (member, segment) is sent twice"
    assert any(s > 0 for _, _, s in coords), "some trajectory was resumed"


async def test_the_same_sample_from_generate_many_rollouts_and_rollout_group(tiny_model: Path) -> None:
    """On an engine that honours seeds, member k is the same sample through every API, and members differ."""
    from rollout_sdk import CpuEngineConfig

    req = GenerateRequest(input_ids=[151644, 872, 198, 40, 1079], sampling=SamplingParams(seed=11, max_new_tokens=8))
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tiny_model))) as client:
        [g] = await client.generate_many([req], group_size=3).collect()
        async with client.rollouts([req], group_size=3, batch_groups=1) as stream:
            [batch] = [b async for b in stream]
        group = await rollout_group(client, GenerateAgent(), req, group_size=3)
    many = [r.output_ids for r in g.results]
    assert len({tuple(x) for x in many}) == 3, "members are different samples"
    assert [t.response_ids for t in batch.groups[0]] == many
    assert [t.response_ids for t in group] == many
