"""Multi-turn agent rollouts over real servers with a scriptable engine that emits exact token sequences."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.agents import (
    AgentConfig,
    RolloutContext,
    TemplateError,
    ToolAgent,
    ToolRegistry,
    rollout_group,
    tool,
)
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.protocol import GenerateRequest

IM_END = 151645
QWEN = FakeEngineConfig(eos_token_ids=(IM_END,))


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def registry() -> ToolRegistry:
    reg = ToolRegistry()

    @reg.register
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @reg.register
    def mul(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @reg.register
    @tool(timeout_s=0.2)
    async def hang(seconds: float) -> str:
        """Sleep for a long time."""
        await asyncio.sleep(seconds)
        return "woke"

    @reg.register
    async def slow(x: int) -> int:
        """Sleep 50 ms."""
        await asyncio.sleep(0.05)
        return x

    return reg


def call(name: str, **args: object) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


class Script:
    """Answer turn k of a conversation with ``turns[k]`` (the k-th assistant turn), as exact tokens."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok = tok
        self.turns = turns
        self.outputs: list[list[int]] = [[*tok.encode(t, add_special_tokens=False), IM_END] for t in turns]
        self.seen: list[str] = []

    def __call__(self, req: GenerateRequest) -> list[int]:
        text = self.tok.decode(req.input_ids)
        self.seen.append(text)
        k = text.count("<|im_start|>assistant") - 1
        return self.outputs[min(k, len(self.outputs) - 1)]


async def _client(fake_servers, responder: Callable) -> tuple[RolloutClient, list]:
    servers = await fake_servers(1, QWEN, responder=responder)
    return RolloutClient(servers=[s.address for s in servers]), servers


USER = {"messages": [{"role": "user", "content": "What is (1+2)*4?"}]}


async def test_three_turns_two_tool_calls_align_token_for_token(fake_servers, tok) -> None:
    script = Script(tok, [call("add", a=1, b=2), call("mul", a=3, b=4), "The answer is 12."])
    client, _ = await _client(fake_servers, script)
    agent = ToolAgent(tok, registry(), AgentConfig(drift_check=True))
    async with client:
        traj = await agent.run(RolloutContext(client), USER)
    assert traj.finish_reason == "stop"
    assert [len(t.tool_calls) for t in traj.turns] == [1, 1, 0]
    assert [c.name for t in traj.turns for c in t.tool_calls] == ["add", "mul"]
    assert all(c.ok for t in traj.turns for c in t.tool_calls)
    n = len(traj.response_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == n
    # the model's tokens are exactly what the engine emitted, in order, and nothing else has mask 1
    pairs = zip(traj.response_ids, traj.loss_mask, strict=True)
    spans = [(m, [t for t, _ in g]) for m, g in itertools.groupby(pairs, key=lambda p: p[1])]
    runs = [ids for m, ids in spans if m]
    masked_runs = [ids for m, ids in spans if not m]
    assert runs == script.outputs
    # logprobs: the engine's where mask is 1, exactly 0 elsewhere
    assert all((lp != 0.0) == bool(m) for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True))
    # the tokens between model turns are the template's rendering of the tool results
    glue = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(masked_runs[0]) == glue
    assert "<tool_response>\n12\n</tool_response>" in tok.decode(masked_runs[1])
    # and the whole thing equals a fresh rendering of the conversation: no drift
    assert traj.drift is None
    rendered = tok.encode(agent.chat.render(traj.messages, add_generation_prompt=False), add_special_tokens=False)
    assert traj.ids == rendered[: len(traj.ids)]
    assert traj.metrics["tool_calls"] == 2
    assert traj.weight_versions == [(0, sum(traj.loss_mask))]


MALFORMED = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', "bad_json", "JSON"),
    ("<tool_call>\n[1, 2, 3]\n</tool_call>", "not_object", "object"),
    ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "missing_name", "name"),
    ('<tool_call>\n{"name": "add", "arguments": 7}\n</tool_call>', "bad_arguments_type", "arguments"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "unclosed_tag", "</tool_call>"),
    (call("divide", a=1, b=2), "unknown_tool", "divide"),
    (call("add", a=1, b="two"), "bad_arguments", "b"),
    (call("add", a=1), "bad_arguments", "b"),
]


@pytest.mark.parametrize(("bad", "kind", "needle"), MALFORMED)
async def test_malformed_calls_are_fed_back_and_the_trajectory_continues(fake_servers, tok, bad, kind, needle) -> None:
    script = Script(tok, [bad, "Sorry, the answer is 12."])
    client, _ = await _client(fake_servers, script)
    reg = registry()
    agent = ToolAgent(tok, reg, AgentConfig(drift_check=True))
    async with client:
        traj = await agent.run(RolloutContext(client), USER)
    assert traj.finish_reason == "stop"
    assert len(traj.turns) == 2  # the loop went on after the bad call
    feedback = script.seen[1].split("<|im_start|>user")[-1]  # what the model was shown after its bad turn
    assert "<tool_response>" in feedback
    assert needle in feedback, feedback
    first = traj.turns[0]
    if kind in ("unknown_tool", "bad_arguments"):
        assert [c.error_kind for c in first.tool_calls] == [kind]
        assert reg.stats()["errors"][kind] == 1
    else:
        assert first.parse_errors and not first.tool_calls
    assert traj.metrics["tool_errors"] + traj.metrics["parse_errors"] == 1
    assert traj.drift is None  # the malformed text stays in the recorded message: re-rendering gives the same tokens


async def test_a_valid_call_next_to_a_malformed_one_still_runs(fake_servers, tok) -> None:
    script = Script(tok, [call("add", a=2, b=2) + "\n<tool_call>\nnot json\n</tool_call>", "Done."])
    client, _ = await _client(fake_servers, script)
    async with client:
        traj = await ToolAgent(tok, registry()).run(RolloutContext(client), USER)
    assert [c.name for c in traj.turns[0].tool_calls] == ["add"]
    assert len(traj.turns[0].parse_errors) == 1
    assert "<tool_response>\n4\n</tool_response>" in script.seen[1]


async def test_a_hanging_tool_is_cut_at_its_timeout(fake_servers, tok) -> None:
    script = Script(tok, [call("hang", seconds=3600), "It took too long."])
    client, _ = await _client(fake_servers, script)
    async with client:
        t0 = time.perf_counter()
        traj = await ToolAgent(tok, registry()).run(RolloutContext(client), USER)
        elapsed = time.perf_counter() - t0
    assert elapsed < 3.0
    assert traj.turns[0].tool_calls[0].error_kind == "timeout"
    assert "timed out" in script.seen[1]
    assert traj.finish_reason == "stop"


async def test_1000_concurrent_trajectories_overlap_their_tool_calls(fake_servers, tok) -> None:
    script = Script(tok, [call("slow", x=1), "ok"])
    client, _ = await _client(fake_servers, script)
    agent = ToolAgent(tok, registry(), AgentConfig(keep_messages=False))
    async with client:
        t0 = time.perf_counter()
        trajs = await asyncio.gather(*(agent.run(RolloutContext(client), USER) for _ in range(1000)))
        elapsed = time.perf_counter() - t0
    assert all(t.finish_reason == "stop" and len(t.turns) == 2 for t in trajs)
    assert elapsed < 0.5 * 1000 * 0.05  # sequential tool time would be 50 s
    print(f"1000 trajectories x 1 tool call of 50 ms: {elapsed:.2f}s")


async def test_budgets_end_the_trajectory(fake_servers, tok) -> None:
    script = Script(tok, [call("add", a=1, b=1)] * 10)
    client, _ = await _client(fake_servers, script)
    async with client:
        t = await ToolAgent(tok, registry(), AgentConfig(max_turns=3)).run(RolloutContext(client), USER)
        assert (t.finish_reason, len(t.turns)) == ("max_turns", 3)
        t = await ToolAgent(tok, registry(), AgentConfig(max_response_tokens=40)).run(RolloutContext(client), USER)
        assert t.finish_reason == "budget"
        assert len(t.response_ids) <= 40


NOT_APPEND_ONLY = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}[earlier reply hidden]{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_drift_check_catches_a_template_that_rewrites_earlier_turns(fake_servers, tok) -> None:
    import copy

    odd = copy.deepcopy(tok)
    odd.chat_template = NOT_APPEND_ONLY
    script = Script(tok, [call("add", a=1, b=2), "Three."])
    client, _ = await _client(fake_servers, script)
    reg = registry()
    async with client:
        traj = await ToolAgent(odd, reg, AgentConfig(drift_check=True)).run(RolloutContext(client), USER)
        assert traj.template_rewrites
        assert traj.drift is not None and "drift" in traj.drift
        with pytest.raises(TemplateError, match="not append-only"):
            await ToolAgent(odd, reg, AgentConfig(template_strategy="strict")).run(RolloutContext(client), USER)


async def test_group_rewards_arrive_per_trajectory(fake_servers, tok) -> None:
    script = Script(tok, ["The answer is 12."])
    client, _ = await _client(fake_servers, script)
    done_order: list[str] = []

    async def reward(traj, sample) -> float:
        done_order.append(traj.id)
        return 1.0 if "12" in tok.decode(traj.response_ids) else 0.0

    async with client:
        agent = ToolAgent(tok, registry())
        group = await rollout_group(client, agent, USER, group_size=4, reward=reward, sample_index=7)
    assert [t.reward for t in group] == [1.0] * 4
    assert {t.sample_index for t in group} == {7}
    assert len(done_order) == 4
    assert len({t.id for t in group}) == 4


async def test_end_to_end_on_the_cpu_engine(tiny_model, tok) -> None:
    """The real tiny model, real tokenizer and chat template: invariants hold whatever it says."""
    from rollout_sdk import CpuEngineConfig

    agent = ToolAgent(
        tok, registry(), AgentConfig(max_turns=2, max_new_tokens=24, sampling=SamplingParams(seed=3), drift_check=True)
    )
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tiny_model))) as client:
        group = await rollout_group(client, agent, USER, group_size=3, reward=lambda t, s: float(len(t.turns)))
    for t in group:
        assert t.finish_reason in ("stop", "length", "budget", "max_turns")
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
        assert t.ids[: len(t.prompt_ids)] == agent.chat.prompt_ids(USER["messages"])
        assert all(lp < 0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
        assert t.reward == float(len(t.turns))


def test_render_parses_openai_string_arguments_like_objects(tok) -> None:
    from rollout_sdk.agents import ChatTemplate

    def history(arguments: object) -> list[dict]:
        call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": arguments}}
        return [
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": "3"},
        ]

    chat = ChatTemplate(tok, tools=registry().schemas())
    as_dict = chat.render(history({"a": 1, "b": 2}), add_generation_prompt=True)
    as_string = chat.render(history('{"a": 1, "b": 2}'), add_generation_prompt=True)
    assert as_string == as_dict
    assert '"arguments": {"a": 1, "b": 2}' in as_dict
    messages = history('{"a": 1}')
    chat.render(messages, add_generation_prompt=True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's list is untouched


async def test_no_drift_reported_when_a_trajectory_ends_on_added_glue(fake_servers, tok) -> None:
    """Stopped at max_turns (or stale, or over budget) right after the loop added tool results."""
    script = Script(tok, [call("add", a=1, b=2)] * 3)
    client, _ = await _client(fake_servers, script)
    async with client:
        traj = await ToolAgent(tok, registry(), AgentConfig(max_turns=2, drift_check=True)).run(
            RolloutContext(client), USER
        )
    assert traj.finish_reason == "max_turns"
    assert traj.loss_mask[-1] == 0  # it ends on glue
    assert traj.drift is None


async def test_tool_results_and_parse_errors_reach_the_model_in_text_order(fake_servers, tok) -> None:
    turn = "<tool_call>\n{bad\n</tool_call>" + call("add", a=1, b=2) + "<tool_call>\n[]\n</tool_call>"
    script = Script(tok, [turn, "Done."])
    client, _ = await _client(fake_servers, script)
    async with client:
        traj = await ToolAgent(tok, registry()).run(RolloutContext(client), USER)
    tools = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["name"] for m in tools] == ["error", "add", "error"]
    assert "bad_json" in tools[0]["content"] and tools[1]["content"] == "3" and "not_object" in tools[2]["content"]


# -- issue 29: blocks with extra text, turns cut inside a call, reasoning, other formats -------------


def recording_registry(calls: list[dict]) -> ToolRegistry:
    reg = registry()

    @reg.register
    async def write_file(path: str, content: str) -> str:
        """Write a file."""
        calls.append({"path": path, "content": content})
        return "written"

    return reg


async def test_a_block_with_one_brace_too_many_runs_nothing(fake_servers, tok) -> None:
    """The extra brace may mean the model's value was cut short: the write must not happen."""
    bad = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "content": "hel"}}}\n</tool_call>'
    script = Script(tok, [bad, "Done."])
    client, _ = await _client(fake_servers, script)
    written: list[dict] = []
    async with client:
        traj = await ToolAgent(tok, recording_registry(written), AgentConfig(drift_check=True)).run(
            RolloutContext(client), USER
        )
    assert written == []
    assert traj.turns[0].tool_calls == []
    [error] = traj.turns[0].parse_errors
    assert "Extra data" in error
    assert "Extra data" in script.seen[1].split("<|im_start|>user")[-1]  # the model is told why
    assert traj.finish_reason == "stop"
    assert traj.drift is None


async def test_a_turn_cut_inside_a_tool_call_keeps_the_model_text_and_no_drift(fake_servers, tok) -> None:
    full = "Let me add.\n" + call("add", a=1, b=2)
    script = Script(tok, [full])
    cut_at = len(script.outputs[0]) - 6  # inside the call's JSON, before </tool_call>
    client, _ = await _client(fake_servers, script)
    reg = registry()
    cfg = AgentConfig(drift_check=True, max_new_tokens=cut_at)
    async with client:
        traj = await ToolAgent(tok, reg, cfg).run(RolloutContext(client), USER)
    assert traj.finish_reason == "length"
    model_text = tok.decode(script.outputs[0][:cut_at])
    assert "</tool_call>" not in model_text and "<tool_call>" in model_text
    assert traj.messages[-1] == {"role": "assistant", "content": model_text}  # the partial call, as content
    [error] = traj.turns[0].parse_errors  # with its error
    assert "no matching </tool_call>" in error
    assert reg.stats()["calls"] == 0  # a cut turn runs nothing
    assert traj.drift is None


async def test_calls_drafted_while_thinking_never_run(fake_servers, tok) -> None:
    draft = call("write_file", path="x", content="draft")
    turn = f"<think>\nI could {draft} but no.\n</think>\n\n" + call("add", a=2, b=3)
    written: list[dict] = []
    for reasoning in ("think", "none"):
        script = Script(tok, [turn, "Five."])
        client, _ = await _client(fake_servers, script)
        cfg = AgentConfig(reasoning_parser=reasoning, drift_check=True)
        async with client:
            traj = await ToolAgent(tok, recording_registry(written), cfg).run(RolloutContext(client), USER)
        # "none" hands the whole text to the Hermes parser, which skips <think> blocks itself
        assert written == []
        assert [c.name for c in traj.turns[0].tool_calls] == ["add"]
        assert traj.messages[1]["content"].startswith("<think>\nI could <tool_call>")  # reasoning is recorded
        assert "<tool_response>\n5\n</tool_response>" in script.seen[1]
        # reasoning tokens are the model's own output: trained like any output token (mask 1)
        assert sum(traj.loss_mask) == sum(len(o) for o in script.outputs)


async def test_qwen3_coder_format_with_typed_parameters(fake_servers, tok) -> None:
    params = "<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
    xml = f"<tool_call>\n<function=add>\n{params}</function>\n</tool_call>"
    draft = xml.replace("add", "mul")
    script = Script(tok, [f"<think>{draft}</think>{xml}", "Five."])
    client, _ = await _client(fake_servers, script)
    async with client:
        traj = await ToolAgent(tok, registry(), AgentConfig(parser="qwen3_coder")).run(RolloutContext(client), USER)
    assert [(c.name, c.arguments, c.ok) for c in traj.turns[0].tool_calls] == [("add", {"a": 2, "b": 3}, True)]
    assert "<tool_response>\n5\n</tool_response>" in script.seen[1]


async def test_a_parse_error_shows_the_configured_format(fake_servers, tok) -> None:
    script = Script(tok, ["<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>", "Sorry."])
    client, _ = await _client(fake_servers, script)
    async with client:
        traj = await ToolAgent(tok, registry(), AgentConfig(parser="qwen3_coder")).run(RolloutContext(client), USER)
    assert traj.turns[0].parse_errors
    feedback = script.seen[1].split("<|im_start|>user")[-1]
    assert "<function=TOOL_NAME>" in feedback and "</parameter>" in feedback


def test_unknown_parser_names_are_config_errors() -> None:
    from rollout_sdk.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parser='qwen4'.*known: .*hermes, .*llama3_json, mistral"):
        AgentConfig(parser="qwen4")
    with pytest.raises(ConfigError, match=r"reasoning_parser='deep'.*known: harmony, none, think"):
        AgentConfig(reasoning_parser="deep")


async def test_every_turn_asks_the_engine_to_keep_the_session_and_the_end_releases_it(fake_servers, tok) -> None:
    """Issue 40: a tool call follows a turn, so each turn carries ``keep_kv_s``; when the trajectory ends
    the agent tells the engine (its kept KV goes now, not at the lease's end)."""
    script = Script(tok, [call("add", a=1, b=2), call("mul", a=3, b=4), "The answer is 12."])
    config = dataclasses.replace(QWEN, kv_capacity_tokens=1 << 20, prefix_cache=True, step_base_s=0.001)
    servers = await fake_servers(1, config, responder=script)
    engine = servers[0].engine
    async with RolloutClient(servers=[servers[0].address]) as client:
        ctx = RolloutContext(client)
        traj = await ToolAgent(tok, registry(), AgentConfig(keep_kv_s=30.0)).run(ctx, USER)
        assert traj.finish_reason == "stop"
        turns = [r for r in engine.requests_seen if r.session_id == ctx.session_id]
        assert [r.keep_kv_s for r in turns] == [30.0, 30.0, 30.0]
        assert engine.sessions.admitted == 1  # kept from its first turn ...
        assert engine.sessions.kept == 0 and engine.pinned_sessions == []  # ... and released at its end
        script.seen.clear()
        no_keep = await ToolAgent(tok, registry(), AgentConfig(keep_kv_s=None)).run(RolloutContext(client), USER)
        assert no_keep.finish_reason == "stop"
        assert all(r.keep_kv_s is None for r in list(engine.requests_seen)[len(turns) :])
    from rollout_sdk.errors import ConfigError

    with pytest.raises(ConfigError, match="keep_kv_s"):
        AgentConfig(keep_kv_s=0.0)


async def test_think_tags_in_arguments_run_whole_and_ids_are_unique_per_trajectory(fake_servers, tok) -> None:
    """Issue 42: with the default ``think`` reasoning parser a call whose argument holds ``</think>`` or
    ``<think>`` runs with its argument whole; call ids do not repeat from one turn to the next."""
    content = "a </think> b <think> c"
    script = Script(tok, [call("write_file", path="x", content=content), call("add", a=1, b=2), "Done."])
    client, _ = await _client(fake_servers, script)
    written: list[dict] = []
    async with client:
        traj = await ToolAgent(tok, recording_registry(written), AgentConfig(drift_check=True)).run(
            RolloutContext(client), USER
        )
    assert written == [{"path": "x", "content": content}]
    assert traj.drift is None
    ids = [c["id"] for m in traj.messages for c in m.get("tool_calls", [])]
    assert ids == ["call_0", "call_1"]
    assert [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"] == ids
