"""The tool model (trained locally on first use) and its cache: real tool calls through ToolAgent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_sdk import RolloutClient
from rollout_sdk.engines.cpu import CpuEngineConfig
from rollout_sdk.models._cache import _umask
from rollout_sdk.tasks import calculator as tool_task

_BUILDER = """
import pathlib, sys
from rollout_sdk.models._cache import build_once
dest, log = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def build(tmp):
    with open(log, "a") as f:
        f.write("built\\n")
    (tmp / "sub").mkdir()
    (tmp / "sub" / "part.bin").write_bytes(b"x" * 1000)
    (tmp / "model.safetensors").write_bytes(b"weights")
    (tmp / "model.safetensors").chmod(0o600)
print(build_once(dest, build))
"""


def test_concurrent_first_use_builds_once_and_publishes_whole(tmp_path: Path) -> None:
    dest = tmp_path / "models" / "m"
    log = tmp_path / "log"
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILDER, str(dest), str(log)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert outs == [str(dest)] * 4
    assert log.read_text() == "built\n"  # one build; the others waited on the lock and reused it
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m", "m.lock"]  # no temporary directory left
    umask = _umask()
    assert (dest / "model.safetensors").stat().st_mode & 0o777 == 0o644 & ~umask
    assert (dest / "sub").stat().st_mode & 0o777 == 0o755 & ~umask
    assert dest.stat().st_mode & 0o777 == 0o755 & ~umask


def test_calculator_tool_refuses_what_it_does_not_evaluate() -> None:
    assert tool_task._evaluate(" 37 * 48 ") == 1776
    for bad in ("__import__('os')", "2 ** 10", "1 + 2 + 3", "", "9" * 50):
        with pytest.raises(ValueError, match="expected 'A op B'"):
            tool_task._evaluate(bad)


def test_held_back_instances_are_never_training_instances() -> None:
    train = {s["expression"] for s in tool_task.samples(2000, seed=0, split="train")}
    test = {s["expression"] for s in tool_task.samples(300, seed=5, split="test")}
    assert not train & test
    assert len(test) > 100


async def test_trained_model_solves_held_back_questions_greedily_with_real_tool_calls(tool_model: Path) -> None:
    from transformers import AutoTokenizer

    meta = json.loads((tool_model / "task.json").read_text())
    assert meta["stage"] == "trained"
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model))
    agent = tool_task.make_agent(tokenizer)  # greedy
    instances = tool_task.samples(60, seed=11, split="test")
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model))) as client:
        groups = await tool_task.run_groups(client, agent, instances)
    trajs = [g[0] for g in groups]
    solved = [t for t in trajs if t.reward == 1.0]
    assert len(solved) >= 0.9 * len(trajs), [tool_task.final_answer(t) for t in trajs if t.reward != 1.0]
    for t, sample in zip(trajs, instances, strict=True):
        if t.reward == 1.0:  # solved means: a real call, evaluated by the tool, and its result in the answer
            (call,) = [c for turn in t.turns for c in turn.tool_calls]
            assert call.ok and call.name == "calculator"
            assert tool_task._evaluate(call.arguments["expression"]) == sample["answer"]
            assert len(t.turns) == 2 and t.finish_reason == "stop"
            assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)


async def test_grpo_from_the_undertrained_model_raises_the_reward(sdk_home: Path, tool_model: Path) -> None:
    from rollout_sdk.demos.grpo import GrpoConfig, run_grpo

    lines: list[str] = []
    rows = await run_grpo(GrpoConfig(steps=8, prompts=8, group_size=8, eval_instances=0), say=lines.append)
    first = rows[0]
    late = sum(r["reward"] for r in rows[-3:]) / 3
    assert first["success"] <= 0.6, lines  # the under-trained start
    assert late >= first["reward"] + 0.2 and late >= 0.6, lines  # RL on its own rollouts taught it
    assert max(r["logprob_gap"] for r in rows) < 1e-3, lines  # the trainer's logprobs are the engine's
    assert rows[-1]["tool_call_rate"] > first["tool_call_rate"], lines


def test_make_model_prints_the_tool_model_directory(tool_model: Path, sdk_home: Path) -> None:
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home))
    out = subprocess.run(
        [sys.executable, "-m", "rollout_sdk", "make-model", "tool"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tool_model)


def test_training_definitions_are_calculators_and_never_a_held_back_one() -> None:
    import random

    from rollout_sdk.tasks.calculator_schemas import HELD_BACK, training_tools

    rng = random.Random(0)
    held = {json.dumps(h.chat()["function"].get("description")) for h in HELD_BACK if h.description}
    for _ in range(2000):
        tools, system = training_tools(rng)
        [calc] = [t["function"] for t in tools if t["function"]["name"] == "calculator"]
        assert calc["parameters"]["properties"]["expression"]["type"] == "string"
        assert len(tools) <= 3 and all(t["type"] == "function" for t in tools)
        assert json.dumps(calc.get("description")) not in held
        assert system is None or isinstance(system, str)
    assert training_tools(random.Random(5)) == training_tools(random.Random(5))  # draws from rng alone


def test_a_definitions_system_block_starts_the_agents_prompt_exactly(tiny_model: Path) -> None:
    """The recipe swaps a prompt's system block for another definition's: the block must be exactly the
    first ids of the whole conversation the agent (and the gateway) renders with that definition."""
    import random

    from rollout_sdk.agents import ChatTemplate
    from rollout_sdk.models import load_tokenizer
    from rollout_sdk.tasks.calculator_schemas import training_tools
    from rollout_sdk.tasks.tool_model import system_block

    tok = load_tokenizer(str(tiny_model))
    rng = random.Random(0)
    for _ in range(20):
        tools, system = training_tools(rng)
        block = system_block(tok, tools, system)
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": "What is 37 * 48?"})
        whole = ChatTemplate(tok, tools=tools).prompt_ids(messages)
        assert whole[: len(block)] == block and whole[len(block)] == 151644  # then <|im_start|>user
        assert tok.decode(whole[len(block) :]).startswith("<|im_start|>user\nWhat is 37 * 48?")


def test_the_gateway_calculator_agent_imports_nothing_from_rollout_sdk() -> None:
    import ast

    from gateway_agents import calculator_agent

    tree = ast.parse(Path(calculator_agent.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("rollout_sdk")]
    assert {"openai", "anthropic"} <= set(names)
