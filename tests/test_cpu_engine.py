"""The CPU engine (the embedded default) on the real tiny model: batching, sampling, logprobs, hooks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.errors import EngineBusyError, WeightUpdateError
from rollout_sdk.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

DIVERSE = {"presence_penalty": 2.0}  # greedy on a random model repeats one token; this spreads it


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(100, 150000) for _ in range(rnd.randrange(3, 30))] for _ in range(n)]


def _req(ids: list[int], rid: str, **sampling: object) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, rid=rid, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


async def running_with_tokens(engine: CpuEngine, p: list[int], probe: str) -> None:
    """Until the request just submitted runs and has tokens: a condition, not a sleep.  A 1-token request
    admitted after it finishes only after a step that also decoded it; a pause called then lands within
    the step in flight, a token or two later."""
    while not engine.load().running:
        await asyncio.sleep(0.005)
    await engine.generate(_req(p, probe, max_new_tokens=1))


async def parked(engine: CpuEngine, task: asyncio.Task[object]) -> None:
    """Until the engine holds the request and its step loop waits at the closed gate: from then on nothing
    can move until the gate opens, so a request still pending then is held, not merely slow."""
    while not (engine._gate.num_waiting >= 1 and (engine.load().running or engine.load().queued)):
        assert not task.done(), "the request finished while the gate was meant to hold it"
        await asyncio.sleep(0.005)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[CpuEngine]:
    e = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_running=64))
    await e.start()
    yield e
    await e.close()


async def test_batched_equals_alone(engine: CpuEngine) -> None:
    """Rows in a batch (left-padded, joining mid-flight) decode exactly as they would alone."""
    prompts = _prompts(6)
    alone = [
        (await engine.generate(_req(p, f"a{i}", temperature=0, max_new_tokens=12, **DIVERSE))).output_ids
        for i, p in enumerate(prompts)
    ]

    async def staggered(i: int, p: list[int]) -> list[int]:
        await asyncio.sleep(0.004 * i)
        r = await engine.generate(_req(p, f"b{i}", temperature=0, max_new_tokens=12, **DIVERSE))
        return r.output_ids

    together = await asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompts)))
    assert together == alone
    assert len({tuple(x) for x in alone}) == len(alone)


async def test_seeded_request_reproduces_whatever_shares_its_batch(engine: CpuEngine) -> None:
    p = _prompts(1, seed=5)[0]
    first = await engine.generate(_req(p, "s1", seed=42, max_new_tokens=20))
    noise = [engine.generate(_req(q, f"n{i}", max_new_tokens=30)) for i, q in enumerate(_prompts(7, seed=9))]
    second, *_ = await asyncio.gather(engine.generate(_req(p, "s2", seed=42, max_new_tokens=20)), *noise)
    other = await engine.generate(_req(p, "s3", seed=43, max_new_tokens=20))
    assert second.output_ids == first.output_ids
    assert second.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    assert other.output_ids != first.output_ids


async def test_logprobs_are_the_models_log_probabilities(engine: CpuEngine) -> None:
    """Each returned logprob equals log softmax(logits / T) of a plain full forward over prompt + output."""
    p = _prompts(1, seed=11)[0]
    for temp in (1.0, 0.7):
        r = await engine.generate(_req(p, f"lp{temp}", seed=3, temperature=temp, max_new_tokens=10))
        ids = torch.tensor([p + r.output_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        ref = torch.log_softmax(logits / temp, dim=-1)
        expect = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(r.output_ids)]
        assert r.logprobs == pytest.approx(expect, abs=2e-4)


async def test_abort_returns_partial_tokens_and_frees_the_slot(engine: CpuEngine) -> None:
    p = _prompts(1, seed=2)[0]
    task = asyncio.create_task(engine.generate(_req(p, "ab", max_new_tokens=2000, ignore_eos=True)))
    await running_with_tokens(engine, p, "ab-probe")
    engine.abort("ab")
    r = await asyncio.wait_for(task, 5)
    assert r.finish_reason == "abort"
    assert 0 < len(r.output_ids) < 2000
    assert r.logprobs is not None
    assert len(r.logprobs) == len(r.output_ids)
    assert "ab" not in engine.running_rids()
    engine.abort("unknown-rid")  # ignored


async def test_stop_tokens_and_min_new_tokens(engine: CpuEngine) -> None:
    p = _prompts(1, seed=4)[0]
    base = (await engine.generate(_req(p, "st0", temperature=0, max_new_tokens=10, **DIVERSE))).output_ids
    stop = base[3]
    r = await engine.generate(_req(p, "st1", temperature=0, max_new_tokens=10, stop_token_ids=[stop], **DIVERSE))
    assert r.finish_reason == "stop"
    assert r.matched_stop == stop
    assert r.output_ids == base[:4]
    # the first token is a stop token, but min_new_tokens forbids stopping there
    r = await engine.generate(
        _req(p, "st2", temperature=0, max_new_tokens=10, stop_token_ids=[base[0]], min_new_tokens=2, **DIVERSE)
    )
    assert r.output_ids[0] != base[0]
    assert len(r.output_ids) >= 2


async def test_length_and_context_limits(engine: CpuEngine) -> None:
    p = _prompts(1, seed=6)[0]
    r = await engine.generate(_req(p, "len", max_new_tokens=7, ignore_eos=True))
    assert (r.finish_reason, len(r.output_ids), r.prompt_tokens) == ("length", 7, len(p))
    ctx = engine.limits.max_context
    long = [5] * (ctx - 3)
    r = await engine.generate(_req(long, "ctx", max_new_tokens=50, ignore_eos=True))
    assert r.finish_reason == "length"
    assert len(r.output_ids) == 3


async def test_penalties_change_greedy_output(engine: CpuEngine) -> None:
    p = _prompts(1, seed=8)[0]
    plain = (await engine.generate(_req(p, "p0", temperature=0, max_new_tokens=20))).output_ids
    assert len(set(plain)) < len(plain)  # the random model repeats itself when greedy
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
        out = (await engine.generate(_req(p, "p1", temperature=0, max_new_tokens=20, **kw))).output_ids
        assert len(set(out)) > len(set(plain)), kw


async def test_pause_modes(engine: CpuEngine) -> None:
    p = _prompts(1, seed=12)[0]
    # the pause lands a few tokens in (running_with_tokens), by step counts: 32 tokens leave most after it
    sp = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True, **DIVERSE}
    want = (await engine.generate(_req(p, "pm0", **sp))).output_ids
    for mode in ("in_place", "retract"):
        task = asyncio.create_task(engine.generate(_req(p, f"pm-{mode}", **sp)))
        await running_with_tokens(engine, p, f"pm-{mode}-probe")
        await engine.pause(mode)  # type: ignore[arg-type]
        assert engine.paused
        await parked(engine, task)
        assert not task.done()
        await engine.resume()
        r = await asyncio.wait_for(task, 20)
        assert r.output_ids == want, mode
    task = asyncio.create_task(engine.generate(_req(p, "pm-abort", max_new_tokens=4000, ignore_eos=True)))
    await running_with_tokens(engine, p, "pm-probe")
    await engine.pause("abort")
    r = await asyncio.wait_for(task, 5)
    assert r.finish_reason == "abort"
    assert r.output_ids
    await engine.resume()


async def test_weight_update_changes_outputs_like_a_reference_model(engine: CpuEngine, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    p = _prompts(1, seed=13)[0]
    sp = {"temperature": 0, "max_new_tokens": 12, **DIVERSE}
    before = await engine.generate(_req(p, "w0", **sp))
    named = [(n, t.clone()) for n, t in engine.model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    perturbed = [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in named]

    with pytest.raises(WeightUpdateError, match=r"unknown parameter 'no\.such\.weight'"):
        await engine.update_weights([*perturbed[:3], ("no.such.weight", torch.zeros(2))], version=99)
    with pytest.raises(WeightUpdateError, match="shape"):
        await engine.update_weights([(perturbed[0][0], torch.zeros(3, 3))], version=99)
    same = await engine.generate(_req(p, "w1", **sp))
    assert same.output_ids == before.output_ids  # refused updates left the old weights serving
    assert engine.weight_version != 99

    await engine.update_weights(perturbed, version=7)
    after = await engine.generate(_req(p, "w2", **sp))
    assert after.output_ids != before.output_ids
    assert after.weight_version == 7
    assert after.version_segments == [(7, len(after.output_ids))]

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ref.load_state_dict(dict(perturbed), strict=False)
    ref_after = await engine.generate(_req(p, "w3", temperature=0, max_new_tokens=12))
    ids = torch.tensor([p])
    with torch.no_grad():
        for _ in range(12):
            nxt = ref(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert ref_after.output_ids == ids[0, len(p) :].tolist()
    await engine.update_weights(named, version=8)  # restore for the other tests


async def test_release_and_resume_memory(engine: CpuEngine) -> None:
    p = _prompts(1, seed=14)[0]
    want = (await engine.generate(_req(p, "m0", temperature=0, max_new_tokens=8, **DIVERSE))).output_ids
    task = asyncio.create_task(engine.generate(_req(p, "m1", max_new_tokens=3000, ignore_eos=True)))
    while not engine.load().running:  # it runs: releasing the memory now would lose it
        await asyncio.sleep(0.005)
    with pytest.raises(EngineBusyError):
        await engine.release_memory()
    engine.abort("m1")
    await task
    await engine.release_memory(["weights", "kv_cache"])
    assert all(t.numel() == 0 for t in engine.model.parameters())
    queued = asyncio.create_task(engine.generate(_req(p, "m2", temperature=0, max_new_tokens=8, **DIVERSE)))
    await parked(engine, queued)
    assert not queued.done()  # held while the weights are released
    await engine.resume_memory()
    assert (await asyncio.wait_for(queued, 10)).output_ids == want


async def test_release_with_requests_held_and_continue_after_wake(engine: CpuEngine) -> None:
    """The colocated step: hold in-flight requests, free the memory for training, wake, continue them."""
    p = _prompts(1, seed=15)[0]
    sp = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True, **DIVERSE}
    want = (await engine.generate(_req(p, "h0", **sp))).output_ids
    task = asyncio.create_task(engine.generate(_req(p, "h1", **sp)))
    await running_with_tokens(engine, p, "h-probe")  # it has tokens, and most of its 32 to come
    assert not task.done()
    await engine.pause("in_place")
    with pytest.raises(EngineBusyError, match="held in place"):
        await engine.release_memory()  # their KV would be lost
    await engine.pause("retract")
    await engine.release_memory()
    assert all(t.numel() == 0 for t in engine.model.parameters())
    await engine.resume()
    await parked(engine, task)
    assert not task.done()  # still held: the weights are gone
    await engine.resume_memory()
    assert (await asyncio.wait_for(task, 10)).output_ids == want


async def test_probation_requests_report_their_first_step_before_they_end(engine: CpuEngine) -> None:
    """The step hook the server paces probation with (engines/base.py, server.py "Probation"): the CPU engine
    reports a probation request once, when the step that admitted it ends, before its result; never an
    ordinary request."""
    stepped: list[tuple[str, bool]] = []  # (rid, was its result already set)
    futures: dict[str, asyncio.Future[object]] = {}

    def listener(rids: list[str]) -> bool:
        stepped.extend((rid, futures[rid].done()) for rid in rids)
        return False

    engine.step_listener = listener
    try:
        sp = SamplingParams(max_new_tokens=3, temperature=0.0)
        reqs = [GenerateRequest(input_ids=[1, 2, 3], sampling=sp, rid=f"p{i}", probation=i % 2 == 0) for i in range(4)]
        for r in reqs:
            futures[r.rid] = asyncio.ensure_future(engine.generate(r))
        results = await asyncio.gather(*futures.values())
    finally:
        engine.step_listener = None
    assert all(len(r.output_ids) == 3 for r in results)  # type: ignore[attr-defined]
    assert sorted(stepped) == [("p0", False), ("p2", False)]


async def test_prefill_progress_counts_the_prompt_tokens_prefilled(engine: CpuEngine) -> None:
    """The stall detector's prefill counter (server/stall.py) grows by the tokens a step prefills, and
    progress() by the tokens it decodes: a one-token request with a 300-token prompt is 300 and 1."""
    rnd = random.Random(37)
    prompt = [rnd.randrange(100, 150000) for _ in range(300)]
    decoded, prefilled = engine.progress(), engine.prefill_progress()
    await engine.generate(_req(prompt, "progress-prefill", max_new_tokens=1))
    assert engine.prefill_progress() - prefilled == len(prompt)
    assert engine.progress() - decoded == 1
