"""Weight updates with requests in flight (issue 41): ``inflight="keep"`` goes on with the KV it has,
``"reprefill"`` recomputes it; both say exactly which weights sampled which token and from which KV; a
request names the weights it needs (``min_weight_version``).

The CPU engine runs the real tiny model: a request is held at a known token (``pause("in_place")`` keeps its
KV), the weights change, and what it decodes next is checked against a transformers reference of each
mode: the old model's KV with the new weights (keep), or the new model over the whole sequence (reprefill).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from rollout_sdk import RolloutClient
from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.errors import InvalidRequestError, WeightVersionError
from rollout_sdk.protocol import (
    MAX_WEIGHT_VERSION,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    UpdateWeightsDistributed,
    decode_client_message,
    encode,
)
from rollout_sdk.server import EngineServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [1201, 77, 9051, 310, 4402, 18, 2222, 615]
N_NEW = 14


async def until(cond: Any, timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[CpuEngine]:
    e = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_running=8))
    await e.start()
    yield e
    await e.close()


def _perturbed(model: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t.detach() + 0.08 * torch.randn(t.shape, generator=g)) for n, t in model.named_parameters()]


async def _held_update(engine: CpuEngine, named: list[Any], version: int, inflight: Any) -> tuple[GenerateResult, int]:
    """A greedy request held (in place, its KV kept) once it has some tokens; the weights change; it goes on.
    Returns its result and how many tokens it had when the weights changed."""
    req = GenerateRequest(
        rid=f"held-{inflight}-{version}",
        input_ids=PROMPT,
        sampling=SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True),
    )
    task = asyncio.create_task(engine.generate(req))
    seq = None
    await until(lambda: (s := engine._scheduler.seqs.get(req.rid)) is not None and len(s.out) >= 3)
    await engine.pause("in_place")
    seq = engine._scheduler.seqs[req.rid]
    split = len(seq.out)
    assert 3 <= split < N_NEW
    await engine.update_weights(named, version=version, inflight=inflight)
    await engine.resume()
    return await task, split


def _keep_reference(tiny_model: Path, old: Any, new: Any, head: list[int], n: int) -> list[int]:
    """The old model's KV for ``PROMPT + head[:-1]``; then the new weights decode from it, greedily."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ref.load_state_dict(dict(old), strict=False)
    kw = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([PROMPT + head[:-1]]), use_cache=True)
        past = out.past_key_values
        ref.load_state_dict(dict(new), strict=False)
        tok, got = head[-1], []
        for _ in range(n):
            o = ref(input_ids=torch.tensor([[tok]]), use_cache=True, **{kw: past})
            past = o.past_key_values
            tok = int(o.logits[0, -1].argmax())
            got.append(tok)
    return got


def _reprefill_reference(tiny_model: Path, new: Any, head: list[int], n: int) -> list[int]:
    """The new model over the whole sequence so far, greedily."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    ref.load_state_dict(dict(new), strict=False)
    ids = torch.tensor([PROMPT + head])
    with torch.no_grad():
        for _ in range(n):
            nxt = ref(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(PROMPT) + len(head) :].tolist()


async def test_keep_decodes_on_the_old_kv_with_the_new_weights(engine: CpuEngine, tiny_model: Path) -> None:
    old = [(n, t.detach().clone()) for n, t in engine.model.named_parameters()]
    new = _perturbed(engine.model, 1)
    v0 = engine.weight_version
    try:
        out, split = await _held_update(engine, new, v0 + 1, "keep")
    finally:
        await engine.update_weights(old, version=v0 + 2, inflight="keep")  # the old weights, for the others
    head, tail = out.output_ids[:split], out.output_ids[split:]
    assert len(out.output_ids) == N_NEW
    assert out.version_segments == [(v0, split), (v0 + 1, N_NEW - split)]
    # every token was sampled from KV whose oldest part is v0's: the tail by v0 + 1's weights
    assert out.kv_version_segments == [(v0, N_NEW)]
    assert out.kv_weight_version == v0
    assert out.mixed_kv_tokens == N_NEW - split
    assert tail == _keep_reference(tiny_model, old, new, head, N_NEW - split)
    # and not what a re-prefill gives (the test tells the two modes apart)
    assert tail != _reprefill_reference(tiny_model, new, head, N_NEW - split)


async def test_reprefill_recomputes_the_kv_on_the_new_weights(engine: CpuEngine, tiny_model: Path) -> None:
    old = [(n, t.detach().clone()) for n, t in engine.model.named_parameters()]
    new = _perturbed(engine.model, 1)
    v0 = engine.weight_version
    try:
        out, split = await _held_update(engine, new, v0 + 1, "reprefill")
    finally:
        await engine.update_weights(old, version=v0 + 2)
    head, tail = out.output_ids[:split], out.output_ids[split:]
    assert out.version_segments == [(v0, split), (v0 + 1, N_NEW - split)]
    assert out.kv_version_segments == []  # every token from KV of the weights that sampled it
    assert out.mixed_kv_tokens == 0
    assert tail == _reprefill_reference(tiny_model, new, head, N_NEW - split)


async def test_reprefill_between_steps_loses_no_row(engine: CpuEngine) -> None:
    """An update while rows decode (no pause): the re-prefilled rows are queued again before the step
    loop runs, so every request ends with all its tokens and exact segments."""
    named = [(n, t.detach().clone()) for n, t in engine.model.named_parameters()]
    v0 = engine.weight_version
    reqs = [
        GenerateRequest(rid=f"r{i}", input_ids=PROMPT[i:], sampling=SamplingParams(max_new_tokens=40, ignore_eos=True))
        for i in range(4)
    ]
    tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
    await until(
        lambda: all(len(s.out) >= 2 for s in engine._scheduler.seqs.values()) and len(engine._scheduler.seqs) == 4
    )
    await engine.update_weights(named, version=v0 + 1)
    outs = await asyncio.gather(*tasks)
    for o in outs:
        assert len(o.output_ids) == 40
        assert [v for v, _ in o.version_segments] == [v0, v0 + 1]
        assert sum(n for _, n in o.version_segments) == 40
        assert o.kv_version_segments == []


async def test_inflight_and_min_weight_version_are_checked_at_construction() -> None:
    with pytest.raises(InvalidRequestError, match="inflight"):
        UpdateWeightsDistributed(call_id="c", group_name="g", buckets=[], inflight="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="flush_cache"):
        UpdateWeightsDistributed(call_id="c", group_name="g", buckets=[], inflight="keep", flush_cache=True)
    msg = UpdateWeightsDistributed(call_id="c", group_name="g", buckets=[], inflight="keep", flush_cache=False)
    assert decode_client_message(encode(msg)) == msg
    # flush_cache left out follows the mode: a `keep` message built without it is valid and does not flush
    # (the GPU test built one that way and was refused while the default was True for both modes)
    kept = UpdateWeightsDistributed(call_id="c", group_name="g", buckets=[], inflight="keep")
    assert not kept.flushes and decode_client_message(encode(kept)) == kept
    assert UpdateWeightsDistributed(call_id="c", group_name="g", buckets=[]).flushes
    assert not UpdateWeightsDistributed(call_id="c", group_name="g", buckets=[], flush_cache=False).flushes
    for bad in (-1, MAX_WEIGHT_VERSION + 1, 1.5, "3", True):
        with pytest.raises(InvalidRequestError, match="min_weight_version"):
            GenerateRequest(input_ids=[1], min_weight_version=bad)  # type: ignore[arg-type]


async def test_min_weight_version_is_honoured_by_admission_and_by_the_server() -> None:
    old, new = FakeEngine(FakeEngineConfig()), FakeEngine(FakeEngineConfig())
    await new.set_weight_version(3)
    async with EngineServer(old) as s_old, EngineServer(new) as s_new:
        async with RolloutClient(servers=[s_old.address, s_new.address]) as client:
            await until(lambda: sorted(c.reported_version for c in client.servers) == [0, 3])
            outs = await asyncio.gather(
                *(client.generate(GenerateRequest(input_ids=[5, 6, i + 7], min_weight_version=2)) for i in range(8))
            )
            assert {o.weight_version for o in outs} == {3}
            assert len(new.requests_seen) == 8 and not old.requests_seen
            with pytest.raises(WeightVersionError, match=r"min_weight_version=4.*versions \[0, 3\]") as info:
                await client.generate(GenerateRequest(input_ids=[5, 6, 7], min_weight_version=4))
            assert info.value.field == "min_weight_version" and info.value.value == 4
            # a client whose view is stale: the server refuses it with the same typed error
            for c in client.servers:
                c.reported_version = 9
            with pytest.raises(WeightVersionError, match="holds weight version"):
                await client.generate(GenerateRequest(input_ids=[5, 6, 7], min_weight_version=4))
            assert len(new.requests_seen) == 8 and not old.requests_seen


async def test_fake_engine_models_both_modes() -> None:
    fake = FakeEngine(FakeEngineConfig(step_base_s=0.001, weight_shapes={"w": (2,)}))
    await fake.start()
    try:
        for inflight in ("keep", "reprefill"):
            v0 = fake.weight_version
            task = asyncio.create_task(
                fake.generate(
                    GenerateRequest(
                        rid=f"f-{inflight}", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=400)
                    )
                )
            )
            await until(lambda: (r := fake._reqs.get(f"f-{inflight}")) is not None and len(r.out) >= 5)
            before = fake.reprefilled_tokens
            await fake.update_weights([("w", torch.zeros(2))], version=v0 + 1, inflight=inflight)  # type: ignore[arg-type]
            out = await task
            assert [v for v, _ in out.version_segments] == [v0, v0 + 1]
            if inflight == "keep":
                assert out.kv_version_segments == [(v0, 400)] and fake.reprefilled_tokens == before
            else:
                assert out.kv_version_segments == [] and fake.reprefilled_tokens > before
    finally:
        await fake.close()
