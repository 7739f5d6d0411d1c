"""Real agent frameworks against the gateway on the trained CPU tool model: the OpenAI Agents SDK with its
default model (the Responses API), the ``anthropic`` client (Messages API) and LangChain (chat
completions).  Each solves a held-back calculator question with a real tool call; every turn is recorded
as exact tokens, and a trainer reads the finished sessions over HTTP, with ids equal to the JSONL export's.

One gateway and one CPU engine serve the whole module.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec
import pytest
import pytest_asyncio

from rollout_sdk import CpuEngineConfig
from rollout_sdk.agents import ChatTemplate
from rollout_sdk.gateway import Gateway, read_trajectories
from rollout_sdk.gateway.records import SessionRecord
from rollout_sdk.tasks import calculator as task

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA = task.make_registry().schemas()[0]["function"]  # the tool exactly as the model was trained on it
SAMPLING = {"temperature": 0.0, "max_tokens": 48}  # the trainer fixes greedy decoding per session


class Env:
    def __init__(self, gw: Gateway, jsonl: Path, tokenizer: Any) -> None:
        self.gw = gw
        self.jsonl = jsonl
        self.tokenizer = tokenizer
        self.root = gw.url.removesuffix("/v1")

    async def session(self, http: aiohttp.ClientSession, **meta: Any) -> dict[str, Any]:
        async with http.post(f"{self.root}/v1/sessions", json={"metadata": meta, "sampling": SAMPLING}) as r:
            assert r.status == 201, await r.text()
            return dict(await r.json())

    async def finish_and_fetch(self, http: aiohttp.ClientSession, sid: str, reward: float) -> SessionRecord:
        body = {"reward": reward, "turn_rewards": [{"turn": 0, "reward": 0.25}]}
        async with http.post(f"{self.root}/v1/sessions/{sid}/reward", json=body) as r:
            assert r.status == 200, await r.text()
        async with http.get(f"{self.root}/v1/sessions/{sid}/trajectory") as r:
            assert r.status == 200, await r.text()
            return msgspec.json.decode(await r.read(), type=SessionRecord)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    from rollout_sdk import RolloutClient
    from rollout_sdk.models import load_tokenizer

    jsonl = tmp_path_factory.mktemp("gw") / "trajectories.jsonl"
    client = RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model)))
    async with client, Gateway(client, trajectories_jsonl=str(jsonl), model_name="tool-model") as gw:
        yield Env(gw, jsonl, load_tokenizer(str(tool_model)))


def question() -> dict[str, Any]:
    return task.samples(1, seed=3, split="test")[0]


async def check_recorded(env: Env, http: aiohttp.ClientSession, sid: str, sample: dict[str, Any]) -> None:
    """The trainer's side: the record over HTTP, exact and equal to the JSONL export, with rewards."""
    record = await env.finish_and_fetch(http, sid, 1.0)
    [traj] = record.trajectories
    assert record.schema_version == 1 and traj.schema_version == 1
    assert record.metadata == traj.metadata == {"question": sample["expression"]}
    assert traj.reward == 1.0 and [t.reward for t in traj.turns] == [0.25, None]
    # a real tool call, evaluated by the agent, and its result in the answer
    [call] = [c for t in traj.turns for c in t.tool_calls]
    assert call.name == "calculator" and task._evaluate(call.arguments["expression"]) == sample["answer"]
    assert str(sample["answer"]) in env.tokenizer.decode(traj.response_ids)
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    assert len(traj.lifecycles) == len(traj.turns) == 2
    # the per-turn slices cut the whole exactly
    for sl in record.turns[0]:
        assert traj.ids[sl.start : sl.start + len(sl.output_ids)] == sl.output_ids
        assert sum(traj.loss_mask[sl.start - len(traj.prompt_ids) :][: len(sl.output_ids)]) == len(sl.output_ids)
    # the turns' context: tokens added after each turn, like ToolAgent counts them
    assert traj.turns[0].context_tokens == len(record.turns[0][1].context_ids) and traj.turns[-1].context_tokens == 0
    # the re-rendered conversation is exactly the recorded tokens, the mask exactly the model's tokens, and
    # the logprobs 0 off the mask and the engine's on it
    chat = ChatTemplate(env.tokenizer, tools=[{"type": "function", "function": SCHEMA}])
    report = chat.check_drift(traj.messages, traj.ids, loss_mask=traj.loss_mask, prompt_len=len(traj.prompt_ids))
    assert report.ok, str(report)
    assert sum(traj.loss_mask) == sum(t.model_tokens for t in traj.turns)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)
    assert any(lp < 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 1)
    # the JSONL writer exports the same trajectory
    async with asyncio.timeout(120):
        while not (exported := [t for t in _read(env.jsonl) if t.id == sid]):
            await asyncio.sleep(0.05)
    assert exported[0].ids == traj.ids and exported[0].logprobs == traj.logprobs
    assert exported[0].loss_mask == traj.loss_mask and exported[0].weight_versions == traj.weight_versions


def _read(path: Path) -> list[Any]:
    return read_trajectories(path) if path.exists() else []


async def test_openai_agents_sdk_default_model_uses_the_responses_api(env: Env) -> None:
    agents = pytest.importorskip("agents")
    import openai

    agents.set_tracing_disabled(True)

    async def invoke(_ctx: Any, args: str) -> str:
        return str(task._evaluate(json.loads(args)["expression"]))

    calculator = agents.FunctionTool(
        name=SCHEMA["name"],
        description=SCHEMA["description"],
        params_json_schema=SCHEMA["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )
    sample = question()
    async with aiohttp.ClientSession() as http:
        s = await env.session(http, question=sample["expression"])
        oa = openai.AsyncOpenAI(base_url=s["base_url"], api_key="unused", max_retries=0)
        # no model class named: the SDK's default provider and model, i.e. OpenAIResponsesModel
        agent = agents.Agent(name="calc", tools=[calculator], model=env.gw.model_name)
        run_config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=oa))
        result = await agents.Runner.run(agent, sample["messages"][0]["content"], run_config=run_config)
        await oa.close()
        assert str(sample["answer"]) in result.final_output
        session = env.gw.get_session(s["id"])
        assert [n.response_id[:5] for n in session.nodes] == ["resp_", "resp_"]
        await check_recorded(env, http, s["id"], sample)


async def test_anthropic_client_runs_a_tool_loop_over_the_messages_api(env: Env) -> None:
    anthropic = pytest.importorskip("anthropic")
    sample = question()
    tools = [{"name": SCHEMA["name"], "description": SCHEMA["description"], "input_schema": SCHEMA["parameters"]}]
    async with aiohttp.ClientSession() as http:
        s = await env.session(http, question=sample["expression"])
        client = anthropic.AsyncAnthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="unused", max_retries=0)
        messages: list[dict[str, Any]] = list(sample["messages"])
        first = await client.messages.create(model=env.gw.model_name, max_tokens=64, messages=messages, tools=tools)
        assert first.stop_reason == "tool_use"
        [use] = [b for b in first.content if b.type == "tool_use"]
        result = str(task._evaluate(use.input["expression"]))
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]},
        ]
        # the answer streamed: the client's own accumulator rebuilds it from the gateway's events
        async with client.messages.stream(
            model=env.gw.model_name, max_tokens=64, messages=messages, tools=tools
        ) as stream:
            final = await stream.get_final_message()
        await client.close()
        assert final.stop_reason == "end_turn" and str(sample["answer"]) in final.content[0].text
        assert final.usage.output_tokens == env.gw.get_session(s["id"]).nodes[-1].turn.model_tokens
        await check_recorded(env, http, s["id"], sample)


async def test_langchain_chat_openai_with_bound_tools(env: Env) -> None:
    lc_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    sample = question()
    # LangChain's own httpx client is process-wide and never closed (conftest): the test's is closed
    async with aiohttp.ClientSession() as http, httpx.AsyncClient() as lc_http:
        s = await env.session(http, question=sample["expression"])
        llm = lc_openai.ChatOpenAI(
            base_url=s["base_url"], api_key="unused", model=env.gw.model_name, max_retries=0, http_async_client=lc_http
        ).bind_tools([{"type": "function", "function": SCHEMA}])
        history: list[Any] = [HumanMessage(sample["messages"][0]["content"])]
        ai = await llm.ainvoke(history)
        [call] = ai.tool_calls
        history += [ai, ToolMessage(str(task._evaluate(call["args"]["expression"])), tool_call_id=call["id"])]
        answer = await llm.ainvoke(history)
        assert str(sample["answer"]) in str(answer.content)
        await check_recorded(env, http, s["id"], sample)
