"""Agent loops: one coroutine per trajectory, in the client process.

A trajectory is one coroutine: generate, parse tool calls, run the tools concurrently, append their
results, generate again — until the model answers without calling a tool, or a turn, token or context
budget runs out.  Thousands run at once on one event loop; a slow tool holds up only its own trajectory,
while the engines keep every other trajectory's turns batched.  Every turn of a trajectory carries the
same ``session_id``, so the scheduler keeps it on one server (its prefix stays in that server's cache).

Write your own loop by subclassing :class:`Agent` and using :class:`~.trajectory.TrajectoryBuilder`
(``ctx.generate`` + ``builder.add_model`` / ``builder.add_context``): the bookkeeping is the same.
"""

from __future__ import annotations

import abc
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from .._aio import first_exception
from ..errors import ConfigError, RolloutError, StalenessError
from ..partial import Continuation
from ..protocol import GenerateRequest, GenerateResult, Lifecycle, RoutedExperts, SamplingParams
from .chat import ChatTemplate
from .parsers import HermesParser, ToolCallParser, format_tool_error
from .tools import ToolRegistry
from .trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, Turn

if TYPE_CHECKING:
    from ..client import RolloutClient

__all__ = ["Agent", "AgentConfig", "RewardFn", "RolloutContext", "StalenessError", "ToolAgent", "rollout_group"]

Sample = Mapping[str, Any]
RewardFn = Callable[[Trajectory, Sample], "float | Awaitable[float]"]


class RolloutContext:
    """What an agent loop may do: generate (with its session's affinity), and know the weight version.

    A streaming producer may *preempt* a trajectory (partial mode): its request in flight is aborted, the
    context parks it, and once resumed continues the same turn from the tokens it had (on newer weights),
    so the agent sees one turn whose ``version_segments`` span the update.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        session_id: str | None = None,
        timeout: float | None = None,
        max_staleness: int | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        self.client = client
        self.session_id = session_id or uuid.uuid4().hex
        self.return_routed_experts = return_routed_experts
        #: one per engine call, in order: when and where each ran (exported with the trajectory)
        self.lifecycles: list[Lifecycle] = []
        #: one per engine call when ``return_routed_experts``: the MoE experts of its tokens
        self.routed_experts: list[RoutedExperts] = []
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.first_version: int | None = None
        self.current_rid: str | None = None
        self.preemptions = 0
        self._gate = asyncio.Event()
        self._gate.set()
        self._calls = 0
        #: added to a seeded request's seed, with the turn number, so samples and turns differ
        self.seed_offset = 0

    def _check_staleness(self) -> None:
        if self.max_staleness is not None and self.first_version is not None:
            lag = self.client.weight_version - self.first_version
            if lag > self.max_staleness:
                raise StalenessError(
                    f"trajectory started on weights v{self.first_version}; v{self.client.weight_version} is "
                    f"{lag} versions later (max_staleness={self.max_staleness})"
                )

    def preempt(self) -> bool:
        """Hold this trajectory: abort its request in flight (it resumes after :meth:`resume`)."""
        self._gate.clear()
        rid = self.current_rid
        return rid is not None and self.client.abort(rid)

    def resume(self) -> None:
        self._gate.set()

    @property
    def parked(self) -> bool:
        return not self._gate.is_set()

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateResult:
        """One model turn.  Refuses (StalenessError) to extend a trajectory past its staleness bound."""
        self._calls += 1
        if sampling.seed is not None:
            seed = (sampling.seed + self.seed_offset + 7919 * (self._calls - 1)) % (2**63 - 1)
            sampling = msgspec.structs.replace(sampling, seed=seed)
        req = GenerateRequest(
            input_ids=input_ids,
            sampling=sampling,
            session_id=self.session_id,
            rid=f"{self.session_id}.{self._calls}",
            return_routed_experts=self.return_routed_experts,
        )
        cont = Continuation(req)
        segment = 0
        while True:
            await self._gate.wait()
            self._check_staleness()
            nxt = cont.next_request()
            if not nxt.rid:
                segment += 1
                nxt = msgspec.structs.replace(nxt, rid=f"{req.rid}.{segment}")
            self.current_rid = nxt.rid
            try:
                result = await self.client.generate(nxt, timeout=self.timeout)
            finally:
                self.current_rid = None
            cont.add(result)
            if result.lifecycle is not None:
                self.lifecycles.append(result.lifecycle)
            if result.routed_experts is not None:
                self.routed_experts.append(result.routed_experts)
            if self.first_version is None and result.output_ids:
                segs = result.version_segments
                self.first_version = segs[0][0] if segs else result.weight_version
            if result.finish_reason == "abort" and self.parked and cont.remaining > 0:
                self.preemptions += 1
                continue  # preempted by the producer: wait, then continue from the tokens so far
            return cont.result()

    def finish(self, traj: Trajectory) -> Trajectory:
        """Attach what this context recorded (lifecycles, routed experts) to the agent's trajectory."""
        if not traj.lifecycles:
            traj.lifecycles = list(self.lifecycles)
        if not traj.routed_experts:
            traj.routed_experts = list(self.routed_experts)
        return traj


class Agent(abc.ABC):
    """A rollout policy loop.  ``run`` returns one finished :class:`Trajectory` for ``sample``."""

    @abc.abstractmethod
    async def run(self, ctx: RolloutContext, sample: Sample) -> Trajectory: ...


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Budgets and sampling of :class:`ToolAgent`."""

    max_turns: int = 8
    #: tokens after the prompt (model turns and what the loop adds between them)
    max_response_tokens: int = 4096
    #: per model turn
    max_new_tokens: int = 1024
    #: the whole context; None: the engine's context length
    max_context_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: re-render the whole conversation at the end and compare (always on in tests, opt-in in production)
    drift_check: bool = False
    #: "auto": templates that rewrite earlier turns fall back to local glue; "strict": they raise
    template_strategy: str = "auto"
    #: keep the chat messages in the trajectory
    keep_messages: bool = True

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_response_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")


class ToolAgent(Agent):
    """The default loop: chat messages in, tool calls in the Hermes / Qwen2.5 format, tools from a registry.

    ``sample["messages"]`` is an OpenAI-style message list (system / user ...).  Example::

        registry = ToolRegistry()

        @registry.register
        async def calculator(expression: str) -> str:
            "Evaluate an arithmetic expression."
            ...

        agent = ToolAgent(tokenizer, registry, AgentConfig(max_turns=4))
        traj = await agent.run(RolloutContext(client), {"messages": [{"role": "user", "content": "2+2?"}]})
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: ToolRegistry | None = None,
        config: AgentConfig | None = None,
        *,
        parser: ToolCallParser | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or ToolRegistry()
        self.config = config or AgentConfig()
        self.parser = parser or HermesParser()
        schemas = self.tools.schemas()
        self.chat = ChatTemplate(tokenizer, tools=schemas or None, strategy=self.config.template_strategy)

    async def run(self, ctx: RolloutContext, sample: Sample) -> Trajectory:
        cfg = self.config
        messages: list[dict[str, Any]] = [dict(m) for m in sample["messages"]]
        builder = TrajectoryBuilder(self.chat.prompt_ids(messages), ctx.session_id)
        limit = cfg.max_context_tokens or _engine_context(ctx)
        rewrites = False
        finish = "max_turns"
        for index in range(cfg.max_turns):
            room = min(cfg.max_new_tokens, cfg.max_response_tokens - builder.response_len, limit - builder.num_ids)
            if room < 1:
                finish = "budget"
                break
            t0 = time.perf_counter()
            try:
                result = await ctx.generate(builder.ids, msgspec.structs.replace(cfg.sampling, max_new_tokens=room))
            except StalenessError:
                finish = "stale"
                break
            turn = Turn(
                index=index,
                model_tokens=len(result.output_ids),
                finish_reason=result.finish_reason,
                weight_version=result.weight_version,
                generate_s=time.perf_counter() - t0,
            )
            builder.turns.append(turn)
            builder.add_model(result)
            text = self.tokenizer.decode(result.output_ids, skip_special_tokens=False)
            body = _strip_end(text, self.chat.assistant_suffix)
            parsed = self.parser.parse(body)
            messages.append(_assistant_message(parsed, body))
            if result.finish_reason == "abort":
                finish = "abort"
                break
            if result.finish_reason == "length":
                finish = "length" if room == cfg.max_new_tokens else "budget"
                break
            if not parsed.calls and not parsed.errors:
                finish = "stop"
                break
            t1 = time.perf_counter()
            outcomes = await asyncio.gather(*(self.tools.execute(c) for c in parsed.calls))
            turn.tools_s = time.perf_counter() - t1
            turn.tool_calls = [
                ToolCallRecord(
                    name=c.name, arguments=c.arguments, ok=o.ok, error_kind=o.error_kind, latency_s=o.latency_s
                )
                for c, o in zip(parsed.calls, outcomes, strict=True)
            ]
            for rec in turn.tool_calls:
                ctx.client.metrics.observe_tool_call(rec.name, rec.latency_s, error_kind=rec.error_kind)
            turn.parse_errors = [e.message for e in parsed.errors]
            tool_msgs: list[dict[str, Any]] = [{"role": "tool", "name": o.name, "content": o.content} for o in outcomes]
            tool_msgs += [{"role": "tool", "name": "error", "content": format_tool_error(e)} for e in parsed.errors]
            glue, local = self.chat.glue_ids(messages, tool_msgs, text)
            rewrites = rewrites or local
            if builder.response_len + len(glue) >= cfg.max_response_tokens or builder.num_ids + len(glue) >= limit:
                finish = "budget"
                break
            builder.add_context(glue)
            turn.context_tokens = len(glue)
            messages.extend(tool_msgs)
        drift = None
        if cfg.drift_check:
            report = self.chat.check_drift(
                messages,
                builder.ids,
                template_rewrites=rewrites,
                loss_mask=builder.loss_mask,
                prompt_len=len(builder.prompt_ids),
            )
            drift = None if report.ok else str(report)
        return builder.build(
            finish,
            messages=messages if cfg.keep_messages else [],
            drift=drift,
            template_rewrites=rewrites,
        )


def _engine_context(ctx: RolloutContext) -> int:
    infos = ctx.client.server_info()
    return min((i.limits.max_context for i in infos), default=1 << 30)


def _strip_end(text: str, suffix: str) -> str:
    """The model's text without the end-of-turn marker it generated (e.g. a trailing ``<|im_end|>``)."""
    for k in range(len(suffix), 0, -1):
        if suffix[:k].strip() and text.endswith(suffix[:k]):
            return text[:-k]
    return text


def _assistant_message(parsed: Any, body: str) -> dict[str, Any]:
    # an answer keeps the model's exact text (so a re-rendering reproduces it); a turn with tool calls
    # keeps the text around the calls, which the template writes back in its own format
    content = parsed.content if (parsed.calls or parsed.errors) else body
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if parsed.calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
    return msg


async def _reward(reward: RewardFn, traj: Trajectory, sample: Sample) -> float:
    if asyncio.iscoroutinefunction(reward):
        return float(await reward(traj, sample))
    value = await asyncio.to_thread(reward, traj, sample)
    if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
        value = await value
    return float(value)  # type: ignore[arg-type]


async def rollout_group(
    client: RolloutClient,
    agent: Agent,
    sample: Sample,
    *,
    n: int,
    reward: RewardFn | None = None,
    sample_index: int = -1,
    timeout: float | None = None,
    max_staleness: int | None = None,
    on_error: str = "raise",
) -> list[Trajectory]:
    """``n`` trajectories of one sample (a GRPO group), each rewarded as soon as it finishes.

    The reward function (async, or sync run in a thread) overlaps with the group's other trajectories.
    ``on_error="record"`` turns a failed trajectory into one with ``finish_reason="error"`` instead of
    raising, so the group stays complete.
    """
    if on_error not in ("raise", "record"):
        raise ConfigError("on_error", on_error, "must be 'raise' or 'record'")

    async def one(k: int) -> Trajectory:
        ctx = RolloutContext(client, timeout=timeout, max_staleness=max_staleness)
        ctx.seed_offset = 104_729 * k  # a seeded sampling config still gives n different samples
        try:
            traj = ctx.finish(await agent.run(ctx, sample))
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
        traj.sample_index = sample_index
        if reward is not None:
            traj.reward = await _reward(reward, traj, sample)
        return traj

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
