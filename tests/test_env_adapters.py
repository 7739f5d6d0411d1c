"""Environment hubs through their real packages on the CPU tool model (the `envs` extra): reasoning-gym
datasets as a task source scored by their own ``score_answer``, and a skyrl-gym ``BaseTextEnv`` answering
each turn.  Each runs a GRPO step through the adapter and checks exact ids, masks and rewards against
the environment's own scoring."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from grpo_step import grpo_step
from rollout_sdk import CpuEngineConfig, RolloutClient, SamplingParams
from rollout_sdk.agents import ChatTemplate, rollout_group
from rollout_sdk.errors import ConfigError
from rollout_sdk.integrations.text_env import TextEnvAgent, TextEnvConfig
from rollout_sdk.tasks import calculator as calc
from rollout_sdk.tasks.reasoning_gym import ReasoningGymTask, final_answer

reasoning_gym = pytest.importorskip("reasoning_gym")
skyrl_gym = pytest.importorskip("skyrl_gym")
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path) -> AsyncIterator[tuple[RolloutClient, Any, Path]]:
    from transformers import AutoTokenizer

    tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(tool_model))
    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model), seed=0)) as client:
        await client.init_weight_sync(backend="gloo")
        yield client, tok, tool_model


def check_exact(traj: Any, tok: Any, tools: Any = None) -> None:
    """ids = a fresh rendering of the trajectory's messages; mask 1 exactly on the model's tokens.  A sampled
    model turn may be a non-canonical tokenization of its text (kept as generated: token-in/token-out), so
    a difference is allowed only inside the model's own tokens, never in the prompt or the glue."""
    chat = ChatTemplate(tok, tools=tools)
    report = chat.check_drift(traj.messages, traj.ids, loss_mask=traj.loss_mask, prompt_len=len(traj.prompt_ids))
    assert report.ok or report.region == "model", str(report)
    assert len(traj.loss_mask) == len(traj.response_ids) == len(traj.logprobs)
    assert sum(traj.loss_mask) == sum(t.model_tokens for t in traj.turns)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)


# -- reasoning-gym --------------------------------------------------------------------------------


async def test_reasoning_gym_task_refuses_by_field() -> None:
    with pytest.raises(ConfigError, match="dataset"):
        ReasoningGymTask("no_such_dataset")
    with pytest.raises(ConfigError, match=r"config\.max_digitz"):
        ReasoningGymTask("products", config={"max_digitz": 2})
    with pytest.raises(ConfigError, match="config"):
        ReasoningGymTask("products", config={"min_digits": 3, "max_digits": 2})
    with pytest.raises(ConfigError, match="size"):
        ReasoningGymTask("products", size=0)
    with pytest.raises(ConfigError, match="task"):
        ReasoningGymTask.from_name("products")


async def test_reasoning_gym_samples_are_its_entries_and_scores_are_its_own() -> None:
    task = ReasoningGymTask("products", size=5, seed=3, config={"min_digits": 2, "max_digits": 2})
    ds = reasoning_gym.create_dataset("products", size=5, seed=3, min_digits=2, max_digits=2)
    for s, e in zip(task.samples(), ds, strict=True):
        assert s["entry"] == e and s["messages"][-1] == {"role": "user", "content": e["question"]}
        assert task.score_text(e["answer"], s["entry"]) == ds.score_answer(e["answer"], e) == 1.0
        assert task.score_text("nope", s["entry"]) == ds.score_answer("nope", e)


async def test_reasoning_gym_rollouts_and_a_grpo_step(env: tuple[RolloutClient, Any, Path]) -> None:
    client, tok, model_dir = env
    task = ReasoningGymTask("products", size=4, seed=1, config={"min_digits": 2, "max_digits": 2})
    agent = calc.make_agent(tok, temperature=1.0, seed=11)
    groups = await asyncio.gather(
        *(
            rollout_group(client, agent, s, group_size=4, reward=task.reward, sample_index=i)
            for i, s in enumerate(task.samples())
        )
    )
    ds = reasoning_gym.create_dataset("products", size=4, seed=1, min_digits=2, max_digits=2)
    for g, e in zip(groups, ds, strict=True):
        for t in g:
            check_exact(t, tok, calc.make_registry().schemas())
            want = ds.score_answer(final_answer(t), e) if t.finish_reason in ("stop", "max_turns") else 0.0
            assert t.reward == want
            assert t.weight_versions == [(0, sum(t.loss_mask))]
    # generate_many: the task's prompts, scored by score_answer of the decoded completions
    async with client.generate_many(task.prompts(tok), group_size=2, sampling=SamplingParams(max_new_tokens=8)) as s:
        async for grp in s:
            e = ds[grp.index]
            assert list(grp.request.input_ids) == ChatTemplate(tok).prompt_ids(
                [{"role": "user", "content": e["question"]}]
            )
            for r in grp.results:
                text = tok.decode(r.output_ids, skip_special_tokens=True)
                assert task.score_text(text, e) == ds.score_answer(text, e)
    gap = await grpo_step(client, model_dir, list(groups), version=1)
    assert gap < 1e-3
    again = await rollout_group(client, agent, task.samples(1)[0], group_size=2, reward=task.reward)
    assert all(t.weight_versions == [(1, sum(t.loss_mask))] for t in again)


# -- skyrl-gym text environments -------------------------------------------------------------------

CALL = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>", re.S)


class CalculatorEnv(BaseTextEnv):  # type: ignore[misc]
    """A skyrl-gym text environment: the environment runs the calculator call the model writes (reward
    0.25 for a well-formed call), then scores the final answer (1.0 when its last number is right)."""

    def __init__(self, answer: int) -> None:
        super().__init__()
        self.answer = answer
        self.max_turns = 3
        self.log: list[float] = []

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        m = CALL.search(action)
        if m is not None and self.turns < self.max_turns:
            try:
                expr = json.loads(m[1])["arguments"]["expression"]
                value = str(calc._evaluate(expr))
                reward = 0.25
            except (ValueError, KeyError, TypeError) as exc:
                value, reward = f"error: {exc}", 0.0
            self.log.append(reward)
            return BaseTextEnvStepOutput(
                observations=[{"role": "tool", "content": value}], reward=reward, done=False, metadata={}
            )
        nums = re.findall(r"-?\d+", action)
        reward = 1.0 if nums and int(nums[-1]) == self.answer else 0.0
        self.log.append(reward)
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


async def test_a_skyrl_gym_env_answers_each_turn_and_a_grpo_step(env: tuple[RolloutClient, Any, Path]) -> None:
    client, tok, model_dir = env
    made: list[CalculatorEnv] = []

    def make(sample: Any) -> CalculatorEnv:
        e = CalculatorEnv(sample["answer"])
        made.append(e)
        return e

    tools = calc.make_registry().schemas()
    agent = TextEnvAgent(
        tok,
        make,
        TextEnvConfig(max_turns=4, max_new_tokens=48, sampling=SamplingParams(temperature=1.0, seed=5)),
        tools=tools,
    )
    samples = calc.samples(3, seed=9, split="test")
    groups = await asyncio.gather(*(rollout_group(client, agent, s, group_size=3) for s in samples))
    assert len(made) == 9  # one environment per trajectory
    by_turns = {tuple(e.log) for e in made}
    got = set()
    multi = 0
    for g in groups:
        for t in g:
            check_exact(t, tok, tools)
            turn_rewards = [u.reward for u in t.turns]
            got.add(tuple(r for r in turn_rewards if r is not None))
            assert t.reward == sum(r or 0.0 for r in turn_rewards)
            multi += len(t.turns) > 1
            if t.finish_reason == "stop":
                assert t.messages[-1]["role"] == "assistant"
    assert got == by_turns  # the environment's own rewards, turn by turn
    assert multi > 0  # the environment answered at least one turn (the model called the calculator)
    gap = await grpo_step(client, model_dir, list(groups), version=2)
    assert gap < 1e-3


async def test_a_text_env_that_breaks_the_interface_is_refused_by_field(
    env: tuple[RolloutClient, Any, Path],
) -> None:
    client, tok, _ = env

    class Bad(BaseTextEnv):  # type: ignore[misc]
        def step(self, action: str) -> Any:
            return {"observations": [{"role": "robot", "content": "x"}], "reward": 0.0, "done": False}

    class NaN(BaseTextEnv):  # type: ignore[misc]
        def step(self, action: str) -> Any:
            return {"observations": [], "reward": float("nan"), "done": True}

    cfg = TextEnvConfig(max_turns=2, max_new_tokens=48, sampling=SamplingParams(temperature=0.0))
    sample = calc.samples(1, split="test")[0]
    with pytest.raises(ConfigError, match=r"step\.observations\[0\]"):
        await rollout_group(client, TextEnvAgent(tok, lambda s: Bad(), cfg), sample, group_size=1)
    with pytest.raises(ConfigError, match=r"step\.reward"):
        await rollout_group(client, TextEnvAgent(tok, lambda s: NaN(), cfg), sample, group_size=1)
    with pytest.raises(ConfigError, match="env"):
        await rollout_group(client, TextEnvAgent(tok, lambda s: object(), cfg), sample, group_size=1)
