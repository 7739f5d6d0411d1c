"""Multi-turn agent rollouts over real servers with a scriptable engine that emits exact token sequences."""

from __future__ import annotations

import asyncio
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
