"""A tool-calling agent on a scripted model (bench/multiturn.py): what the model says each turn, the tool and
its latency, the prompts, and the check that every trajectory went as scripted.

Every trajectory has ``turns`` model turns of exactly ``tokens_per_turn`` ids: turns 1..K-1 each call
``lookup`` (a Hermes ``<tool_call>``), turn K answers; the tool sleeps what its :class:`ToolClock` says.  The
fake engine's :func:`responder` counts the assistant turns in the prompt and returns that turn's ids, so
the real ``ToolAgent`` and tokenizer run against a model whose every answer is known.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_sdk import RolloutClient
    from rollout_sdk.agents import Agent, ToolRegistry, Trajectory
    from rollout_sdk.protocol import GenerateRequest

IM_START = 151644
IM_END = 151645


def turn_outputs(tok: Any, turns: int, tokens_per_turn: int) -> list[list[int]]:
    """Exactly ``tokens_per_turn`` ids per model turn: filler, a tool call (or the answer), <|im_end|>."""
    filler = tok.encode(" ok", add_special_tokens=False)
    outs: list[list[int]] = []
    for k in range(turns):
        if k < turns - 1:
            call = json.dumps({"name": "lookup", "arguments": {"query": f"step {k}"}})
            body = f"<tool_call>\n{call}\n</tool_call>"
        else:
            body = "The answer is 42."
        ids = tok.encode(body, add_special_tokens=False)
        pad = tokens_per_turn - 1 - len(ids)
        if pad < 0 or len(filler) != 1:
            raise ValueError(f"--tokens-per-turn {tokens_per_turn} is too small for a turn of {len(ids) + 1} tokens")
        outs.append([*filler * pad, *ids, IM_END])
    return outs


class ToolClock:
    """The tool's latency: fixed, or drawn (lognormal with the same mean) from a seeded sequence, so both
    loops see the same latencies."""

    def __init__(self) -> None:
        self.fixed = 0.0
        self._draws: collections.deque[float] = collections.deque()

    def set(self, mean_s: float, sigma: float, count: int, seed: int) -> None:
        self.fixed = mean_s
        self._draws.clear()
        if sigma:
            rng = random.Random(seed)
            mu = math.log(mean_s) - sigma * sigma / 2  # E[lognormal] = mean_s
            self._draws.extend(rng.lognormvariate(mu, sigma) for _ in range(count))

    def next(self) -> float:
        return self._draws.popleft() if self._draws else self.fixed


def make_registry(clock: ToolClock) -> ToolRegistry:
    from rollout_sdk.agents import ToolRegistry

    reg = ToolRegistry()

    @reg.register
    async def lookup(query: str) -> str:
        """Look something up (a tool with a fixed latency)."""
        await asyncio.sleep(clock.next())
        return f"found: {query}"

    return reg


def responder(outputs: Sequence[list[int]], assistant_marker: Sequence[int]) -> Callable[[GenerateRequest], list[int]]:
    """The scripted model: the ids of turn k when the prompt holds k assistant turns (``assistant_marker``: the
    two ids of ``<|im_start|>assistant``); the last turn's beyond the script."""
    first, second = assistant_marker

    def respond(req: GenerateRequest) -> list[int]:
        ids = req.input_ids
        turns = sum(1 for i in range(len(ids) - 1) if ids[i] == first and ids[i + 1] == second)
        return outputs[min(max(turns - 1, 0), len(outputs) - 1)]

    return respond


def questions(n: int, group: int) -> list[dict[str, Any]]:
    """The samples of ``n`` trajectories in groups of ``group``: one question a group."""
    return [
        {"messages": [{"role": "user", "content": f"Question {i}: look it up, then answer."}]}
        for i in range(max(1, n // group))
    ]


async def run_agents(
    client: RolloutClient, agent: Agent, samples: list[dict[str, Any]], group: int
) -> list[Trajectory]:
    """Every group at once through ``rollout_group``: the trajectories, group by group."""
    from rollout_sdk.agents import rollout_group

    groups = await asyncio.gather(
        *(rollout_group(client, agent, s, group_size=group, sample_index=i) for i, s in enumerate(samples))
    )
    return [t for g in groups for t in g]


def check(trajs: list[Trajectory], n: int, turns: int) -> None:
    """Every one of ``n`` trajectories went as scripted: ``turns`` turns, a successful tool call in each but
    the last, which stopped."""
    if len(trajs) != n:
        raise AssertionError(f"{len(trajs)} trajectories, expected {n}")
    for t in trajs:
        calls = [c for turn in t.turns for c in turn.tool_calls]
        if (
            t.finish_reason != "stop"
            or len(t.turns) != turns
            or len(calls) != turns - 1
            or not all(c.ok for c in calls)
        ):
            raise AssertionError(f"unexpected trajectory: {t.finish_reason}, {len(t.turns)} turns, {calls}")
