"""The gateway's Responses and Messages APIs, trajectory records, export stream, rewards, session sampling
and the fixes of issue 29, driven by the real ``openai`` and ``anthropic`` clients on scripted fake engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx
import msgspec
import openai
import pytest

from rollout_sdk.agents import ChatTemplate
from rollout_sdk.gateway import Gateway
from rollout_sdk.gateway.records import SessionRecord, discounted_returns
from rollout_sdk.rollouts.seeds import sample_seed
from test_gateway import IM_END, Script, agents_sdk_and_add_tool, call, check_alignment, collect, gateway_on, model_runs


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    "strict": False,
}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}


def root(gw: Gateway) -> str:
    return gw.url.removesuffix("/v1")


# -- the Responses API ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_tool_round_trip_is_exact_tokens_of_the_chat_template(fake_servers, tok, stream) -> None:
    script = Script(tok, [call("add", a=2, b=3), "It is 5."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": gw.model_name, "tools": [TOOL], "instructions": "Use the tool."}
        items: list[Any] = [{"role": "user", "content": "2+3?"}]
        if stream:  # the openai client's own stream accumulator rebuilds the response from the events
            async with oa.responses.stream(input=items, **kw) as st:
                kinds = [e.type async for e in st]
                first = await st.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert "response.function_call_arguments.delta" in kinds
        else:
            first = await oa.responses.create(input=items, **kw)
        [fc] = [o for o in first.output if o.type == "function_call"]
        assert fc.name == "add" and json.loads(fc.arguments) == {"a": 2, "b": 3}
        assert first.usage is not None and first.usage.output_tokens == len(client.calls[0][1].output_ids)
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items.append({"type": "function_call_output", "call_id": fc.call_id, "output": "5"})
        second = await oa.responses.create(input=items, **kw)
        await oa.close()
        assert second.output_text == "It is 5." and second.status == "completed"
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    check_alignment(traj, client.calls)  # one branch: the re-sent items matched the served turn
    chat = ChatTemplate(tok, tools=[CHAT_TOOL])  # "strict" is not rendered into the prompt
    msgs = [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    assert client.calls[0][0].input_ids == chat.prompt_ids(msgs[:2])
    assert client.calls[1][0].input_ids == chat.prompt_ids(msgs)
    assert "strict" not in tok.decode(client.calls[0][0].input_ids)


async def test_previous_response_id_chains_within_a_session_and_not_across(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["one", "two"])) as (gw, client):
        s, other = gw.session(), gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        r1 = await oa.responses.create(model=gw.model_name, input="count", instructions="Be brief.")
        r2 = await oa.responses.create(model=gw.model_name, input="more", previous_response_id=r1.id)
        assert (r1.output_text, r2.output_text) == ("one", "two") and r2.previous_response_id == r1.id
        elsewhere = openai.AsyncOpenAI(base_url=other.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            await elsewhere.responses.create(model=gw.model_name, input="x", previous_response_id=r1.id)
        assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
        await oa.close()
        await elsewhere.close()
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    check_alignment(traj, client.calls)  # the chained call continued the first one's exact ids
    assert len(traj.turns) == 2 and [m["role"] for m in traj.messages] == ["system", "user", "assistant"] * 1 + [
        "user",
        "assistant",
    ]


async def test_responses_refuse_what_they_cannot_honour_by_field(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"])) as (gw, client):
        s = gw.session()
        good = {"model": gw.model_name, "input": "hi"}
        cases = [
            ({**good, "input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
            ({**good, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
            ({**good, "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({**good, "text": {"format": {"type": "json_schema"}}}, "text.format"),
            ({**good, "temperature": 7}, "temperature"),
            ({**good, "max_output_tokens": 0}, "max_output_tokens"),
            ({**good, "parallel_tool_calls": False}, "parallel_tool_calls"),
            ({**good, "top_logprobs": 2}, "top_logprobs"),
            ({**good, "service_tier": "flex"}, "service_tier"),
            ({**good, "conversation": "c1"}, "conversation"),
            ({"model": gw.model_name}, "input"),
            ({**good, "metadata": ["x"]}, "metadata"),
            ({**good, "tools": "add"}, "tools"),
            ({**good, "input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{bad"}]}, None),
            ({**good, "previous_response_id": "resp_nope"}, "previous_response_id"),
            ({**good, "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
            ({**good, "input": 5}, "input"),
        ]
        async with aiohttp.ClientSession() as http:
            for body, param in cases:
                async with http.post(f"{s.base_url}/responses", json=body) as r:
                    err = (await r.json())["error"]
                    assert r.status == 400 and (param is None or err["param"] == param), (body, err)
        assert client.calls == []


# -- the Messages API -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_tool_round_trip_with_the_anthropic_client(fake_servers, tok, stream) -> None:
    script = Script(tok, [f"Adding.\n{call('add', a=2, b=3)}", "5 it is."])
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": TOOL["parameters"]}]
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        ac = anthropic.AsyncAnthropic(base_url=root(gw), api_key=s.api_key, max_retries=0)  # the key is the session
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "2+3?"}]
        kw: dict[str, Any] = {"model": gw.model_name, "max_tokens": 64, "tools": tools, "system": "Be exact."}
        if stream:
            async with ac.messages.stream(messages=msgs, **kw) as st:
                first = await st.get_final_message()
        else:
            first = await ac.messages.create(messages=msgs, **kw)
        assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
        text, use = first.content
        assert text.text == "Adding." and use.input == {"a": 2, "b": 3}  # type: ignore[union-attr]
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},  # type: ignore[union-attr]
        ]
        second = await ac.messages.create(messages=msgs, **kw)
        assert second.stop_reason == "end_turn" and second.content[0].text == "5 it is."  # type: ignore[union-attr]
        assert second.usage.input_tokens == len(client.calls[1][0].input_ids)
        with pytest.raises(anthropic.BadRequestError, match="image"):
            await ac.messages.create(
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
                **kw,  # type: ignore[list-item]
            )
        await ac.close()
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    check_alignment(traj, client.calls)
    assert [[c.name for c in t.tool_calls] for t in traj.turns] == [["add"], []]
    assert ChatTemplate(tok, tools=[CHAT_TOOL]).check_drift(traj.messages, traj.ids).ok


async def test_messages_refuse_bad_input_by_field_in_anthropics_error_shape(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"])) as (gw, client):
        s = gw.session()
        good: dict[str, Any] = {"model": gw.model_name, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
        user = {"role": "user"}
        cases: list[tuple[dict[str, Any], str | None]] = [
            ({**good, "n": 2}, "n"),
            ({**good, "messages": []}, "messages"),
            ({**good, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
            ({**good, "messages": [{**user, "content": [{"type": "document"}]}]}, "messages[0].content[0]"),
            (
                {**good, "messages": [{**user, "content": [{"type": "tool_result"}]}]},
                "messages[0].content[0].tool_use_id",
            ),
            ({**good, "messages": [{**user, "content": 3}]}, "messages[0].content"),
            ({**good, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
            ({**good, "tool_choice": {"type": "any"}}, "tool_choice"),
            ({**good, "tool_choice": "auto"}, "tool_choice"),
            ({**good, "system": [{"type": "image"}]}, "system[0]"),
            ({**good, "temperature": 9}, "temperature"),
            ({**good, "max_tokens": 0}, "max_tokens"),
            ({**good, "stop_sequences": [""]}, "stop_sequences[0]"),
            ({**good, "model": "claude-9"}, "model"),
        ]
        async with aiohttp.ClientSession() as http:
            for body, param in cases:
                async with http.post(f"{s.base_url}/messages", json=body) as r:
                    data = await r.json()
                    assert r.status in (400, 404) and data["type"] == "error", (body, data)
                    assert data["error"]["param"] == param and data["error"]["message"], (body, data)
            async with http.post(f"{s.base_url}/messages", json=good) as r:  # still serving
                assert r.status == 200 and (await r.json())["content"] == [{"type": "text", "text": "ok"}]
        assert len(client.calls) == 1


# -- reasoning ------------------------------------------------------------------------------------------


async def test_a_reasoning_parser_splits_think_blocks_in_every_api_and_keeps_the_tokens(fake_servers, tok) -> None:
    script = Script(tok, ["<think>\n2 and 3 make 5.\n</think>\n\nFive."])
    async with gateway_on(fake_servers, tok, script, reasoning_parser="think") as (gw, _):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        chat = await oa.chat.completions.create(model=gw.model_name, messages=[{"role": "user", "content": "a"}])
        msg = chat.choices[0].message
        assert msg.content == "Five." and msg.model_extra["reasoning_content"] == "2 and 3 make 5."  # type: ignore[index]
        resp = await oa.responses.create(model=gw.model_name, input="b")
        assert [o.type for o in resp.output] == ["reasoning", "message"] and resp.output_text == "Five."
        assert resp.output[0].content[0].text == "2 and 3 make 5."  # type: ignore[union-attr,index]
        await oa.close()
        ac = anthropic.AsyncAnthropic(base_url=s.base_url.removesuffix("/v1"), api_key="x", max_retries=0)
        m = await ac.messages.create(model=gw.model_name, max_tokens=32, messages=[{"role": "user", "content": "c"}])
        await ac.close()
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "Five."  # type: ignore[union-attr]
        gw.finish(s.id)
        trajs = await collect(gw, 3)
    for traj in trajs:  # the model's tokens are recorded whole, reasoning included (loss mask 1)
        [run] = model_runs(traj)
        assert tok.decode(run).startswith("<think>") and run[-1] == IM_END


# -- trajectories over HTTP, rewards, the export stream ---------------------------------------------------


async def test_trajectory_endpoint_turn_rewards_and_metadata(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["a", "b", "c"])) as (gw, client):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{root(gw)}/v1/sessions", json={"metadata": {"row": 7}}) as r:
                sid = (await r.json())["id"]
            oa = openai.AsyncOpenAI(base_url=gw.url, api_key=sid, max_retries=0)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
            ids = []
            for follow in ("on", "end"):
                r1 = await oa.chat.completions.create(model=gw.model_name, messages=msgs)
                ids.append(r1.id)
                msgs += [
                    {"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": follow},
                ]
            await oa.chat.completions.create(model=gw.model_name, messages=msgs)
            await oa.close()
            rewards = {
                "turn_rewards": [{"response_id": ids[0], "reward": 0.5}, {"turn": 1, "reward": -1}],
                "reward": 2.0,
            }
            async with http.post(f"{root(gw)}/v1/sessions/{sid}/reward", json=rewards) as r:
                assert r.status == 200 and (await r.json())["finished"] is True
            async with http.post(
                f"{root(gw)}/v1/sessions/{sid}/reward", json={"turn_rewards": [{"turn": 9, "reward": 1}]}
            ) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "turn_rewards[0].turn"
            async with http.get(f"{root(gw)}/v1/sessions/{sid}/trajectory") as r:
                record = msgspec.json.decode(await r.read(), type=SessionRecord)
            async with http.get(f"{root(gw)}/v1/sessions/nope/trajectory") as r:
                assert r.status == 404
        [traj] = await collect(gw, 1)
    assert record.state == "finished" and record.metadata == traj.metadata == {"row": 7}
    [rec] = record.trajectories
    assert rec.ids == traj.ids and rec.logprobs == traj.logprobs and rec.loss_mask == traj.loss_mask
    check_alignment(traj, client.calls)
    assert [t.reward for t in traj.turns] == [0.5, -1.0, None] and traj.reward == 2.0
    assert [sl.reward for sl in record.turns[0]] == [0.5, -1.0, None]
    assert [sl.output_ids for sl in record.turns[0]] == [r.output_ids for _, r in client.calls]
    assert discounted_returns(traj, 1.0) == [1.5, 1.0, 2.0]
    assert discounted_returns(traj, 0.5) == [0.5 + 0.5 * (-1 + 0.5 * 2.0), -1 + 0.5 * 2.0, 2.0]
    # bug fixes: lifecycles of every engine call, context tokens counted after their turn (as ToolAgent)
    assert [lc.server_id for lc in traj.lifecycles] == ["fake-0"] * 3
    glue = [
        len(req.input_ids) - len(prev.input_ids) - len(res.output_ids)
        for (prev, res), (req, _) in zip(client.calls, client.calls[1:])
    ]
    assert [t.context_tokens for t in traj.turns] == [*glue, 0]


async def test_export_stream_sends_each_finished_session_once_as_it_finishes(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        handles = [gw.session() for _ in range(3)]
        oa = openai.AsyncOpenAI(base_url=gw.url, api_key="x", max_retries=0)
        for h in handles:
            await oa.with_options(api_key=h.api_key).chat.completions.create(
                model=gw.model_name, messages=[{"role": "user", "content": h.id}]
            )
        await oa.close()
        got: list[SessionRecord] = []
        async with aiohttp.ClientSession() as http:
            url = f"{root(gw)}/v1/trajectories/stream?limit=2&per_turn=true"
            async with http.get(url) as r:
                assert r.headers["Content-Type"].startswith("application/x-ndjson")
                gw.finish(handles[1].id, reward=1.0)  # sessions finish while the trainer listens
                gw.finish(handles[0].id)
                got += [msgspec.json.decode(line, type=SessionRecord) async for line in r.content if line.strip()]
            assert [g.session for g in got] == [handles[1].id, handles[0].id]
            assert got[0].reward == 1.0 and got[0].state == "exported" and got[0].turns[0][0].output_ids
            gw.finish(handles[2].id)
            async with http.get(f"{root(gw)}/v1/trajectories/stream?limit=1&format=sse") as r:
                event = await r.content.readuntil(b"\n\n")
            assert msgspec.json.decode(event.removeprefix(b"data: "), type=SessionRecord).session == handles[2].id
            # exported sessions stay readable by id (bounded by keep_exported)
            async with http.get(f"{root(gw)}/v1/sessions/{handles[0].id}/trajectory") as r:
                again = msgspec.json.decode(await r.read(), type=SessionRecord)
            assert again.trajectories[0].ids == got[1].trajectories[0].ids
            async with http.get(f"{root(gw)}/v1/trajectories/stream?format=xml") as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "format"


async def test_export_stream_refused_when_the_jsonl_writer_consumes(fake_servers, tok, tmp_path) -> None:
    jsonl = str(tmp_path / "t.jsonl")
    async with gateway_on(fake_servers, tok, Script(tok, ["x"]), trajectories_jsonl=jsonl) as (gw, _):
        async with aiohttp.ClientSession() as http, http.get(f"{root(gw)}/v1/trajectories/stream") as r:
            assert r.status == 409 and (await r.json())["error"]["code"] == "exported_to_jsonl"


# -- trainer-fixed sampling, seeds, bounds ---------------------------------------------------------------


async def test_session_sampling_overrides_the_agent_and_clamps_max_tokens(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["one two three four five six"])) as (gw, client):
        sampling = {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_tokens": 3}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{root(gw)}/v1/sessions", json={"sampling": sampling}) as r:
                sid = (await r.json())["id"]
            for bad, param in (
                ({"temperature": 3}, "sampling.temperature"),
                ({"logit_bias": 1}, "sampling.logit_bias"),
                ({"top_p": 0}, "sampling.top_p"),
            ):
                async with http.post(f"{root(gw)}/v1/sessions", json={"sampling": bad}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == param
        oa = openai.AsyncOpenAI(base_url=gw.url, api_key=sid, max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
        r1 = await oa.chat.completions.create(
            model=gw.model_name, messages=msgs, temperature=1.5, max_tokens=50, seed=1
        )
        assert r1.usage is not None and r1.usage.completion_tokens == 3 and r1.choices[0].finish_reason == "length"
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "on"}]
        await oa.chat.completions.create(model=gw.model_name, messages=msgs, max_tokens=2)
        await oa.close()
    (first, _), (second, _) = client.calls
    assert (first.sampling.temperature, first.sampling.top_p, first.sampling.max_new_tokens) == (0.7, 0.9, 3)
    assert second.sampling.max_new_tokens == 2  # below the limit: the agent's own
    # turn t of a session seeded 11 gets the SDK's seed for turn t, as ToolAgent's turns do
    assert (first.sampling.seed, second.sampling.seed) == (11, sample_seed(11, turn=1))


async def test_models_by_id_temperature_range_and_metrics(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"])) as (gw, _):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        assert (await oa.models.retrieve(gw.model_name)).id == gw.model_name
        with pytest.raises(openai.NotFoundError):
            await oa.models.retrieve("gpt-9")
        with pytest.raises(openai.BadRequestError, match=r"\[0, 2\]"):
            await oa.chat.completions.create(
                model=gw.model_name, messages=[{"role": "user", "content": "x"}], temperature=7
            )
        await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "x"}], temperature=2
        )
        await oa.close()
        async with aiohttp.ClientSession() as http, http.get(f"{root(gw)}/metrics") as r:
            text = await r.text()
        assert r.status == 200 and r.content_type == "text/plain"
        assert "rollout_gateway_turns_total 1.0" in text and "rollout_gateway_sessions_open 1.0" in text
        assert 'rollout_client_requests_total{outcome="completed",server="fake-0"} 1.0' in text


async def test_a_server_without_a_configured_id_is_labelled_by_its_rank_and_address() -> None:
    from rollout_sdk.engines.fake import FakeEngine
    from rollout_sdk.server import EngineServer, ServerConfig

    async with EngineServer(FakeEngine(), ServerConfig(dp_rank=3)) as server:  # type: ignore[arg-type]
        port = server.address.rsplit(":", 1)[1]
        assert server.server_id == f"dp3@127.0.0.1:{port}"
    # restarted on the same address: the same name, so the same metrics series and fleet slot
    async with EngineServer(FakeEngine(), ServerConfig(dp_rank=3, port=int(port))) as again:  # type: ignore[arg-type]
        assert again.server_id == server.server_id
    assert EngineServer(FakeEngine(), ServerConfig(server_id="a", dp_rank=3)).server_id == "a"  # type: ignore[arg-type]


async def test_many_export_consumers_and_agents_at_once_lose_and_duplicate_nothing(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        handles = [gw.session() for _ in range(20)]
        oa = openai.AsyncOpenAI(base_url=gw.url, api_key="x", max_retries=0)

        async def agent(h: Any) -> None:
            await oa.with_options(api_key=h.api_key).chat.completions.create(
                model=gw.model_name, messages=[{"role": "user", "content": h.id}]
            )
            gw.finish(h.id)

        async def consumer(http: aiohttp.ClientSession, n: int) -> list[str]:
            async with http.get(f"{root(gw)}/v1/trajectories/stream?limit={n}") as r:
                return [
                    msgspec.json.decode(line, type=SessionRecord).session async for line in r.content if line.strip()
                ]

        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(consumer(http, 5) for _ in range(4)), *(agent(h) for h in handles))
        await oa.close()
    seen = [sid for got in results[:4] for sid in got]  # type: ignore[union-attr]
    assert sorted(seen) == sorted(h.id for h in handles)


async def test_closing_the_gateway_ends_an_open_export_stream(fake_servers, tok) -> None:
    from test_gateway import wait_for

    async with aiohttp.ClientSession() as http:
        async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
            r = await http.get(f"{root(gw)}/v1/trajectories/stream")
            await wait_for(lambda: gw.export_streams == 1)
        assert [line async for line in r.content if line.strip()] == []  # ended, not hung
        r.release()


def test_an_unknown_reasoning_parser_is_a_config_error_naming_it() -> None:
    from rollout_sdk.errors import ConfigError
    from rollout_sdk.gateway import GatewayConfig

    with pytest.raises(ConfigError, match="reasoning_parser"):
        GatewayConfig(reasoning_parser="deepthink")


async def test_a_record_whose_write_fails_goes_back_for_the_next_consumer(fake_servers, tok) -> None:
    from rollout_sdk.gateway.routes import _Routes

    class GoneTrainer:
        async def write(self, data: bytes) -> None:
            raise ConnectionResetError("the trainer went away")

    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        await oa.chat.completions.create(model=gw.model_name, messages=[{"role": "user", "content": "hi"}])
        await oa.close()
        gw.finish(s.id)
        with pytest.raises(ConnectionResetError):
            await _Routes(gw)._send_records(GoneTrainer(), gw.finished_sessions(http=True), "ndjson", False, None)  # type: ignore[arg-type]
        assert gw.exported_sessions == 0 and gw.store.finished.qsize() == 1  # not lost, not exported
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{root(gw)}/v1/trajectories/stream?limit=1") as r:
                [line] = [x async for x in r.content if x.strip()]
            assert msgspec.json.decode(line, type=SessionRecord).session == s.id and gw.exported_sessions == 0
            async with http.post(f"{root(gw)}/v1/trajectories/ack", json={"ids": [s.id]}) as r:
                assert (await r.json())["acknowledged"] == [s.id]
        assert gw.exported_sessions == 1


async def test_agents_sdk_streamed_run_and_langchain_on_the_responses_api(fake_servers, tok) -> None:
    agents, add = agents_sdk_and_add_tool()
    lc_openai = pytest.importorskip("langchain_openai")
    script = Script(tok, [call("add", a=20, b=22), "The sum is 42."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        agent = agents.Agent(name="calc", tools=[add], model=gw.model_name)
        run = agents.Runner.run_streamed(
            agent, "20+22?", run_config=agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=oa))
        )
        kinds = {e.type async for e in run.stream_events()}
        await oa.close()
        assert run.final_output == "The sum is 42." and "raw_response_event" in kinds
        lc = gw.session()
        async with httpx.AsyncClient() as http:  # LangChain's own is process-wide and never closed (conftest)
            llm = lc_openai.ChatOpenAI(
                base_url=lc.base_url,
                api_key="x",
                model=gw.model_name,
                max_retries=0,
                use_responses_api=True,
                http_async_client=http,
            )
            ai = await llm.bind_tools([CHAT_TOOL]).ainvoke("20+22?")  # LangChain parses function_call items
        assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("add", {"a": 20, "b": 22})]
        assert [n.response_id[:5] for n in gw.get_session(s.id).nodes] == ["resp_", "resp_"]
        assert [n.response_id[:5] for n in gw.get_session(lc.id).nodes] == ["resp_"]
        gw.finish(s.id)
        gw.finish(lc.id)
        trajs = {t.id: t for t in await collect(gw, 2)}
    check_alignment(trajs[s.id], [c for c in client.calls if c[0].session_id == s.id])


def test_any_json_body_is_translated_or_refused_with_a_gateway_error() -> None:
    """Fuzz both adapters (and the chat normalisation after them) with arbitrary JSON: a 4xx naming a
    field, or a chat call; never another exception (which would be a 500)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from rollout_sdk.gateway import messages as messages_api
    from rollout_sdk.gateway import responses as responses_api
    from rollout_sdk.gateway.errors import GatewayError
    from rollout_sdk.gateway.sessions import Session
    from rollout_sdk.gateway.tools import template_messages, template_tools

    scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4))
    keys = st.sampled_from(
        ["type", "role", "content", "text", "name", "call_id", "arguments", "output", "id", "input", "tool_use_id"]
    )
    values = st.sampled_from(
        [
            "message",
            "function_call",
            "function_call_output",
            "reasoning",
            "user",
            "assistant",
            "system",
            "text",
            "tool_use",
            "tool_result",
            "thinking",
            "input_text",
            "output_text",
            "x",
        ]
    )
    leaf = st.one_of(scalar, values)
    json_ = st.recursive(
        leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(keys, c, max_size=4)), max_leaves=12
    )
    field = st.sampled_from(["input", "messages", "system", "tools", "instructions", "tool_choice", "metadata"])
    session = Session("s", max_turns=8)

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(field, json_, max_size=4))
    def prop(body: dict[str, Any]) -> None:
        for translate in (lambda b: responses_api.to_chat(b, session)[0], messages_api.to_chat):
            refused: GatewayError | None = None
            try:
                chat = translate({"model": "m", **body})
                template_tools(chat.get("tools"))
                template_messages(chat["messages"], max_messages=64)
            except GatewayError as exc:
                refused = exc
            assert refused is None or (400 <= refused.status < 500 and refused.message)

    prop()


# -- issue 42: the request's tools reach the parser; think tags inside arguments; unknown tools ------------


async def _one_turn_with_tools(
    fake_servers: Any, tok: Any, text: str, tools: list[dict[str, Any]], **gateway: Any
) -> Any:
    """One chat completion offering ``tools``, through a gateway whose model answers ``text``."""
    async with gateway_on(fake_servers, tok, Script(tok, [text]), **gateway) as (gw, _):
        oa = openai.AsyncOpenAI(base_url=gw.session().base_url, api_key="x", max_retries=0)
        chat = await oa.chat.completions.create(
            model=gw.model_name,
            messages=[{"role": "user", "content": "a"}],
            tools=tools,  # type: ignore[arg-type]
        )
        await oa.close()
    return chat


async def test_qwen3_coder_arguments_are_typed_by_the_requests_tools(fake_servers, tok) -> None:
    params = "<parameter=a>\n3\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
    xml = f"<tool_call>\n<function=add>\n{params}</function>\n</tool_call>"
    unknown = "<tool_call>\n<function=nope>\n<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
    props = {"a": {"type": "integer"}, "ok": {"type": "boolean"}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": props}}}]
    chat = await _one_turn_with_tools(fake_servers, tok, xml + "\n" + unknown, tools, parser="qwen3_coder")
    calls = chat.choices[0].message.tool_calls or []
    # typed as the request's schema says (3, true), not strings; a tool the request did not offer is still
    # returned to the client (the client decides), its values untyped text since no schema names them
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("add", {"a": 3, "ok": True}),
        ("nope", {"a": "3"}),
    ]


async def test_think_tags_inside_a_calls_arguments_are_the_arguments(fake_servers, tok) -> None:
    args = {"path": "a.md", "content": "x </think> y <think> z"}
    text = "<tool_call>\n" + json.dumps({"name": "write_file", "arguments": args}) + "\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
    chat = await _one_turn_with_tools(fake_servers, tok, text, tools, reasoning_parser="think")
    msg = chat.choices[0].message
    [c] = msg.tool_calls or []
    assert json.loads(c.function.arguments) == args  # type: ignore[union-attr]
    assert (msg.model_extra or {}).get("reasoning_content") is None
