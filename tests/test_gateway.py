"""The OpenAI-compatible gateway, driven by the real ``openai`` package (and aiohttp for raw HTTP)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import itertools
import json
import resource
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway_agents import openai_tool_agent
from gateway_agents.openai_tool_agent import TOOLS, run_agent
from rollout_sdk import RolloutClient
from rollout_sdk.agents import ChatTemplate, Trajectory
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.gateway import Gateway, read_trajectories
from rollout_sdk.protocol import GenerateRequest, GenerateResult
from rollout_sdk.rollouts.seeds import sample_seed

IM_END = 151645
QWEN = FakeEngineConfig(eos_token_ids=(IM_END,))


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def call(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


class Script:
    """Answer the k-th assistant turn of a conversation with ``turns[k]``, as exact tokens."""

    def __init__(self, tok: Any, turns: list[str]) -> None:
        self.tok = tok
        self.outputs = [[*tok.encode(t, add_special_tokens=False), IM_END] for t in turns]

    def __call__(self, req: GenerateRequest) -> list[int]:
        k = self.tok.decode(req.input_ids).count("<|im_start|>assistant") - 1
        return self.outputs[min(k, len(self.outputs) - 1)]


class RecordingClient(RolloutClient):
    """A RolloutClient that keeps every request the gateway sent and what the engine returned."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []

    async def generate(self, request: Any, /, **kw: Any) -> GenerateResult:
        result = await super().generate(request, **kw)
        self.calls.append((request, result))
        return result


@contextlib.asynccontextmanager
async def gateway_on(
    fake_servers: Any, tok: Any, responder: Callable[..., Any] | None = None, **options: Any
) -> AsyncIterator[tuple[Gateway, RecordingClient]]:
    servers = await fake_servers(1, QWEN, responder=responder)
    client = RecordingClient(servers=[s.address for s in servers])
    async with client, Gateway(client, tokenizer=tok, **options) as gw:
        yield gw, client


def template_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's messages as the chat template takes them (tool-call arguments as objects)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        m.setdefault("content", "")
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def model_runs(traj: Trajectory) -> list[list[int]]:
    pairs = zip(traj.response_ids, traj.loss_mask, strict=True)
    return [[t for t, _ in g] for m, g in itertools.groupby(pairs, key=lambda p: p[1]) if m]


async def collect(gw: Gateway, n: int) -> list[Trajectory]:
    out = []
    async for t in gw.trajectories():
        out.append(t)
        if len(out) == n:
            break
    return out


def check_alignment(traj: Trajectory, calls: list[tuple[GenerateRequest, GenerateResult]]) -> None:
    """Model tokens are the engine's, in order; mask and logprobs line up token for token."""
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    assert model_runs(traj) == [r.output_ids for _, r in calls]
    model_lps = [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]
    assert model_lps == [lp for _, r in calls for lp in (r.logprobs or [])]
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if not m)
    assert traj.prompt_ids == calls[0][0].input_ids
    for (req, res), (nxt, _) in itertools.pairwise(calls):
        assert nxt.input_ids[: len(req.input_ids) + len(res.output_ids)] == req.input_ids + res.output_ids
    last_req, last_res = calls[-1]
    assert traj.ids == last_req.input_ids + last_res.output_ids
    assert sum(n for _, n in traj.weight_versions) == sum(traj.loss_mask)


def test_the_agent_imports_nothing_from_rollout_sdk() -> None:
    tree = ast.parse(Path(openai_tool_agent.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("rollout_sdk")]
    assert "openai" in names


# -- exact tokens through a black-box tool agent ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_agent_turns_are_exact_tokens_of_the_template(fake_servers, tok, stream: bool) -> None:
    script = Script(tok, [call("add", a=2, b=3), call("mul", a=5, b=4), "The answer is 20."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        run = await run_agent(s.base_url, "ignored", gw.model_name, "What is (2+3)*4?", stream=stream)
        replies, messages = run["replies"], run["messages"]
        assert [r["finish_reason"] for r in replies] == ["tool_calls", "tool_calls", "stop"]
        first = replies[0]["message"]["tool_calls"][0]
        assert first["function"]["name"] == "add" and json.loads(first["function"]["arguments"]) == {"a": 2, "b": 3}
        assert isinstance(first["function"]["arguments"], str)  # OpenAI's wire format: a JSON string
        assert [m["content"] for m in messages if m["role"] == "tool"] == ["5", "20"]
        assert replies[-1]["message"]["content"] == "The answer is 20."
        # the prompt of every turn is exactly the template's rendering of what the agent sent
        chat = ChatTemplate(tok, tools=TOOLS)
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert len(client.calls) == 3
        for (req, _), i in zip(client.calls, assistant_at, strict=True):
            assert req.input_ids == chat.prompt_ids(template_form(messages[:i]))
            assert req.session_id == s.id
        # the logprobs the agent saw are the engine's
        for reply, (_, res) in zip(replies, client.calls, strict=True):
            assert [c.logprob for c in reply["logprobs"]] == res.logprobs
        gw.reward(s.id, 1.0)
        [traj] = await collect(gw, 1)
    check_alignment(traj, client.calls)
    assert traj.reward == 1.0 and traj.id == s.id
    assert [[c.name for c in t.tool_calls] for t in traj.turns] == [["add"], ["mul"], []]
    assert chat.check_drift(traj.messages, traj.ids).ok
    assert traj.metrics["branches"] == 1.0


async def test_a_malformed_call_comes_back_as_content_and_is_recorded(fake_servers, tok) -> None:
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    script = Script(tok, [f"Let me add.{bad}", "Sorry, 3."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        run = await run_agent(s.base_url, "x", gw.model_name, "1+2?", follow_ups=["and?"])
        first = run["replies"][0]
        assert first["finish_reason"] == "stop" and "tool_calls" not in first["message"]
        assert first["message"]["content"] == f"Let me add.\n{bad}"
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    assert traj.turns[0].parse_errors and traj.turns[0].parse_errors[0].startswith("bad_json")
    assert traj.metrics["branches"] == 1.0  # the re-sent content matched what was served
    check_alignment(traj, client.calls)


async def test_edited_history_branches_and_both_branches_are_recorded(fake_servers, tok) -> None:
    script = Script(tok, [call("add", a=2, b=3), call("mul", a=5, b=4), "20."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        run = await run_agent(s.base_url, "x", gw.model_name, "What is (2+3)*4?")
        messages = run["messages"]
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        # the agent rewrites its second reply (the mul call) and continues from there
        edited = json.loads(json.dumps(messages[:5]))
        edited[4]["tool_calls"][0]["function"]["arguments"] = json.dumps({"a": 5, "b": 40})
        edited.append({"role": "tool", "tool_call_id": edited[4]["tool_calls"][0]["id"], "content": "200"})
        r = await oa.chat.completions.create(model=gw.model_name, messages=edited, tools=TOOLS)
        assert r.choices[0].message.content == "20."
        await oa.close()
        gw.finish(s.id, reward=0.5)
        trajs = await collect(gw, 2)
    main, branch = trajs
    assert (main.id, branch.id) == (f"{s.id}.b0", f"{s.id}.b1")
    assert len(main.turns) == 3 and len(branch.turns) == 2
    assert main.reward == branch.reward == 0.5
    check_alignment(main, client.calls[:3])
    check_alignment(branch, [client.calls[0], client.calls[3]])
    assert branch.metrics["shared_prefix_turns"] == 1.0
    # the edited reply is context now (mask 0), rendered by the template; the model's first turn is kept
    chat = ChatTemplate(tok, tools=TOOLS)
    assert client.calls[3][0].input_ids == chat.prompt_ids(template_form(edited))
    assert '"b": 40' in tok.decode(branch.response_ids[len(model_runs(branch)[0]) :])


async def test_n_choices_are_sibling_branches_with_distinct_seeds(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["a", "b"])) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        r = await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "hi"}], n=3, seed=7
        )
        await oa.close()
        assert len(r.choices) == 3 and r.usage is not None and r.usage.completion_tokens == 6
        # the SDK's one seed function, as generate_many(n=3) seeds its members (not seed + k)
        seeds = sorted(req.sampling.seed for req, _ in client.calls)
        assert seeds == sorted(sample_seed(7, member=k) for k in range(3))
        gw.finish(s.id)
        trajs = await collect(gw, 3)
    assert [t.metrics["branches"] for t in trajs] == [3.0, 3.0, 3.0]


# -- the embedded CPU engine (the real tiny model, random weights) ---------------------------------------


async def test_cpu_engine_multi_turn_agent_exact_ids_and_a_branch(tiny_model, tok) -> None:
    from rollout_sdk import CpuEngineConfig

    client = RecordingClient(engine=CpuEngineConfig(model_path=str(tiny_model)))
    async with client, Gateway(client) as gw:
        a, b = gw.session(), gw.session()
        runs = await asyncio.gather(
            run_agent(
                a.base_url, "x", gw.model_name, "2+2?", follow_ups=["Again?", "Once more?"], max_tokens=12, seed=1
            ),
            run_agent(
                b.shared_base_url,
                b.api_key,
                gw.model_name,
                "3*3?",
                follow_ups=["Why?"],
                max_tokens=12,
                seed=2,
                stream=True,
            ),
        )
        calls_a = [c for c in client.calls if c[0].session_id == a.id]
        calls_b = [c for c in client.calls if c[0].session_id == b.id]
        assert len(calls_a) == len(runs[0]["replies"]) >= 3 and len(calls_b) == len(runs[1]["replies"]) >= 2
        chat = ChatTemplate(tok, tools=TOOLS)
        for run, calls in ((runs[0], calls_a), (runs[1], calls_b)):
            messages = run["messages"]
            assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            assert calls[0][0].input_ids == chat.prompt_ids(template_form(messages[: assistant_at[0]]))
            for (req, res), i, reply in zip(calls, assistant_at, run["replies"], strict=True):
                # the text of every prompt is the template's rendering of the conversation the agent sent,
                # while its model regions are the engine's own ids (checked in check_alignment)
                assert tok.decode(req.input_ids) == chat.render(template_form(messages[:i]), add_generation_prompt=True)
                assert [c.logprob for c in reply["logprobs"]] == res.logprobs
        # edit the first reply of session a: the session branches from its root
        edited = json.loads(json.dumps(runs[0]["messages"][:4]))
        edited[2]["content"] = "I edited this."
        oa = openai.AsyncOpenAI(base_url=a.base_url, api_key="x", max_retries=0)
        await oa.chat.completions.create(model=gw.model_name, messages=edited, max_tokens=8, seed=5)
        await oa.close()
        gw.finish(a.id, reward=1.0)
        gw.finish(b.id, reward=0.0)
        trajs = await collect(gw, 3)
    by_id = {t.id: t for t in trajs}
    check_alignment(by_id[f"{a.id}.b0"], calls_a)
    check_alignment(by_id[b.id], calls_b)
    branch = by_id[f"{a.id}.b1"]
    [(req, res)] = [c for c in client.calls if c[0].session_id == a.id][len(calls_a) :]
    check_alignment(branch, [(req, res)])
    assert req.input_ids == ChatTemplate(tok).prompt_ids(edited)  # that call sent no tools
    assert all(lp < 0 for t in trajs for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)


# -- a real agent framework ------------------------------------------------------------------------------


def agents_sdk_and_add_tool() -> tuple[Any, Any]:
    """The OpenAI Agents SDK (the test is skipped without it), tracing off, and an ``add`` function tool."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return agents, add


async def test_openai_agents_sdk_drives_a_rollout_end_to_end(fake_servers, tok) -> None:
    agents, add = agents_sdk_and_add_tool()
    script = Script(tok, [call("add", a=20, b=22), "The sum is 42."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        agent = agents.Agent(
            name="calc",
            instructions="Add numbers with the tool.",
            tools=[add],
            model=agents.OpenAIChatCompletionsModel(model=gw.model_name, openai_client=oa),
        )
        result = await agents.Runner.run(agent, "What is 20+22?")
        await oa.close()
        assert result.final_output == "The sum is 42."
        gw.reward(s.id, 1.0)
        [traj] = await collect(gw, 1)
    assert len(client.calls) == 2
    check_alignment(traj, client.calls)
    assert [[c.name for c in t.tool_calls] for t in traj.turns] == [["add"], []]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(traj.response_ids)
    assert traj.metrics["branches"] == 1.0 and traj.reward == 1.0


# -- sampling, stop strings, completions -------------------------------------------------------------


async def test_sampling_fields_reach_the_engine(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["one two three"])) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "count"}]
        await oa.chat.completions.create(
            model=gw.model_name,
            messages=msgs,
            temperature=0.5,
            top_p=0.9,
            max_completion_tokens=7,
            seed=11,
            frequency_penalty=0.25,
            presence_penalty=-0.5,
            extra_body={"top_k": 5, "min_p": 0.1},
        )
        await oa.chat.completions.create(model=gw.model_name, messages=msgs, max_tokens=3, temperature=0)
        await oa.close()
    (first, _), (second, _) = client.calls
    sp = first.sampling
    assert (sp.temperature, sp.top_p, sp.max_new_tokens, sp.seed, sp.top_k, sp.min_p) == (0.5, 0.9, 7, 11, 5, 0.1)
    assert (sp.frequency_penalty, sp.presence_penalty) == (0.25, -0.5)
    assert second.sampling.max_new_tokens == 3 and second.sampling.greedy
    assert first.return_logprobs  # the trainer gets logprobs whether the agent asked or not


async def test_stop_strings_cut_the_turn_at_the_token_that_completes_them(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["alpha beta END gamma delta"])) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        r = await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "go"}], stop=["END"]
        )
        await oa.close()
        assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    [(_, res)] = client.calls
    kept = model_runs(traj)[0]
    assert kept == res.output_ids[: len(kept)] and tok.decode(kept).endswith("END")
    assert traj.logprobs == (res.logprobs or [])[: len(kept)]


async def test_text_completions_reuse_the_served_ids(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        r1 = await oa.completions.create(model=gw.model_name, prompt="Once upon", max_tokens=4, logprobs=1)
        text = r1.choices[0].text
        assert r1.choices[0].logprobs is not None and len(r1.choices[0].logprobs.token_logprobs or []) == 4
        await oa.completions.create(model=gw.model_name, prompt="Once upon" + text + " then", max_tokens=2)
        ids = client.calls[1][0].input_ids + client.calls[1][1].output_ids  # token-id prompts continue too
        await oa.completions.create(model=gw.model_name, prompt=[*ids, 42], max_tokens=2)
        await oa.close()
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    (q1, a1), (q2, _), (q3, _) = client.calls
    assert q2.input_ids[: len(q1.input_ids) + 4] == q1.input_ids + a1.output_ids  # never re-tokenized
    assert q2.input_ids[len(q1.input_ids) + 4 :] == tok.encode(" then", add_special_tokens=False)
    assert q3.input_ids == [*ids, 42]
    assert len(traj.turns) == 3 and traj.metrics["branches"] == 1.0
    check_alignment(traj, client.calls)


# -- rewards, trajectories, JSONL --------------------------------------------------------------------------


async def test_reward_endpoint_and_jsonl(fake_servers, tok, tmp_path: Path) -> None:
    path = tmp_path / "trajs.jsonl"
    async with gateway_on(fake_servers, tok, Script(tok, ["hello"]), trajectories_jsonl=str(path)) as (gw, _):
        root = gw.url.removesuffix("/v1")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{root}/v1/sessions", json={"metadata": {"sample": 3}}) as r:
                assert r.status == 201
                created = await r.json()
            oa = openai.AsyncOpenAI(base_url=gw.url, api_key=created["api_key"], max_retries=0)
            await oa.chat.completions.create(model=gw.model_name, messages=[{"role": "user", "content": "hi"}])
            await oa.close()
            async with http.get(f"{root}/v1/sessions/{created['id']}") as r:
                info = await r.json()
                assert info["turns"] == 1 and info["metadata"] == {"sample": 3}
            async with http.post(f"{root}/v1/sessions/{created['id']}/reward", json={"reward": 2.5}) as r:
                assert r.status == 200 and (await r.json())["finished"] is True
            async with http.post(f"{root}/v1/sessions/{created['id']}/reward", json={"reward": "high"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "reward"
        with pytest.raises(Exception, match="trajectories_jsonl"):
            await anext(gw.trajectories())
    [traj] = read_trajectories(path)  # the gateway drains its writer on close
    assert traj.id == created["id"] and traj.reward == 2.5 and sum(traj.loss_mask) == len(tok.encode("hello")) + 1


async def test_closing_finishes_open_sessions_and_ends_the_iterator(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["x"])) as (gw, _):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        await oa.chat.completions.create(model=gw.model_name, messages=[{"role": "user", "content": "hi"}])
        await oa.close()
        it = gw.trajectories()
    trajs = [t async for t in it]
    assert [t.id for t in trajs] == [s.id]


# -- bad input -----------------------------------------------------------------------------------------


async def test_bad_input_gets_openai_shaped_4xx_and_the_gateway_keeps_serving(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"]), max_n=4, max_body_bytes=64 * 1024) as (gw, client):
        s = gw.session()
        url = f"{s.base_url}/chat/completions"
        good = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}
        cases: list[tuple[Any, int, str | None, str | None]] = [
            (b"{not json", 400, None, "invalid_json"),
            (b"[1, 2]", 400, None, "invalid_json"),
            ({**good, "model": "gpt-9"}, 404, "model", "model_not_found"),
            ({"model": gw.model_name}, 400, "messages", "missing_required_parameter"),
            ({**good, "messages": []}, 400, "messages", None),
            ({**good, "n": 5}, 400, "n", None),
            ({**good, "n": "two"}, 400, "n", None),
            ({**good, "temperature": -1}, 400, "temperature", None),
            ({**good, "top_p": 0}, 400, "top_p", None),
            ({**good, "max_tokens": 0}, 400, "max_tokens", None),
            ({**good, "max_tokens": 10**9}, 400, "messages", "context_length_exceeded"),
            ({**good, "seed": -3}, 400, "seed", None),
            ({**good, "stop": [""]}, 400, "stop[0]", None),
            ({**good, "logit_bias": {"1": 5}}, 400, "logit_bias", "unsupported_parameter"),
            ({**good, "top_logprobs": 3, "logprobs": True}, 400, "top_logprobs", "unsupported_parameter"),
            ({**good, "frobnicate": 1}, 400, "frobnicate", "unsupported_parameter"),
            ({**good, "tool_choice": "required", "tools": TOOLS}, 400, "tool_choice", "unsupported_parameter"),
            ({**good, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type", "unsupported_parameter"),
            ({**good, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
            (
                {**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                400,
                "messages[0].content[0]",
                None,
            ),
            (
                {
                    **good,
                    "messages": [
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                        }
                    ],
                },
                400,
                "messages[0].tool_calls[0].function.arguments",
                None,
            ),
            ({**good, "response_format": {"type": "json_object"}}, 400, "response_format", None),
            (b"x" * (65 * 1024), 413, None, "request_too_large"),
        ]
        async with aiohttp.ClientSession() as http:
            for body, status, param, code in cases:
                kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
                async with http.post(url, **kw) as r:
                    err = (await r.json())["error"]
                    assert (r.status, err["param"], r.content_type) == (status, param, "application/json"), (body, err)
                    assert code is None or err["code"] == code, (body, err)
                    assert err["message"] and err["type"]
            async with http.post(f"{gw.url}/chat/completions", json=good) as r:  # no session key at all
                assert r.status == 401
            async with http.get(f"{gw.url}/nope") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
            async with http.get(f"{gw.url}/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == [gw.model_name]
            async with http.post(url, json=good) as r:  # still serving
                assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "ok"
            gw.finish(s.id)
            async with http.post(url, json=good) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "session_finished"
            async with http.get(f"{gw.url.removesuffix('/v1')}/health") as r:
                assert (await r.json())["status"] == "ok"
        oa = openai.AsyncOpenAI(base_url=gw.url, api_key="new-session", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await oa.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="n must be"):
            await oa.chat.completions.create(model=gw.model_name, messages=[{"role": "user", "content": "x"}], n=99)
        await oa.close()
    assert len(client.calls) == 1  # no bad request reached the engine


async def test_session_bound_is_a_429_until_the_trainer_collects(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"]), max_sessions=2) as (gw, _):
        a, _b = gw.session(), gw.session()
        msgs = [{"role": "user", "content": "x"}]
        oa = openai.AsyncOpenAI(base_url=a.base_url, api_key="x", max_retries=0)
        await oa.chat.completions.create(model=gw.model_name, messages=msgs)
        third = openai.AsyncOpenAI(base_url=gw.url, api_key="third", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await third.chat.completions.create(model=gw.model_name, messages=msgs)
        gw.finish(a.id)
        with pytest.raises(openai.RateLimitError):  # finished but not collected: still counted
            await third.chat.completions.create(model=gw.model_name, messages=msgs)
        assert [t.id for t in await collect(gw, 1)] == [a.id]
        await third.chat.completions.create(model=gw.model_name, messages=msgs)
        with pytest.raises(openai.ConflictError):  # a collected session's id stays refused
            await oa.chat.completions.create(model=gw.model_name, messages=msgs)
        await oa.close()
        await third.close()


async def test_500_concurrent_sessions_on_cpu_fakes(fake_servers, tok) -> None:
    script = Script(tok, [call("add", a=1, b=2), "3"])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        handles = [gw.session() for _ in range(500)]
        # one process plays 500 agents: the clients' own work slows connects past openai's 5 s default
        shared = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=300)
        # 500 agents' sockets plus the gateway's 500 pass a 1024 open-file limit (CI's soft limit): raise it
        # to the hard limit, and where that is still short, let at most 200 agents hold a request at once
        # (the 500 sessions stay open side by side either way)
        in_flight = asyncio.Semaphore(500 if raise_open_file_limit(4096) >= 4096 else 200)

        async def one(h: Any) -> None:
            async with in_flight:
                await two_turns(h)

        async def two_turns(h: Any) -> None:
            oa = shared.with_options(api_key=h.api_key)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"1+2? ({h.id})"}]
            r = await oa.chat.completions.create(model=gw.model_name, messages=msgs, tools=TOOLS)
            m = r.choices[0].message
            assert m.tool_calls
            msgs += [
                m.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"},
            ]
            r = await oa.chat.completions.create(model=gw.model_name, messages=msgs, tools=TOOLS)
            assert r.choices[0].message.content == "3"
            gw.reward(h.id, 1.0)

        await asyncio.gather(*(one(h) for h in handles))
        await shared.close()
        trajs = await collect(gw, 500)
    assert sorted(t.id for t in trajs) == sorted(h.id for h in handles)
    by_session: dict[str, list[tuple[GenerateRequest, GenerateResult]]] = {}
    for req, res in client.calls:
        by_session.setdefault(req.session_id or "", []).append((req, res))
    for t in trajs:
        assert len(t.turns) == 2 and t.metrics["branches"] == 1.0
        check_alignment(t, by_session[t.id])


async def test_a_client_that_disconnects_aborts_its_generation_and_records_nothing(fake_servers, tok) -> None:
    gate = asyncio.Event()
    servers = await fake_servers(1, QWEN, responder=Script(tok, ["late"]), gate=gate)
    engine = servers[0].engine
    async with RolloutClient(servers=[servers[0].address]) as client, Gateway(client, tokenizer=tok) as gw:
        s = gw.session()
        body = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(http.post(f"{s.base_url}/chat/completions", json=body))
            await wait_for(lambda: len(engine.requests_seen) == 1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await wait_for(lambda: len(engine.aborted_rids) == 1)
        assert gw.get_session(s.id).num_turns == 0
        gate.set()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        r = await oa.chat.completions.create(**body)
        await oa.close()
        assert r.choices[0].message.content == "late" and gw.get_session(s.id).num_turns == 1


def raise_open_file_limit(want: int) -> int:
    """Raise this process's soft open-file limit toward ``want`` (never above the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


async def wait_for(cond: Callable[[], bool], timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def test_cli_gateway_prints_ready_and_stops_on_sigterm(spawn_server, sdk_home: Path, tmp_path: Path) -> None:
    import os
    import urllib.request

    from conftest import _wait_ready, start_cli

    server = spawn_server("--engine", "fake")
    addr_file = tmp_path / "gw.url"
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home), PYTHONUNBUFFERED="1")
    proc = start_cli(
        "gateway", "--servers", server.address, "--address-file", str(addr_file), "--model-name", "policy", env=env
    )
    try:
        url = _wait_ready(proc, 120)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert addr_file.read_text() == url
        with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "policy"
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_gateway_trainer_example_runs_a_step_on_policy(sdk_home: Path, tiny_model: Path) -> None:
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gateway_trainer.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("SUMMARY ")]
    summary = json.loads(line.removeprefix("SUMMARY "))
    assert summary["trajectories"] == 6 and summary["turns"] == 2
    assert summary["logprob_gap"] < 1e-4  # the trainer's logprobs of the captured tokens are the engine's
    assert summary["weight_version"] == 1  # step 1's rollouts ran on the weights pushed after step 0


async def test_a_trainer_pause_mid_turn_is_continued_across_a_weight_update(fake_servers, tok) -> None:
    """pause(abort) returns the turn's tokens so far; the gateway continues it after resume, on v5."""
    words = " ".join(f"w{i}" for i in range(30))
    target = [*tok.encode(words, add_special_tokens=False), IM_END]
    first: list[int] = []

    def responder(req: GenerateRequest) -> list[int]:  # a continuation's prompt ends with the tokens so far
        first.append(first[0] if first else len(req.input_ids))
        return target[len(req.input_ids) - first[0] :]

    servers = await fake_servers(1, FakeEngineConfig(eos_token_ids=(IM_END,), step_base_s=0.005), responder=responder)
    engine = servers[0].engine
    async with RolloutClient(servers=[servers[0].address]) as client, Gateway(client, tokenizer=tok) as gw:
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        task = asyncio.create_task(
            oa.chat.completions.create(
                model=gw.model_name, messages=[{"role": "user", "content": "count"}], max_tokens=200
            )
        )
        await wait_for(lambda: any(len(r.out) >= 3 for r in engine._reqs.values()))
        await client.pause("abort")
        await client.set_weight_version(5)
        await client.resume()
        r = await task
        await oa.close()
        assert r.choices[0].message.content == words
        gw.finish(s.id)
        [traj] = await collect(gw, 1)
    assert model_runs(traj) == [target]  # one turn, the engine's exact tokens, across the abort
    (v0, n0), (v1, n1) = traj.weight_versions
    assert (v0, v1) == (0, 5) and n0 >= 3 and n0 + n1 == len(target)
    assert len(engine.aborted_rids) == 1


@pytest.mark.parametrize("indent", [None, 2])
def test_re_serialised_tool_arguments_match_what_was_served(indent: int | None) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from rollout_sdk.gateway.sessions import prefix_keys
    from rollout_sdk.gateway.tools import canonical, template_messages

    scalars = st.one_of(st.integers(-(10**6), 10**6), st.text(max_size=8), st.booleans(), st.none())
    args_st = st.dictionaries(
        st.text(min_size=1, max_size=6), st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=4
    )

    @settings(max_examples=60, deadline=None)
    @given(args_st, st.text(max_size=20))
    def prop(args: dict[str, Any], content: str) -> None:
        served = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}
            ],
        }
        items = list(args.items())[::-1]  # the client re-serialises: other key order and whitespace
        resent = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": json.dumps(dict(items), indent=indent, separators=None)},
                }
            ],
        }
        user = {"role": "user", "content": "q"}
        a = [canonical(m) for m in template_messages([user, served], max_messages=8)]
        b = [canonical(m) for m in template_messages([user, resent], max_messages=8)]
        assert prefix_keys("k", a) == prefix_keys("k", b)
        if args:  # a changed argument value is a different conversation
            changed = dict(args, **{next(iter(args)): "something else entirely"})
            if changed != args:
                resent["tool_calls"][0]["function"]["arguments"] = json.dumps(changed)
                c = [canonical(m) for m in template_messages([user, resent], max_messages=8)]
                assert prefix_keys("k", c)[-1] != prefix_keys("k", a)[-1]
                assert prefix_keys("k", c)[1] == prefix_keys("k", a)[1]

    prop()
