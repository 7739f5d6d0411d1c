"""LangGraph (the real package) against the gateway on the CPU tool model: its prebuilt ReAct agent over
langchain-openai's ChatOpenAI runs a calculator tool loop; the session's trajectory is exact tokens of a
fresh rendering, with the loss mask, logprobs and the trainer's per-turn reward."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from rollout_sdk.gateway import Gateway
from rollout_sdk.tasks import calculator as calc
from tool_model_gateway import TOOLS, check_tool_loop_recorded, env  # noqa: F401  (env: a fixture)

prebuilt = pytest.importorskip("langgraph.prebuilt")
lc_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA = TOOLS[0]["function"]


async def test_langgraph_react_agent_is_exact_tokens(env: tuple[Gateway, Any]) -> None:  # noqa: F811
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
    check_tool_loop_recorded(gw, s, tok)
    gw.ack([s.id])
