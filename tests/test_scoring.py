"""client.score: prompt logprobs without generating (CPU engine, parity with a transformers forward), and
requests for what an engine cannot do (scoring on the fake engine, MoE routing on CPU) refused cleanly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rollout_sdk import (
    CpuEngineConfig,
    GenerateRequest,
    InvalidRequestError,
    RolloutClient,
    SamplingParams,
    UnsupportedOperationError,
)


@pytest.mark.slow
async def test_score_matches_a_transformers_forward(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(151_000) for _ in range(n)] for n in (2, 7, 33, 70)]
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tiny_model))) as client:
        scored = [await client.score(p) for p in prompts]
        assert await client.score([5]) == []  # nothing to predict
        full = await client.generate(GenerateRequest(input_ids=prompts[1], score_only=True))
        assert full.output_ids == [] and full.prompt_tokens == 7 and full.weight_version == 0
        assert full.lifecycle is not None and full.prompt_logprobs == scored[1]
        # a generation and a score at once: the score is not disturbed by the batch
        gen = client.generate(prompts[3], sampling=SamplingParams(max_new_tokens=16, seed=3))
        import asyncio

        _, again = await asyncio.gather(gen, client.score(prompts[3]))
        assert again == scored[3]
        with pytest.raises(InvalidRequestError, match="context"):
            await client.score([1] * 5000)
    for p, got in zip(prompts, scored, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(ref_model(torch.tensor([p])).logits.float()[0], dim=-1)
        want = lp[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        assert len(got) == len(p) - 1
        assert torch.allclose(torch.tensor(got), want, atol=1e-4, rtol=0), (torch.tensor(got) - want).abs().max()


async def test_unsupported_requests_are_refused_and_the_server_keeps_serving(fake_servers) -> None:
    (server,) = await fake_servers(1)
    async with RolloutClient([server.address]) as client:
        with pytest.raises(UnsupportedOperationError, match="score_only"):
            await client.score([1, 2, 3])
        with pytest.raises(UnsupportedOperationError, match="return_routed_experts"):
            await client.generate(GenerateRequest(input_ids=[1, 2], return_routed_experts=True))
        r = await client.generate([1, 2], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(r.output_ids) == 3


@pytest.mark.slow
async def test_cpu_engine_refuses_routing_replay(tiny_model: Path) -> None:
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tiny_model))) as client:
        with pytest.raises(UnsupportedOperationError, match="MoE routing"):
            await client.generate(GenerateRequest(input_ids=[1, 2], return_routed_experts=True))
        r = await client.generate([1, 2], sampling=SamplingParams(max_new_tokens=2))
        assert r.output_ids
