"""A request's failure is not the engine's failure (#15 item 2, engine side).

An exception while processing one request fails that request with RequestFailedError; the requests
sharing its batch finish as if nothing happened; the engine is marked dead only when it is broken itself
(a one-token canary forward fails too).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rollout_sdk import RolloutClient
from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig, model_runner
from rollout_sdk.errors import EngineDeadError, RequestFailedError
from rollout_sdk.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[151644, 872, 198, 1000 + 37 * i, 2000 + i] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, presence_penalty=2.0, ignore_eos=True)


def _req(ids: list[int], rid: str, sp: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, rid=rid, sampling=sp)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[CpuEngine]:
    e = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_running=16))
    await e.start()
    yield e
    await e.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def alone(engine: CpuEngine) -> list[list[int]]:
    """Each prompt's greedy output run on its own: what it must be whatever fails beside it."""
    return [(await engine.generate(_req(p, f"alone{i}"))).output_ids for i, p in enumerate(PROMPTS)]


async def test_a_request_that_breaks_the_model_fails_alone(engine: CpuEngine, alone: list[list[int]]) -> None:
    """A token id outside the embedding (the server refuses it; a direct engine user may not) used to raise
    inside the batched prefill and kill the engine for every request."""
    vocab = engine.limits.vocab_size
    good = [asyncio.ensure_future(engine.generate(_req(p, f"g{i}"))) for i, p in enumerate(PROMPTS)]
    bad = asyncio.ensure_future(engine.generate(_req([5, vocab + 1000], "bad")))
    with pytest.raises(RequestFailedError, match="index"):
        await bad
    assert [r.output_ids for r in await asyncio.gather(*good)] == alone
    assert engine.dead is None
    assert (await engine.generate(_req(PROMPTS[0], "after"))).output_ids == alone[0]


async def test_a_request_whose_sampling_raises_fails_alone(
    engine: CpuEngine, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = model_runner._apply_penalties

    def flaky(row: Any, s: Any, vocab: int) -> None:
        if s.sampling.repetition_penalty == 1.2345:
            raise RuntimeError("penalty kernel exploded")
        real(row, s, vocab)

    monkeypatch.setattr(model_runner, "_apply_penalties", flaky)
    good = [asyncio.ensure_future(engine.generate(_req(p, f"s{i}"))) for i, p in enumerate(PROMPTS)]
    poison = SamplingParams(repetition_penalty=1.2345, max_new_tokens=8)
    bad = asyncio.ensure_future(engine.generate(_req(PROMPTS[1], "spoison", poison)))
    with pytest.raises(RequestFailedError, match="exploded"):
        await bad
    assert [r.output_ids for r in await asyncio.gather(*good)] == alone
    assert engine.dead is None


async def test_a_failed_batched_decode_recovers_every_row(
    engine: CpuEngine, alone: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode that raises once (the batch's KV cache possibly half extended): every row re-prefills from
    its tokens so far and finishes exactly as it would have."""
    runner = engine._runner
    real = runner._forward_last
    failures = []

    def once(ids: Any, mask: Any, pos: Any, cache: Any) -> Any:
        if ids.shape[0] == len(PROMPTS) and ids.shape[1] == 1 and not failures:
            failures.append(1)
            raise RuntimeError("transient decode failure")
        return real(ids, mask, pos, cache)

    monkeypatch.setattr(runner, "_forward_last", once)
    results = await asyncio.gather(*(engine.generate(_req(p, f"d{i}")) for i, p in enumerate(PROMPTS)))
    assert failures == [1]
    assert [r.output_ids for r in results] == alone
    assert engine.dead is None


async def test_a_broken_engine_is_dead(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_running=4))
    await e.start()
    try:

        def broken(*_: Any) -> Any:
            raise RuntimeError("weights are garbage")

        monkeypatch.setattr(e._runner, "_forward_last", broken)
        with pytest.raises(EngineDeadError, match="garbage"):
            await asyncio.gather(*(e.generate(_req(p, f"b{i}")) for i, p in enumerate(PROMPTS)))
        assert isinstance(e.dead, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await e.generate(_req(PROMPTS[0], "later"))
    finally:
        await e.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_server_answers_an_engine_exception_with_a_typed_error_and_keeps_serving(fake_servers) -> None:
    def responder(req: GenerateRequest) -> list[int]:
        if req.input_ids[0] == 13:
            raise ValueError("this prompt breaks the backend")
        return [1, 2, 3]

    (server,) = await fake_servers(1, responder=responder)
    async with RolloutClient(servers=[server.address]) as client:
        with pytest.raises(RequestFailedError, match="breaks the backend"):
            await client.generate(GenerateRequest(input_ids=[13, 1]))
        ok = await asyncio.gather(*(client.generate(GenerateRequest(input_ids=[7, i])) for i in range(5)))
        assert all(r.output_ids == [1, 2, 3] for r in ok)
        assert client.stats().servers[0].alive
    assert server.engine.dead is None


async def test_the_fake_engines_request_cost_is_cpu_on_the_calling_thread() -> None:
    """``request_cost_s`` (bench/request_path.py's stand-in for an engine front end's Python) holds the
    loop's thread for at least that much CPU time per request; the limits the server reads per request
    are made once per config."""
    import dataclasses
    import time

    from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig

    engine = FakeEngine(FakeEngineConfig(request_cost_s=0.02))
    await engine.start()
    t0 = time.thread_time()
    r = await engine.generate(GenerateRequest(input_ids=[5], sampling=SamplingParams(max_new_tokens=2), rid="a"))
    assert time.thread_time() - t0 >= 0.02
    assert r.output_ids == [6, 7]
    assert engine.limits is engine.limits
    engine.config = dataclasses.replace(engine.config, vocab_size=64)
    assert engine.limits.vocab_size == 64
    await engine.close()
