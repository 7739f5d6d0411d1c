"""Agents as the rollouts layer sees them, and a group of rollouts of one sample (a GRPO group)."""

from __future__ import annotations

import abc
import asyncio
import uuid
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

from .._aio import first_exception
from ..errors import ConfigError, RolloutError
from .context import RolloutContext
from .generator import USE_CLIENT_DEFAULT, Generator, UseClientDefault
from .trajectory import Trajectory

__all__ = [
    "Agent",
    "RewardFn",
    "Sample",
    "deprecated_group_field",
    "group_stats",
    "resolve_group_size",
    "reward_of",
    "rollout_group",
    "run_trajectory",
]

Sample = Mapping[str, Any]
RewardFn = Callable[[Trajectory, Sample], "float | Awaitable[float]"]


class Agent(abc.ABC):
    """A rollout policy loop.  ``run`` returns one finished :class:`Trajectory` for ``sample``."""

    @abc.abstractmethod
    async def run(self, ctx: RolloutContext, sample: Sample) -> Trajectory: ...


async def reward_of(reward: RewardFn, traj: Trajectory, sample: Sample) -> float:
    if asyncio.iscoroutinefunction(reward):
        return float(await reward(traj, sample))
    value = await asyncio.to_thread(reward, traj, sample)
    if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
        value = await value
    return float(value)  # type: ignore[arg-type]


async def run_trajectory(
    agent: Agent, ctx: RolloutContext, sample: Any, *, reward: RewardFn | None, sample_index: int
) -> Trajectory:
    """One trajectory of ``sample`` in ``ctx``, tagged with its sample index and rewarded when it finishes."""
    traj = ctx.finish(await agent.run(ctx, sample))
    traj.sample_index = sample_index
    if reward is not None and traj.finish_reason != "stale":
        traj.reward = await reward_of(reward, traj, sample)
    return traj


def resolve_group_size(group_size: int | None, n: int | None, *, where: str, default: int | None = None) -> int:
    """``group_size``, the one name of a GRPO group's size in every API; ``n`` is its old name (deprecated)."""
    if n is not None:
        if group_size is not None:
            raise ConfigError("n", n, "is the old name of group_size: give group_size only")
        warnings.warn(f"{where}(n=...) is deprecated: call it group_size=", DeprecationWarning, stacklevel=3)
        return n
    if group_size is None:
        if default is None:
            raise TypeError(f"{where}() missing required keyword argument: 'group_size'")
        return default
    return group_size


def deprecated_group_field(config: Any, old: str) -> None:
    """A config's old name of its ``group_size`` field: when given, warn and use it (frozen dataclasses)."""
    value = getattr(config, old)
    if value is None:
        return
    warnings.warn(
        f"{type(config).__name__}({old}=...) is deprecated: call it group_size (--group-size on the command line)",
        DeprecationWarning,
        stacklevel=4,
    )
    object.__setattr__(config, "group_size", value)


async def rollout_group(
    client: Generator,
    agent: Agent,
    sample: Sample,
    *,
    group_size: int | None = None,
    n: int | None = None,
    reward: RewardFn | None = None,
    sample_index: int = -1,
    timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
    max_staleness: int | None = None,
    on_error: Literal["raise", "record"] = "raise",
) -> list[Trajectory]:
    """``group_size`` trajectories of one sample (a GRPO group), each rewarded as soon as it finishes.

    Member k runs in a context with ``member=k`` (its seeds: :mod:`.seeds`).  ``client`` is any
    :class:`~.generator.Generator` (usually the RolloutClient).  The reward function (async, or sync
    run in a thread) overlaps with the group's other trajectories; a stale trajectory is not rewarded.
    ``on_error="record"`` turns a failed trajectory into one with ``finish_reason="error"`` instead of
    raising, so the group stays complete.
    """
    if on_error not in ("raise", "record"):
        raise ConfigError("on_error", on_error, "must be 'raise' or 'record'")
    n = resolve_group_size(group_size, n, where="rollout_group")
    group_id = uuid.uuid4().hex if n > 1 else None  # placed together, the shared prompt prefilled once

    async def one(k: int) -> Trajectory:
        # member k: a seeded sampling config gives n different samples, the same ones as generate_many
        ctx = RolloutContext(client, member=k, timeout=timeout, max_staleness=max_staleness, group_id=group_id)
        try:
            return await run_trajectory(agent, ctx, sample, reward=reward, sample_index=sample_index)
        except RolloutError as exc:
            if on_error == "raise":
                raise
            return Trajectory(
                id=ctx.session_id,
                prompt_ids=[],
                response_ids=[],
                loss_mask=[],
                logprobs=[],
                finish_reason="error",
                error=f"{type(exc).__name__}: {exc}",
                sample_index=sample_index,
            )

    try:
        async with asyncio.TaskGroup() as tg:  # one failure cancels its siblings instead of orphaning them
            tasks = [tg.create_task(one(k)) for k in range(n)]
    except BaseExceptionGroup as eg:
        raise first_exception(eg) from None
    return [t.result() for t in tasks]


def group_stats(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """Totals over trajectories: turns, tool calls and errors, parse errors, model tokens."""
    trajs = [t for g in groups for t in g]
    keys = ("turns", "tool_calls", "tool_errors", "parse_errors", "model_tokens", "context_tokens")
    return {k: sum(t.metrics.get(k, 0.0) for t in trajs) for k in keys} | {"trajectories": float(len(trajs))}
