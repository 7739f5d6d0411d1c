"""The calculator task the tool model is trained on: arithmetic it must delegate to a ``calculator`` tool.

A sample asks ``"What is 37 * 48?"``; the right trajectory (through :class:`~rollout_sdk.agents.ToolAgent`)
is one tool call in Qwen2.5's format, then an answer read off the tool's result::

    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "37 * 48"}}\\n</tool_call>
    tool       1776
    assistant  The answer is 1776.

Instances are split for good: an instance is held back (``split="test"``) by a hash of its operands, so
no training instance is ever a test instance, whatever the seeds.  :func:`solved` is the success
criterion (the right number in the final answer, after at least one calculator call that succeeded);
:func:`reward` is 1.0 for solved, else 0.0.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..agents import AgentConfig, Tool, ToolAgent, ToolRegistry, Trajectory, rollout_group, tool
from ..protocol import SamplingParams
from ..rollouts.group import resolve_group_size

if TYPE_CHECKING:
    from ..client import RolloutClient

__all__ = [
    "OPERAND_RANGE",
    "OPERATORS",
    "agent_config",
    "calculator",
    "final_answer",
    "instances",
    "make_agent",
    "make_registry",
    "reward",
    "run_groups",
    "samples",
    "solved",
]

#: operands are integers in this range (inclusive)
OPERAND_RANGE = (32, 99)
#: one operator and two-digit operands: every product has four digits, so every copy the model learns
#: (question -> call, tool result -> answer) is at a fixed offset: learnable in ~1000 CPU steps
OPERATORS = ("*",)
_EXPRESSION = re.compile(r"\s*(-?\d{1,6})\s*([-+*])\s*(-?\d{1,6})\s*")
_LAST_INT = re.compile(r"-?\d+")


def _evaluate(expression: str) -> int:
    m = _EXPRESSION.fullmatch(expression)
    if m is None:
        raise ValueError(f"expected 'A op B' with integers A, B and op one of + - *, got {expression[:80]!r}")
    a, op, b = int(m[1]), m[2], int(m[3])
    return a + b if op == "+" else a - b if op == "-" else a * b


@tool(timeout_s=2.0)
def calculator(expression: str) -> int:
    """Evaluate an arithmetic expression.

    Args:
        expression: two integers and an operator, e.g. "37 * 48".
    """
    return _evaluate(expression)


def make_registry() -> ToolRegistry:
    """A registry with the one tool of the task (a fresh one: its counters are its own)."""
    tools: list[Tool] = [calculator]
    return ToolRegistry(tools)


def agent_config(*, temperature: float = 0.0, seed: int | None = None, max_new_tokens: int = 48) -> AgentConfig:
    """The agent budgets the task needs: two model turns (a call, an answer), short ones.  Greedy by default."""
    return AgentConfig(
        max_turns=3,
        max_new_tokens=max_new_tokens,
        max_response_tokens=160,
        sampling=SamplingParams(temperature=temperature, seed=seed),
    )


def _held_back(a: int, op: str, b: int) -> bool:
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=2).digest()
    return digest[0] % 5 == 0  # one instance in five is never trained on


def instances(split: str) -> list[dict[str, Any]]:
    """Every instance of ``split`` ("train" or "test"), in a fixed order."""
    _check_split(split)
    lo, hi = OPERAND_RANGE
    return [
        _instance(a, op, b)
        for a in range(lo, hi + 1)
        for op in OPERATORS
        for b in range(lo, hi + 1)
        if _held_back(a, op, b) == (split == "test")
    ]


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")


def _instance(a: int, op: str, b: int) -> dict[str, Any]:
    expression = f"{a} {op} {b}"
    return {
        "messages": [{"role": "user", "content": f"What is {expression}?"}],
        "expression": expression,
        "answer": _evaluate(expression),
    }


def samples(n: int, *, seed: int = 0, split: str = "test") -> list[dict[str, Any]]:
    """``n`` task instances (``{"messages", "expression", "answer"}``) of ``split`` ("train" or "test")."""
    _check_split(split)
    rng = random.Random(f"{split}:{seed}")
    lo, hi = OPERAND_RANGE
    out: list[dict[str, Any]] = []
    while len(out) < n:
        a, op, b = rng.randint(lo, hi), rng.choice(OPERATORS), rng.randint(lo, hi)
        if _held_back(a, op, b) == (split == "test"):
            out.append(_instance(a, op, b))
    return out


def final_answer(traj: Trajectory) -> str:
    """The content of the last assistant message."""
    return next((m.get("content") or "" for m in reversed(traj.messages) if m["role"] == "assistant"), "")


def solved(traj: Trajectory, sample: Mapping[str, Any]) -> bool:
    """The model called the calculator (successfully) and its final answer ends with the right number."""
    called = any(c.name == "calculator" and c.ok for t in traj.turns for c in t.tool_calls)
    numbers = _LAST_INT.findall(final_answer(traj))
    return traj.finish_reason == "stop" and called and bool(numbers) and int(numbers[-1]) == sample["answer"]


def reward(traj: Trajectory, sample: Mapping[str, Any]) -> float:
    """1.0 when :func:`solved`, else 0.0 (a :data:`~rollout_sdk.agents.RewardFn`)."""
    return 1.0 if solved(traj, sample) else 0.0


def make_agent(
    tokenizer: Any, *, temperature: float = 0.0, seed: int | None = None, max_new_tokens: int = 48
) -> ToolAgent:
    """A ToolAgent for the task: the calculator registry and :func:`agent_config`."""
    config = agent_config(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    return ToolAgent(tokenizer, make_registry(), config)


async def run_groups(
    client: RolloutClient,
    agent: ToolAgent,
    instances: list[dict[str, Any]],
    *,
    group_size: int | None = None,
    n: int | None = None,
) -> list[list[Trajectory]]:
    """``group_size`` trajectories of every instance (``n``: its deprecated old name), concurrently, each
    rewarded with :func:`reward`."""
    n = resolve_group_size(group_size, n, where="run_groups", default=1)

    return list(
        await asyncio.gather(
            *(
                rollout_group(client, agent, s, group_size=n, reward=reward, sample_index=i)
                for i, s in enumerate(instances)
            )
        )
    )
