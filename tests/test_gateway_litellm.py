"""litellm (the real package) against the gateway on the CPU tool model: a calculator tool loop over chat
completions, plain and streamed; every turn is recorded as exact tokens of a fresh rendering, with the loss
mask and logprobs, and the trainer's per-turn reward lands on the turn it names."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rollout_sdk import CpuEngineConfig, RolloutClient
from rollout_sdk.agents import ChatTemplate
from rollout_sdk.gateway import Gateway
from rollout_sdk.tasks import calculator as calc

# litellm fetches its model-cost map from the internet at import unless told to use the bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = calc.make_registry().schemas()  # the tool exactly as the model was trained on it


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path) -> AsyncIterator[tuple[Gateway, Any]]:
    from rollout_sdk.models import load_tokenizer

    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model), seed=0)) as client:
        async with Gateway(client, model_name="tool-model") as gw:
            yield gw, load_tokenizer(str(tool_model))
            await litellm.close_litellm_async_clients()  # its cached clients' sockets, else open until exit


async def _call(gw: Gateway, key: str, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    kw = {"model": "openai/tool-model", "api_base": gw.url, "api_key": key, "messages": messages, "tools": TOOLS}
    kw |= {"temperature": 0.0, "max_tokens": 48}
    if not stream:
        r = await litellm.acompletion(**kw)
        return dict(r.choices[0].message.model_dump())
    chunks = [c async for c in await litellm.acompletion(stream=True, **kw)]
    return dict(litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message.model_dump())


@pytest.mark.parametrize("stream", [False, True])
async def test_litellm_tool_loop_is_exact_tokens(env: tuple[Gateway, Any], stream: bool) -> None:
    gw, tok = env
    sample = calc.samples(1, seed=3, split="test")[0]
    s = gw.session()
    messages: list[dict[str, Any]] = list(sample["messages"])
    for _ in range(3):
        msg = await _call(gw, s.api_key, messages, stream)
        calls = msg.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": msg.get("content") or "", **({"tool_calls": calls} if calls else {})}
        )
        if not calls:
            break
        for c in calls:
            value = calc._evaluate(json.loads(c["function"]["arguments"])["expression"])
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(value)})
    assert any(m["role"] == "tool" for m in messages)  # a real tool call, answered
    assert str(sample["answer"]) in messages[-1]["content"]
    gw.turn_reward(s.id, 0.25, turn=0)
    gw.reward(s.id, 1.0)
    [t] = gw.session_record(s.id).trajectories
    report = ChatTemplate(tok, tools=TOOLS).check_drift(
        t.messages, t.ids, loss_mask=t.loss_mask, prompt_len=len(t.prompt_ids)
    )
    assert report.ok, str(report)
    assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs) and len(t.turns) == 2
    assert sum(t.loss_mask) == sum(u.model_tokens for u in t.turns)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 0)
    assert any(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 1)
    assert t.reward == 1.0 and [u.reward for u in t.turns] == [0.25, None]
    gw.ack([s.id])
