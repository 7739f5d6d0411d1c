"""GPU tier: the SGLang backend behind a real server (one engine start for the module).  Needs a GPU
and sglang; skipped elsewhere.  Run on the device machine: `pytest tests/gpu -m gpu` (bench/device_run.sh)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from rollout_sdk import EngineServer, InvalidRequestError, RolloutClient, SamplingParams, ServerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sglang_client(qwen_05b_dir: str, sglang_config: Callable[..., Any]) -> AsyncIterator[RolloutClient]:
    from rollout_sdk.engines.sglang import SglangEngine

    async with (
        EngineServer(SglangEngine(sglang_config(qwen_05b_dir)), ServerConfig()) as server,
        RolloutClient(servers=[server.address]) as client,
    ):
        yield client


async def test_generate_token_in_token_out(sglang_client: RolloutClient) -> None:
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    results = await asyncio.gather(*(sglang_client.generate([1000 + i, 2000, 3000], sampling=sp) for i in range(64)))
    assert all(len(r.output_ids) == 16 and r.finish_reason == "length" for r in results)
    assert all(r.logprobs is not None and len(r.logprobs) == 16 and max(r.logprobs) <= 0.0 for r in results)


async def test_greedy_is_deterministic_and_stop_tokens_stop(sglang_client: RolloutClient) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    a = await sglang_client.generate([11, 22, 33], sampling=sp)
    b = await sglang_client.generate([11, 22, 33], sampling=sp)
    assert a.output_ids == b.output_ids
    stop = a.output_ids[4]
    c = await sglang_client.generate(
        [11, 22, 33], sampling=SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop])
    )
    k = a.output_ids.index(stop)
    assert (c.finish_reason, c.matched_stop, c.output_ids) == ("stop", stop, a.output_ids[: k + 1])


async def test_cancel_reaches_the_engine(sglang_client: RolloutClient) -> None:
    tasks = [
        asyncio.create_task(
            sglang_client.generate([5, 6, 7], sampling=SamplingParams(max_new_tokens=20000, ignore_eos=True))
        )
        for _ in range(8)
    ]
    await asyncio.sleep(1.0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(200):
        if (await sglang_client.servers[0].fetch_stats()).in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert (await sglang_client.servers[0].fetch_stats()).in_flight == 0


async def test_bad_request_is_a_typed_error(sglang_client: RolloutClient) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await sglang_client.generate([1, 10_000_000])
    assert info.value.field == "input_ids[1]"
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        await sglang_client.generate([1, 2], sampling=SamplingParams(max_new_tokens=4, min_new_tokens=2))
