"""The cells of docs/integrations.md's harness table that the other gateway modules leave open (issue 42,
item 2): LangChain streamed, langchain-anthropic over the Messages API (plain and streamed), litellm over
the Responses and Messages APIs, LangGraph's ReAct agent over Responses, Messages and streaming, and the
OpenAI Agents SDK over chat completions (plain and streamed) and over the Messages API.

Each runs the real package against the gateway on the trained CPU tool model: a held-back calculator
question, a real tool call answered by the harness's own loop, and the session's trajectory checked the
same way for every cell: tokens equal a fresh rendering (strict), the loss mask covers exactly the model's
tokens, logprobs are 0 off the mask and sampled on it, and the trainer's per-turn reward lands on the turn
it names.  One gateway and one CPU engine serve the whole module.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from rollout_sdk import CpuEngineConfig, RolloutClient
from rollout_sdk.agents import ChatTemplate
from rollout_sdk.gateway import Gateway
from rollout_sdk.gateway.gateway import SessionHandle
from rollout_sdk.tasks import calculator as calc

# litellm fetches its model-cost map from the internet at import unless told to use the bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", autouse=True)
async def _cached_clients_closed() -> AsyncIterator[None]:
    """litellm caches its HTTP clients process-wide: closed after the module, else their sockets stay open
    until the interpreter exits ("unclosed transport" after pytest's last line, issue 37)."""
    yield
    try:
        import litellm
    except ImportError:
        return
    await litellm.close_litellm_async_clients()


TOOLS = calc.make_registry().schemas()  # the tool exactly as the model was trained on it
SCHEMA = TOOLS[0]["function"]
ANTHROPIC_TOOL = {"name": SCHEMA["name"], "description": SCHEMA["description"], "input_schema": SCHEMA["parameters"]}
RESPONSES_TOOL = {"type": "function", **SCHEMA, "strict": False}
SAMPLING = {"temperature": 0.0, "max_tokens": 48}  # greedy, fixed by the trainer for the session


class Env:
    def __init__(self, gw: Gateway, tok: Any) -> None:
        self.gw = gw
        self.tok = tok

    def session(self) -> SessionHandle:
        return self.gw.session(sampling=SAMPLING)

    def root(self, s: SessionHandle) -> str:
        """What Anthropic-style clients take as their base URL (they add ``/v1/messages``)."""
        return s.base_url.removesuffix("/v1")

    def check(self, s: SessionHandle, sample: dict[str, Any], *, api: str) -> None:
        """The trainer's side of every cell: exact tokens, mask, logprobs, rewards, the call itself."""
        gw = self.gw
        nodes = gw.get_session(s.id).nodes
        assert [n.response_id.split("_")[0].split("-")[0] for n in nodes] == [api, api]  # the API it claims
        gw.turn_reward(s.id, 0.25, turn=0)
        gw.reward(s.id, 1.0)
        [t] = gw.session_record(s.id).trajectories
        report = ChatTemplate(self.tok, tools=TOOLS).check_drift(
            t.messages, t.ids, loss_mask=t.loss_mask, prompt_len=len(t.prompt_ids)
        )
        assert report.ok, str(report)
        assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs) and len(t.turns) == 2
        assert sum(t.loss_mask) == sum(u.model_tokens for u in t.turns)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 0)
        assert any(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 1)
        assert t.reward == 1.0 and [u.reward for u in t.turns] == [0.25, None]
        [c] = [c for u in t.turns for c in u.tool_calls]
        assert c.name == "calculator" and calc._evaluate(c.arguments["expression"]) == sample["answer"]
        assert str(sample["answer"]) in self.tok.decode(t.response_ids[-t.turns[-1].model_tokens :])
        gw.ack([s.id])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path) -> AsyncIterator[Env]:
    from rollout_sdk.models import load_tokenizer

    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model), seed=0)) as client:
        async with Gateway(client, model_name="tool-model") as gw:
            yield Env(gw, load_tokenizer(str(tool_model)))


def question() -> dict[str, Any]:
    return calc.samples(1, seed=3, split="test")[0]


def evaluate(arguments: dict[str, Any]) -> str:
    return str(calc._evaluate(arguments["expression"]))


# -- LangChain ----------------------------------------------------------------------------------------------


async def test_langchain_chat_openai_streamed_tool_loop(env: Env) -> None:
    lc_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    sample = question()
    s = env.session()
    async with httpx.AsyncClient() as http:  # LangChain's own is process-wide and never closed (conftest)
        llm = lc_openai.ChatOpenAI(
            base_url=s.base_url,
            api_key="unused",
            model=env.gw.model_name,
            max_retries=0,
            streaming=True,
            http_async_client=http,
        ).bind_tools(TOOLS)
        history: list[Any] = [HumanMessage(sample["messages"][0]["content"])]

        async def streamed() -> Any:
            total, chunks = None, 0
            async for chunk in llm.astream(history):
                total, chunks = (chunk if total is None else total + chunk), chunks + 1
            assert chunks > 1  # really streamed: LangChain rebuilt the message from the gateway's chunks
            return total

        ai = await streamed()
        [call] = ai.tool_calls
        history += [ai, ToolMessage(evaluate(call["args"]), tool_call_id=call["id"])]
        answer = await streamed()
    assert str(sample["answer"]) in str(answer.content)
    env.check(s, sample, api="chatcmpl")


@pytest.mark.parametrize("stream", [False, True])
async def test_langchain_anthropic_tool_loop_over_the_messages_api(env: Env, stream: bool) -> None:
    lc_anthropic = pytest.importorskip("langchain_anthropic")
    from langchain_core.messages import HumanMessage, ToolMessage

    sample = question()
    s = env.session()
    chat = lc_anthropic.ChatAnthropic(
        model=env.gw.model_name, base_url=env.root(s), api_key="unused", max_tokens=48, max_retries=0, streaming=stream
    )
    llm = chat.bind_tools([ANTHROPIC_TOOL])
    history: list[Any] = [HumanMessage(sample["messages"][0]["content"])]
    try:
        ai = await llm.ainvoke(history)
        [call] = ai.tool_calls
        history += [ai, ToolMessage(evaluate(call["args"]), tool_call_id=call["id"])]
        answer = await llm.ainvoke(history)
    finally:  # its httpx client is a process-wide cached one per base_url, never closed (conftest)
        await chat._async_client.close()
    assert str(sample["answer"]) in answer.text
    usage = answer.usage_metadata
    assert usage is not None and usage["output_tokens"] == env.gw.get_session(s.id).nodes[-1].turn.model_tokens
    env.check(s, sample, api="msg")


# -- litellm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_litellm_responses_tool_loop(env: Env, stream: bool) -> None:
    litellm = pytest.importorskip("litellm")
    sample = question()
    s = env.session()
    kw: dict[str, Any] = {"model": "openai/tool-model", "api_base": s.base_url, "api_key": "unused"}
    kw |= {"tools": [RESPONSES_TOOL]}
    items: list[Any] = [{"role": "user", "content": sample["messages"][0]["content"]}]

    async def call() -> Any:
        if not stream:
            return await litellm.aresponses(input=items, **kw)
        events = [e async for e in await litellm.aresponses(input=items, stream=True, **kw)]
        [done] = [e for e in events if e.type == "response.completed"]
        assert len(events) > 3  # created, items, deltas, completed: really streamed
        return done.response

    first = await call()
    [fc] = [o for o in first.output if o.type == "function_call"]
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": evaluate(json.loads(fc.arguments))})
    second = await call()
    text = "".join(p.text for o in second.output if o.type == "message" for p in o.content)
    assert str(sample["answer"]) in text
    env.check(s, sample, api="resp")


@pytest.mark.parametrize("stream", [False, True])
async def test_litellm_anthropic_provider_tool_loop_over_the_messages_api(env: Env, stream: bool) -> None:
    litellm = pytest.importorskip("litellm")
    sample = question()
    s = env.session()
    # litellm's anthropic provider turns OpenAI-shaped calls into Messages requests (its own translation)
    kw: dict[str, Any] = {"model": "anthropic/tool-model", "api_base": env.root(s), "api_key": "unused"}
    kw |= {"tools": TOOLS, "max_tokens": 48}
    messages: list[dict[str, Any]] = list(sample["messages"])

    async def call() -> dict[str, Any]:
        if not stream:
            r = await litellm.acompletion(messages=messages, **kw)
            return dict(r.choices[0].message.model_dump())
        chunks = [c async for c in await litellm.acompletion(messages=messages, stream=True, **kw)]
        return dict(litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message.model_dump())

    msg = await call()
    [c] = msg["tool_calls"]
    messages += [
        {"role": "assistant", "content": msg.get("content") or "", "tool_calls": [c]},
        {"role": "tool", "tool_call_id": c["id"], "content": evaluate(json.loads(c["function"]["arguments"]))},
    ]
    answer = await call()
    assert str(sample["answer"]) in answer["content"]
    env.check(s, sample, api="msg")


# -- LangGraph ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "messages", "stream"])
async def test_langgraph_react_agent_over_each_api(env: Env, api: str) -> None:
    prebuilt = pytest.importorskip("langgraph.prebuilt")
    from langchain_core.tools import StructuredTool

    sample = question()

    def calculator(expression: str) -> str:
        return evaluate({"expression": expression})

    tool = StructuredTool.from_function(
        calculator, name=SCHEMA["name"], description=SCHEMA["description"], args_schema=SCHEMA["parameters"]
    )
    s = env.session()
    async with httpx.AsyncClient() as http:  # LangChain's own clients are process-wide, never closed (conftest)
        if api == "messages":
            lc_anthropic = pytest.importorskip("langchain_anthropic")
            llm: Any = lc_anthropic.ChatAnthropic(
                model=env.gw.model_name, base_url=env.root(s), api_key="unused", max_tokens=48, max_retries=0
            )
        else:
            lc_openai = pytest.importorskip("langchain_openai")
            llm = lc_openai.ChatOpenAI(
                base_url=s.base_url,
                api_key="unused",
                model=env.gw.model_name,
                max_retries=0,
                use_responses_api=api == "responses",
                streaming=api == "stream",
                http_async_client=http,
            )
        agent = prebuilt.create_react_agent(llm, [tool])
        question_input = {"messages": [("user", sample["messages"][0]["content"])]}
        try:
            if api == "stream":
                tokens, final = 0, None
                async for mode, item in agent.astream(question_input, stream_mode=["messages", "values"]):
                    if mode == "messages":
                        tokens += 1
                    else:
                        final = item
                assert final is not None and tokens > 2  # message chunks came as the gateway streamed them
                out = final
            else:
                out = await agent.ainvoke(question_input)
        finally:
            if api == "messages":
                await llm._async_client.close()
    assert any(m.type == "tool" for m in out["messages"])  # a real tool call, run by LangGraph's ToolNode
    assert str(sample["answer"]) in out["messages"][-1].text
    env.check(s, sample, api={"responses": "resp", "messages": "msg", "stream": "chatcmpl"}[api])


# -- the OpenAI Agents SDK: chat completions (plain and streamed) and the Messages API (its LiteLLM model) -----


def agents_calculator(agents: Any) -> Any:
    async def invoke(_ctx: Any, args: str) -> str:
        return evaluate(json.loads(args))

    return agents.FunctionTool(
        name=SCHEMA["name"],
        description=SCHEMA["description"],
        params_json_schema=SCHEMA["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,  # the tool exactly as the model was trained on it
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_sdk_over_chat_completions(env: Env, stream: bool) -> None:
    agents = pytest.importorskip("agents")
    import openai

    agents.set_tracing_disabled(True)
    sample = question()
    s = env.session()
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0) as oa:
        model = agents.OpenAIChatCompletionsModel(model=env.gw.model_name, openai_client=oa)
        agent = agents.Agent(name="calc", tools=[agents_calculator(agents)], model=model)
        if stream:
            run = agents.Runner.run_streamed(agent, sample["messages"][0]["content"])
            kinds = [e.type async for e in run.stream_events()]
            assert "raw_response_event" in kinds  # the SDK consumed the gateway's chunks
            final = run.final_output
        else:
            final = (await agents.Runner.run(agent, sample["messages"][0]["content"])).final_output
    assert str(sample["answer"]) in final
    env.check(s, sample, api="chatcmpl")


async def test_openai_agents_sdk_litellm_model_over_the_messages_api(env: Env) -> None:
    agents = pytest.importorskip("agents")
    litellm_model = pytest.importorskip("agents.extensions.models.litellm_model")
    agents.set_tracing_disabled(True)
    sample = question()
    s = env.session()
    model = litellm_model.LitellmModel(model="anthropic/tool-model", base_url=env.root(s), api_key="unused")
    agent = agents.Agent(
        name="calc", tools=[agents_calculator(agents)], model=model, model_settings=agents.ModelSettings(max_tokens=48)
    )
    result = await agents.Runner.run(agent, sample["messages"][0]["content"])
    assert str(sample["answer"]) in result.final_output
    env.check(s, sample, api="msg")
