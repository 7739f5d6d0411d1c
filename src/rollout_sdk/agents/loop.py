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

import asyncio
import inspect
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..errors import ConfigError, StalenessError
from ..protocol import MAX_KEEP_KV_S, SamplingParams, expect_sampling
from ..protocol.checks import check_config_types
from ..rollouts.context import RolloutContext
from ..rollouts.group import Agent, Sample
from ..rollouts.trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder
from .chat import ChatTemplate, message_images
from .parsers import (
    ParsedTurn,
    ParseError,
    ReasoningParser,
    ToolCall,
    ToolCallParser,
    format_tool_error,
    get_parser,
    get_reasoning_parser,
    split_reasoning,
)
from .tools import ToolRegistry, ToolResult

__all__ = ["AgentConfig", "ToolAgent"]


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
    #: the tool-call format (``rollout_sdk.agents.parser_names()``): "hermes", "qwen3_coder", ...
    parser: str = "hermes"
    #: how reasoning is split off before tool calls are parsed (``reasoning_parser_names()``): with
    #: "think", calls inside ``<think>...</think>`` are drafts and never run
    reasoning_parser: str = "think"
    #: agent sessions on the engine (docs/agents.md, "KV kept through tool waits"): every turn asks the
    #: engine to keep the session's KV this many seconds while the tools run, and the session's end releases
    #: it; None: the engine's prefix cache treats the session like any other request
    keep_kv_s: float | None = 60.0

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        expect_sampling(self.sampling, optional=False, error=ConfigError)
        for name in ("max_turns", "max_response_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        get_parser(self.parser)  # unknown names: ConfigError naming the value and the choices
        get_reasoning_parser(self.reasoning_parser)
        if self.keep_kv_s is not None and not 0 < self.keep_kv_s <= MAX_KEEP_KV_S:
            raise ConfigError("keep_kv_s", self.keep_kv_s, f"must be in (0, {MAX_KEEP_KV_S:.0f}] seconds, or None")


class ToolAgent(Agent):
    """The default loop: chat messages in, tool calls in the configured format, tools from a registry.

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
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        if isinstance(tokenizer, (str, bytes, os.PathLike)):
            raise ConfigError("tokenizer", tokenizer, "must be a tokenizer object: AutoTokenizer.from_pretrained(path)")
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ConfigError("tokenizer", tokenizer, "must be a Hugging Face tokenizer with a chat template")
        if isinstance(tools, (list, tuple)):
            raise ConfigError("tools", tools, "must be a ToolRegistry: ToolRegistry([...]) builds one from functions")
        if tools is not None and not isinstance(tools, ToolRegistry):
            raise ConfigError("tools", tools, f"must be a ToolRegistry or None (got {type(tools).__name__})")
        if config is not None and not isinstance(config, AgentConfig):
            raise ConfigError("config", config, f"must be an AgentConfig or None (got {type(config).__name__})")
        self.tokenizer = tokenizer
        self.tools = tools or ToolRegistry()
        self.config = config or AgentConfig()
        schemas = self.tools.schemas()
        self.parser = parser or get_parser(self.config.parser, tools=schemas)
        self.reasoning_parser = reasoning_parser or get_reasoning_parser(self.config.reasoning_parser)
        #: whether the parser counts ids on from earlier turns (the built-in ones do): ids unique per trajectory
        self._counts_ids = _takes_keyword(self.parser.parse, "calls_before")
        self.chat = ChatTemplate(tokenizer, tools=schemas or None, strategy=self.config.template_strategy)

    async def run(self, ctx: RolloutContext, sample: Sample) -> Trajectory:
        try:
            return await self._run(ctx, sample)
        finally:
            if self._keeps(ctx):  # the session is over: its kept KV goes now, not at its lease's end
                await asyncio.shield(ctx.hint(ended=True))

    def _keeps(self, ctx: RolloutContext) -> bool:
        """Whether turns ask the engine to keep the session's KV: a RolloutContext (a duck-typed context,
        e.g. a scripted expert's, is called as before)."""
        return self.config.keep_kv_s is not None and isinstance(ctx, RolloutContext)

    async def _run(self, ctx: RolloutContext, sample: Sample) -> Trajectory:
        cfg = self.config
        messages: list[dict[str, Any]] = [dict(m) for m in sample["messages"]]
        builder = TrajectoryBuilder(self.chat.prompt_ids(messages), ctx.session_id, images=message_images(messages))
        limit = cfg.max_context_tokens or _engine_context(ctx)
        rewrites = False
        finish = "max_turns"
        calls_made = 0
        for index in range(cfg.max_turns):
            room = min(cfg.max_new_tokens, cfg.max_response_tokens - builder.response_len, limit - builder.num_ids)
            if room < 1:
                finish = "budget"
                break
            t0 = time.perf_counter()
            try:
                sampling = msgspec.structs.replace(cfg.sampling, max_new_tokens=room)
                if self._keeps(ctx):
                    result = await ctx.generate(builder.ids, sampling, builder.images, keep_kv_s=cfg.keep_kv_s)
                else:
                    result = await ctx.generate(builder.ids, sampling, builder.images)
            except StalenessError:
                finish = "stale"
                break
            turn = builder.add_turn(result, index=index, generate_s=time.perf_counter() - t0)
            text, body = self.chat.decode_reply(result.output_ids)
            # calls drafted while thinking never run; think tags inside a call's arguments are its text
            reasoning, visible = split_reasoning(self.reasoning_parser, self.parser, body)
            if self._counts_ids:
                parsed = self.parser.parse(visible, calls_before=calls_made)  # type: ignore[call-arg]
            else:
                parsed = self.parser.parse(visible)
            calls_made += len(parsed.calls)
            cut = result.finish_reason in ("abort", "length")
            messages.append(_assistant_message(parsed, body, visible if reasoning is not None else body, cut=cut))
            turn.parse_errors = [e.message for e in parsed.errors]
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
            metrics = getattr(ctx.client, "metrics", None)  # a generator that exports metrics (RolloutClient)
            if metrics is not None:
                for rec in turn.tool_calls:
                    metrics.observe_tool_call(rec.name, rec.latency_s, error_kind=rec.error_kind)
            tool_msgs = _tool_messages(parsed, outcomes, getattr(self.parser, "call_format", None))
            glue, local = self.chat.glue_ids(messages, tool_msgs, text)
            rewrites = rewrites or local
            if builder.response_len + len(glue) >= cfg.max_response_tokens or builder.num_ids + len(glue) >= limit:
                finish = "budget"
                break
            builder.add_context(glue, images=[img for o in outcomes for img in o.images])
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


def _takes_keyword(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _engine_context(ctx: RolloutContext) -> int:
    infos = ctx.client.server_info()
    return min((i.limits.max_context for i in infos), default=1 << 30)


def _tool_messages(parsed: ParsedTurn, outcomes: Sequence[ToolResult], call_format: str | None) -> list[dict[str, Any]]:
    """One tool message per call result and per parse error, in the order they appear in the text."""
    results = iter(outcomes)
    msgs: list[dict[str, Any]] = []
    for item in parsed.in_text_order():
        if isinstance(item, ParseError):
            msgs.append({"role": "tool", "name": "error", "content": format_tool_error(item, call_format)})
        else:
            o = next(results)
            content: Any = o.content
            if o.images:  # a vision-language tool result: image marks, then the text (as Qwen2.5-VL renders)
                content = [*({"type": "image"} for _ in o.images), {"type": "text", "text": o.content}]
            msgs.append({"role": "tool", "name": o.name, "content": content, "tool_call_id": item.id})
    return msgs


def _assistant_message(parsed: ParsedTurn, body: str, visible: str, *, cut: bool) -> dict[str, Any]:
    """The assistant message that re-renders to the model's own text as closely as the template allows.

    A turn without well-formed calls, and a turn cut by the token limit (whose calls, complete or not,
    never run), keep the model's exact text: malformed and partial calls stay in the content, so a
    re-rendering (the drift check) reproduces the tokens.  A turn with calls keeps everything but the
    calls (its reasoning and its malformed blocks too); the template writes the calls back in its format.
    ``visible`` is the text tool calls were parsed from (``body`` less its reasoning).
    """
    if cut or not parsed.calls:
        return {"role": "assistant", "content": body}
    at = body.rfind(visible) if visible else len(body)
    head = body[:at] if at >= 0 else ""  # the reasoning before the content, as the model wrote it
    content = (head + _without_calls(visible, parsed.calls)).strip()
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if parsed.calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
    return msg


def _without_calls(text: str, calls: Sequence[ToolCall]) -> str:
    """``text`` less the raw text of each call (searched in text order)."""
    pieces: list[str] = []
    cursor = 0
    for call in calls:
        at = text.find(call.raw, cursor) if call.raw else -1
        if at == -1:
            continue
        pieces.append(text[cursor:at])
        cursor = at + len(call.raw)
    pieces.append(text[cursor:])
    return "".join(pieces)
