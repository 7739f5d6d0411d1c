"""litellm (the real package) against the gateway on the CPU tool model: a calculator tool loop over chat
completions, plain and streamed; every turn is recorded as exact tokens of a fresh rendering, with the loss
mask and logprobs, and the trainer's per-turn reward lands on the turn it names."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from rollout_sdk.gateway import Gateway
from rollout_sdk.tasks import calculator as calc
from tool_model_gateway import TOOLS, check_tool_loop_recorded, env  # noqa: F401  (env: a fixture)

# litellm fetches its model-cost map from the internet at import unless told to use the bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", autouse=True)
async def _litellm_clients_closed() -> AsyncIterator[None]:
    """litellm caches its HTTP clients process-wide: closed after the module, else their sockets stay open
    until the interpreter exits ("unclosed transport" after pytest's last line, issue 37)."""
    yield
    await litellm.close_litellm_async_clients()


async def _call(gw: Gateway, key: str, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    kw = {"model": "openai/tool-model", "api_base": gw.url, "api_key": key, "messages": messages, "tools": TOOLS}
    kw |= {"temperature": 0.0, "max_tokens": 48}
    if not stream:
        r = await litellm.acompletion(**kw)
        return dict(r.choices[0].message.model_dump())
    chunks = [c async for c in await litellm.acompletion(stream=True, **kw)]
    return dict(litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message.model_dump())


@pytest.mark.parametrize("stream", [False, True])
async def test_litellm_tool_loop_is_exact_tokens(env: tuple[Gateway, Any], stream: bool) -> None:  # noqa: F811
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
    check_tool_loop_recorded(gw, s, tok, sampled_logprobs=True)
    gw.ack([s.id])
