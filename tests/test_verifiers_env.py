"""verifiers environments (the real package, the `envs` extra) on the CPU tool model through the gateway:
a ``SingleTurnEnv`` and a ``ToolEnv`` built locally (a tiny ``datasets.Dataset``, no download), scored by
their own rubrics; the trajectories are exact tokens of a fresh rendering, with the rubric's rewards, and a
GRPO step runs on them."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from grpo_step import grpo_step
from rollout_sdk import CpuEngineConfig, RolloutClient
from rollout_sdk.agents import ChatTemplate
from rollout_sdk.errors import ConfigError
from rollout_sdk.gateway import Gateway
from rollout_sdk.tasks import calculator as calc

vf = pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")
from rollout_sdk.integrations.verifiers_env import VerifiersRunner  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA = calc.make_registry().schemas()[0]["function"]  # the tool exactly as the model was trained on it


class Env:
    def __init__(self, client: RolloutClient, gw: Gateway, tok: Any, model_dir: Path) -> None:
        self.client, self.gw, self.tok, self.model_dir = client, gw, tok, model_dir


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path) -> AsyncIterator[Env]:
    from rollout_sdk.models import load_tokenizer

    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model), seed=0)) as client:
        await client.init_weight_sync(backend="gloo")
        async with Gateway(client, model_name="tool-model") as gw:
            yield Env(client, gw, load_tokenizer(str(tool_model)), tool_model)


def last_number(text: str) -> int | None:
    nums = re.findall(r"-?\d+", text)
    return int(nums[-1]) if nums else None


def correct(completion: Any, answer: str) -> float:
    """The environment's reward: 1.0 when the last number of the final answer is the answer."""
    text = completion[-1].content if completion else ""
    return 1.0 if last_number(text or "") == int(answer) else 0.0


def called(completion: Any) -> float:
    """A second rubric function (weight 0.5): the model called the calculator."""
    return float(any(getattr(m, "tool_calls", None) for m in completion))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(calc._evaluate(expression))


def rows(n: int, seed: int) -> list[dict[str, Any]]:
    return [
        {"prompt": s["messages"], "answer": str(s["answer"]), "info": {}}
        for s in calc.samples(n, seed=seed, split="test")
    ]


def check_exact(traj: Any, tok: Any, tools: Any = None) -> None:
    """ids = a fresh rendering of the trajectory's messages (prompt and glue exactly; a sampled model turn may
    be a non-canonical tokenization of its text); mask 1 exactly on the model's tokens, logprob 0 off it."""
    report = ChatTemplate(tok, tools=tools).check_drift(
        traj.messages, traj.ids, loss_mask=traj.loss_mask, prompt_len=len(traj.prompt_ids)
    )
    assert report.ok or report.region == "model", str(report)
    assert len(traj.loss_mask) == len(traj.response_ids) == len(traj.logprobs)
    assert sum(traj.loss_mask) == sum(len(lc) for lc in [[0] * t.model_tokens for t in traj.turns])
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)


def final_text(traj: Any) -> str:
    return str(traj.messages[-1].get("content") or "") if traj.messages[-1]["role"] == "assistant" else ""


async def test_single_turn_env_rollouts_carry_the_rubric_reward(env: Env) -> None:
    data = rows(2, seed=4)
    venv = vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(data), rubric=vf.Rubric(funcs=[correct]))
    runner = VerifiersRunner(env.gw, venv, metadata={"env": "single"})
    got = await runner.run_group(data, group_size=2, sampling_args={"temperature": 1.0, "max_tokens": 40})
    assert len(got) == 4
    for k, r in enumerate(got):
        [t] = r.trajectories
        check_exact(t, env.tok)
        assert len(t.turns) == 1 and t.metadata == {"env": "single", "example_id": k // 2}
        # the rubric's reward, and the environment's own scoring recomputed from the recorded answer
        assert (
            t.reward
            == r.output["reward"]
            == (1.0 if last_number(final_text(t)) == int(data[k // 2]["answer"]) else 0.0)
        )
        assert t.metrics["correct"] == r.output["metrics"]["correct"]
        # the model turn verifiers saw is the recorded one
        assert r.output["completion"][-1]["content"] == final_text(t)
        assert t.weight_versions == [(0, sum(t.loss_mask))]
    assert not env.gw.store.sessions  # every session left the gateway


async def test_tool_env_multi_turn_and_a_grpo_step(env: Env) -> None:
    data = rows(3, seed=9)
    rubric = vf.Rubric(funcs=[correct, called], weights=[1.0, 0.5])
    venv = vf.ToolEnv(tools=[calculator], dataset=datasets.Dataset.from_list(data), rubric=rubric, max_turns=3)
    venv.tool_defs = [dict(SCHEMA)]  # the schema the tool model was trained on
    tools = [{"type": "function", "function": SCHEMA}]
    runner = VerifiersRunner(env.gw, venv, sampling={"seed": 5})
    got = await runner.run_group(data, group_size=3, sampling_args={"temperature": 1.0, "max_tokens": 48})
    multi = 0
    for k, r in enumerate(got):
        [t] = r.trajectories
        check_exact(t, env.tok, tools)
        ans = int(data[k // 3]["answer"])
        calls = [c for u in t.turns for c in u.tool_calls]
        want = (1.0 if last_number(final_text(t)) == ans else 0.0) + 0.5 * float(bool(calls))
        assert t.reward == r.output["reward"] == want
        # each tool result in the trajectory is the environment's own answer to that call
        results = [m["content"] for m in t.messages if m["role"] == "tool"]
        assert results == [calculator(c.arguments["expression"]) for c in calls]
        assert len(t.turns) == len([m for m in r.output["completion"] if m["role"] == "assistant"])
        multi += len(t.turns) > 1
    assert multi > 0  # the model called the tool and the environment answered
    groups = [[t for r in got[i : i + 3] for t in r.trajectories] for i in range(0, len(got), 3)]
    gap = await grpo_step(env.client, env.model_dir, groups, version=1)
    assert gap < 1e-3
    again = await runner.run_group(data[:1], group_size=2, sampling_args={"temperature": 1.0, "max_tokens": 48})
    assert all(t.weight_versions == [(1, sum(t.loss_mask))] for r in again for t in r.trajectories)
    assert not env.gw.store.sessions


async def test_runner_refuses_by_field(env: Env) -> None:
    with pytest.raises(ConfigError, match="env"):
        VerifiersRunner(env.gw, object())
    venv = vf.SingleTurnEnv(dataset=datasets.Dataset.from_list(rows(1, 1)), rubric=vf.Rubric(funcs=[correct]))
    runner = VerifiersRunner(env.gw, venv)
    with pytest.raises(ConfigError, match="inputs"):
        await runner.run_group([])
    with pytest.raises(ConfigError, match="group_size"):
        await runner.run_group(rows(1, 1), group_size=0)
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        VerifiersRunner(env.gw, venv, sampling={"temperature": 9.0})
