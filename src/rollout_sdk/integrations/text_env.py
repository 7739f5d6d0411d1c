"""Gymnasium-style text environments (skyrl-gym's ``BaseTextEnv`` interface) as rollout-sdk agents.

The environment, not a tool registry, answers each turn::

    prompt, info = env.init(sample["messages"])          -> the prompt ids (the chat template's rendering)
    loop:  model turn (exact ids, mask 1, logprobs)      -> ctx.generate, as ToolAgent
           out = env.step(model text)                    -> Turn.reward = out["reward"]
           out["done"]                                   -> finish_reason "stop"
           out["observations"] (chat messages)           -> glue ids (mask 0), the next turn's context
    env.close()                                          (always, also on error or cancellation)

Maps: messages (``init``'s conversation and each step's ``observations``, OpenAI message dicts with
roles ``user``, ``tool`` or ``system`` and string content, rendered by the model's chat template exactly
as ToolAgent renders tool results); rewards (each step's ``reward`` is that model turn's
``Turn.reward``, the trajectory's ``reward`` is their sum; a trainer discounts with
``rollout_sdk.gateway.discounted_returns``); stop conditions (``done``, then :class:`TextEnvConfig`'s
``max_turns`` / token budgets, a turn cut by its token limit: ``length``); sampling (the config's
``SamplingParams``, per environment: one config per agent).  The environment's methods are synchronous
(skyrl-gym's are): they run in a worker thread, never on the event loop.

Refuses, each a :class:`~rollout_sdk.errors.ConfigError` naming the field and value: an environment
without ``init``/``step`` (``env``); a step output that is not a mapping with ``observations``,
``reward`` and ``done`` (``step.<field>``); a non-finite reward (``step.reward``); observations that are
not a list of ``{"role", "content": str}`` messages with a role above (``step.observations[i]``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec

from ..agents.chat import ChatTemplate
from ..errors import ConfigError, StalenessError
from ..protocol import SamplingParams, expect_sampling
from ..protocol.checks import check_config_types
from ..rollouts.context import RolloutContext
from ..rollouts.group import Agent, Sample
from ..rollouts.trajectory import Trajectory, TrajectoryBuilder

__all__ = ["TextEnv", "TextEnvAgent", "TextEnvConfig"]

_ROLES = ("user", "tool", "system")


@runtime_checkable
class TextEnv(Protocol):
    """skyrl-gym's ``BaseTextEnv``: ``init(prompt) -> (prompt, info)``, ``step(action) -> {"observations",
    "reward", "done", "metadata"}``, ``close()``.  Any object with these methods works."""

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def step(self, action: str) -> Mapping[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class TextEnvConfig:
    """Budgets and sampling of :class:`TextEnvAgent` (the environment's own ``max_turns`` still applies:
    it says ``done``)."""

    max_turns: int = 8
    #: per model turn
    max_new_tokens: int = 256
    #: tokens after the prompt (model turns and observations)
    max_response_tokens: int = 2048
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        check_config_types(self)
        expect_sampling(self.sampling, optional=False, error=ConfigError)
        for name in ("max_turns", "max_new_tokens", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")


class TextEnvAgent(Agent):
    """Runs one environment per trajectory: ``make_env(sample)`` builds it (a fresh one per rollout: a
    GRPO group's members must not share state).  Example::

        agent = TextEnvAgent(tokenizer, lambda s: GuessEnv(s["target"]), TextEnvConfig(max_turns=4))
        group = await rollout_group(client, agent, {"messages": [...], "target": 7}, group_size=8)
        # every Trajectory: exact ids, loss mask, logprobs, weight_versions; Turn.reward per step
    """

    def __init__(
        self,
        tokenizer: Any,
        make_env: Callable[[Sample], Any],
        config: TextEnvConfig | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ConfigError("tokenizer", tokenizer, "must be a Hugging Face tokenizer with a chat template")
        if not callable(make_env):
            raise ConfigError("make_env", make_env, "must be a callable: sample -> environment")
        if config is not None and not isinstance(config, TextEnvConfig):
            raise ConfigError("config", config, f"must be a TextEnvConfig or None (got {type(config).__name__})")
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.config = config or TextEnvConfig()
        #: the environment's tools (OpenAI function schemas), rendered by the chat template; the
        #: environment, not rollout-sdk, parses and answers the calls the model writes
        self.chat = ChatTemplate(tokenizer, tools=[dict(t) for t in tools] if tools else None)

    async def run(self, ctx: RolloutContext, sample: Sample) -> Trajectory:
        env = await asyncio.to_thread(self.make_env, sample)
        for name in ("init", "step"):
            if not callable(getattr(env, name, None)):
                raise ConfigError("env", type(env).__name__, f"has no {name}() (skyrl-gym's BaseTextEnv interface)")
        try:
            return await self._run(ctx, env, sample)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                await asyncio.to_thread(close)

    async def _run(self, ctx: RolloutContext, env: Any, sample: Sample) -> Trajectory:
        cfg = self.config
        prompt, _info = await asyncio.to_thread(env.init, [dict(m) for m in sample["messages"]])
        messages = _checked_messages(prompt, "init.prompt", roles=(*_ROLES, "assistant"))
        builder = TrajectoryBuilder(self.chat.prompt_ids(messages), ctx.session_id)
        finish = "max_turns"
        total = 0.0
        for index in range(cfg.max_turns):
            room = min(cfg.max_new_tokens, cfg.max_response_tokens - builder.response_len)
            if room < 1:
                finish = "budget"
                break
            t0 = time.perf_counter()
            try:
                result = await ctx.generate(builder.ids, msgspec.structs.replace(cfg.sampling, max_new_tokens=room))
            except StalenessError:
                finish = "stale"
                break
            turn = builder.add_turn(result, index=index, generate_s=time.perf_counter() - t0)
            text, body = self.chat.decode_reply(result.output_ids)
            messages.append({"role": "assistant", "content": body})
            if result.finish_reason in ("abort", "length"):
                finish = result.finish_reason
                break
            out = await asyncio.to_thread(env.step, body)
            reward, done, observations = _checked_step(out)
            turn.reward = reward
            total += reward
            if done:
                finish = "stop"
                break
            glue, _ = self.chat.glue_ids(messages, observations, text)
            if builder.response_len + len(glue) >= cfg.max_response_tokens:
                finish = "budget"
                break
            builder.add_context(glue)
            turn.context_tokens = len(glue)
            messages.extend(observations)
        return builder.build(finish, messages=messages, reward=total)


def _checked_step(out: Any) -> tuple[float, bool, list[dict[str, Any]]]:
    if not isinstance(out, Mapping):
        raise ConfigError("step", type(out).__name__, "must return a mapping (BaseTextEnvStepOutput)")
    for key in ("observations", "reward", "done"):
        if key not in out:
            raise ConfigError(f"step.{key}", None, "is missing from the step output")
    reward = out["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ConfigError("step.reward", reward, "must be a finite number")
    if not isinstance(out["done"], bool):
        raise ConfigError("step.done", out["done"], "must be a bool")
    return float(reward), out["done"], _checked_messages(out["observations"], "step.observations", roles=_ROLES)


def _checked_messages(msgs: Any, where: str, *, roles: Sequence[str]) -> list[dict[str, Any]]:
    if not isinstance(msgs, list):
        raise ConfigError(where, type(msgs).__name__, "must be a list of chat messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}[{i}]", str(m)[:80], f"must be {{'role': one of {list(roles)}, 'content': str}}")
        out.append(dict(m))
    return out
