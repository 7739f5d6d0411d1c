"""LangGraph (the real package) against the gateway on the CPU tool model: its prebuilt ReAct agent over
langchain-openai's ChatOpenAI runs a calculator tool loop; the session's trajectory is exact tokens of a
fresh rendering, with the loss mask, logprobs and the trainer's per-turn reward."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from rollout_sdk import CpuEngineConfig, RolloutClient
from rollout_sdk.agents import ChatTemplate
from rollout_sdk.gateway import Gateway
from rollout_sdk.tasks import calculator as calc

prebuilt = pytest.importorskip("langgraph.prebuilt")
lc_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = calc.make_registry().schemas()  # the tool exactly as the model was trained on it
SCHEMA = TOOLS[0]["function"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path) -> AsyncIterator[tuple[Gateway, Any]]:
    from rollout_sdk.models import load_tokenizer

    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model), seed=0)) as client:
        async with Gateway(client, model_name="tool-model") as gw:
            yield gw, load_tokenizer(str(tool_model))


async def test_langgraph_react_agent_is_exact_tokens(env: tuple[Gateway, Any]) -> None:
    from langchain_core.tools import StructuredTool

    gw, tok = env
    sample = calc.samples(1, seed=3, split="test")[0]

    def calculator(expression: str) -> str:
        return str(calc._evaluate(expression))

    tool = StructuredTool.from_function(
        calculator, name=SCHEMA["name"], description=SCHEMA["description"], args_schema=SCHEMA["parameters"]
    )
    s = gw.session()
    async with httpx.AsyncClient() as http:  # LangChain's own is process-wide and never closed (conftest)
        llm = lc_openai.ChatOpenAI(
            base_url=s.base_url,
            api_key="unused",
            model=gw.model_name,
            max_retries=0,
            temperature=0.0,
            max_tokens=48,
            http_async_client=http,
        )
        agent = prebuilt.create_react_agent(llm, [tool])
        out = await agent.ainvoke({"messages": [("user", sample["messages"][0]["content"])]})
    assert any(m.type == "tool" for m in out["messages"])  # a real tool call, run by LangGraph
    assert str(sample["answer"]) in str(out["messages"][-1].content)
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
    assert t.reward == 1.0 and [u.reward for u in t.turns] == [0.25, None]
    gw.ack([s.id])
