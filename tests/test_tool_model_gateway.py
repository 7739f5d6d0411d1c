"""The trained tool model through the gateway, called as a newcomer calls it: the real ``openai`` client
(chat completions, Responses) and ``anthropic`` client (Messages), the user's own calculator definition
(never the one in ``rollout_sdk.tasks.calculator``), held-back questions.  Each question needs a parsed
tool call whose expression is right and, after the tool's result, the right answer; at least 90% of them
must be solved, with the docs' hand-written definition and with every held-back definition
(``tasks/calculator_schemas.py``: OpenAI Agents SDK, LangChain, strict, minimal, verbose).

One gateway (named as a user starts it: no ``model_name``) and one CPU engine serve the whole module.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from gateway_agents.calculator_agent import Outcome, solve_chat, solve_messages, solve_responses
from rollout_sdk import CpuEngineConfig, RolloutClient
from rollout_sdk.gateway import Gateway
from rollout_sdk.tasks import calculator as task
from rollout_sdk.tasks.calculator_schemas import HELD_BACK, HeldBackTool

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: held-back questions per API with the docs' definition, and per held-back definition and API
QUESTIONS = 20
PER_DEFINITION = 4
THRESHOLD = 0.9
APIS = ("chat", "responses", "messages")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tool_model: Path) -> AsyncIterator[Gateway]:
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model))) as client, Gateway(client) as gw:
        yield gw


async def run(gw: Gateway, api: str, tool: HeldBackTool, samples: list[dict[str, Any]]) -> list[Outcome]:
    """Every sample through ``api`` with ``tool``, concurrently, each its own conversation (its API key is
    its session), greedy (a check must be reproducible)."""

    async def one(k: int, sample: dict[str, Any]) -> Outcome:
        key = f"{api}-{HELD_BACK.index(tool)}-{k}"
        client: Any
        if api == "messages":
            client = anthropic.AsyncAnthropic(base_url=gw.url.removesuffix("/v1"), api_key=key, max_retries=0)
            solve: Callable[..., Awaitable[Outcome]] = solve_messages
            spelled = tool.messages()
        else:
            client = openai.AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0)
            solve, spelled = (solve_chat, tool.chat()) if api == "chat" else (solve_responses, tool.responses())
        try:
            question = sample["messages"][0]["content"]
            return await solve(
                client, gw.model_name, spelled, question, sample["answer"], temperature=0.0, system=tool.system
            )
        finally:
            await client.close()

    return list(await asyncio.gather(*(one(k, s) for k, s in enumerate(samples))))


def check(outcomes: list[Outcome]) -> None:
    failed = [o for o in outcomes if not o.solved]
    assert len(outcomes) - len(failed) >= THRESHOLD * len(outcomes), failed
    # a parsed call is the rule, not the exception: the gateway returns tool_calls, not text
    assert sum(o.arguments is not None for o in outcomes) >= THRESHOLD * len(outcomes), failed


async def test_the_model_is_listed_under_a_meaningful_id(gw: Gateway) -> None:
    oa = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0)
    try:
        models = [m.id async for m in oa.models.list()]
    finally:
        await oa.close()
    assert models == ["tool-calculator"] == [gw.model_name]


@pytest.mark.parametrize("api", APIS)
async def test_hand_written_calculator_is_called_and_answered(gw: Gateway, api: str) -> None:
    assert HELD_BACK[0].label == "hand-written (docs)"
    check(await run(gw, api, HELD_BACK[0], task.samples(QUESTIONS, seed=37, split="test")))


@pytest.mark.parametrize("api", APIS)
async def test_held_back_definitions_are_called_and_answered(gw: Gateway, api: str) -> None:
    outcomes = []
    for k, tool in enumerate(HELD_BACK[1:]):
        outcomes += await run(gw, api, tool, task.samples(PER_DEFINITION, seed=100 + k, split="test"))
    check(outcomes)
