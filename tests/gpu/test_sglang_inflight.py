"""GPU tier, issue 41: per-token weight versions are exact on SGLang in both update modes.  Greedy requests
run; mid-way the weights change to ones whose every greedy token is known (``model.norm.weight = 0`` zeroes
the last hidden state, so all logits are equal and greedy picks one fixed token Z).  Exact: every token a
result puts under the new version is Z and the last one under the old version is not, so a split point off by
one in either direction fails.  ``keep`` must run in place (our scheduler patch loaded through the installed
plugin): nothing checkpointed.  Needs a GPU and sglang; skipped elsewhere."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from rollout_sdk.protocol import GenerateRequest, SamplingParams, UpdateWeightsFromIpc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]
HIDDEN = 896  # Qwen2.5-0.5B


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def eng(qwen_05b_dir: str, sglang_config: Callable[..., Any]) -> AsyncIterator[Any]:
    from rollout_sdk.engines.sglang import SglangEngine

    e = SglangEngine(sglang_config(qwen_05b_dir))
    await e.start()
    try:
        yield e
    finally:
        await e.close()


async def set_norm(e: Any, value: float, inflight: str) -> None:
    import torch

    from rollout_sdk.weights.buckets import plan_buckets
    from rollout_sdk.weights.ipc import export_cuda_ipc

    bucket = plan_buckets(
        [("model.norm.weight", torch.full((HIDDEN,), value, dtype=torch.bfloat16, device="cuda"))], 1 << 30
    )[0]
    flat = bucket.flatten()
    v = e.weight_version + 1
    await e.update_weights_from_ipc(
        UpdateWeightsFromIpc(
            call_id=f"n{v}", handles=[export_cuda_ipc(flat)], buckets=[bucket.metas], version=v, inflight=inflight
        )  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("inflight", ["keep", "reprefill"])
async def test_every_token_names_the_weights_that_sampled_it(eng: Any, inflight: str) -> None:
    await set_norm(eng, 1.0, "reprefill")
    greedy = SamplingParams(max_new_tokens=400, ignore_eos=True, temperature=0.0)
    reqs = [
        GenerateRequest(rid=f"{inflight}-{i}", input_ids=[100 + i, 7, 300 + 5 * i, 9], sampling=greedy)
        for i in range(48)
    ]
    tasks = [asyncio.ensure_future(eng.generate(r)) for r in reqs]

    def made(rid: str) -> int:
        f = eng.flights.get(rid)
        part = eng._path._reqs.get(f.sid) if f is not None else None
        return len(part.ids) if part is not None else 0

    async with asyncio.timeout(120):
        while not all(made(r.rid) >= 1 for r in reqs):
            await asyncio.sleep(0.002)
    v = eng.weight_version
    kept, ckpt = eng._control.kept_in_place, eng._control.checkpointed
    await set_norm(eng, 0.0, inflight)
    outs = await asyncio.gather(*tasks)
    z_probe = await eng.generate(GenerateRequest(rid=f"z-{inflight}", input_ids=[1, 2, 3], sampling=greedy))
    assert len(set(z_probe.output_ids)) == 1, "zeroed norm weights must give one fixed greedy token"
    z = z_probe.output_ids[0]
    for out in outs:
        (v_old, n_old), (v_new, n_new) = out.version_segments
        assert (v_old, v_new) == (v, v + 1) and n_old >= 1 and n_new > 0
        old, new = out.output_ids[:n_old], out.output_ids[n_old:]
        assert old[-1] != z and set(new) == {z}, f"{out.rid}: split at {n_old} is not where the weights changed"
        if inflight == "keep":
            assert out.kv_version_segments == [(v, 400)] and out.mixed_kv_tokens == n_new
        else:
            assert out.kv_version_segments == [] and out.mixed_kv_tokens == 0
    if inflight == "keep":  # in place: every request stayed in SGLang's batch
        assert eng._control.inplace and eng._control.kept_in_place - kept == 48 and eng._control.checkpointed == ckpt
    await set_norm(eng, 1.0, "reprefill")
