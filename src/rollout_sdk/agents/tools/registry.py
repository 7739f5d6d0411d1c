"""The tools of an agent, and the one place their calls run, without ever breaking a rollout.

:class:`ToolRegistry` runs the calls the model makes to its tools (``definition.py``).  In RL the
caller is a policy that is still learning, so a bad call is data, not a bug: :meth:`ToolRegistry.execute`
never raises for a tool-side problem (unknown tool, bad arguments, the tool raising or hanging).  It
returns a :class:`ToolResult` whose ``content`` tells the model precisely what went wrong
(``argument 'n' must be an integer, got "three"``), so the next turn can fix it, and whose
``error_kind`` lets the trainer count and shape rewards.  Only cancellation of ``execute`` itself
propagates: that is the rollout being stopped, not the tool failing.

On timeout an async tool is cancelled, a thread is abandoned (Python cannot kill it) and keeps a
default-executor worker until it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from rollout_sdk.agents.parsers import ToolCall
from rollout_sdk.errors import ConfigError

from .definition import Tool, ToolArgumentError

__all__ = ["TOOL_ERROR_KINDS", "ToolRegistry", "ToolResult"]

logger = logging.getLogger(__name__)

#: Every ``ToolResult.error_kind`` besides ``None`` (success).
TOOL_ERROR_KINDS = ("unknown_tool", "bad_arguments", "raised", "timeout")


class ToolResult(msgspec.Struct):
    """The outcome of one tool call.  ``content`` goes back to the model: the result or the error message."""

    call_id: str
    name: str
    content: str
    ok: bool
    error_kind: str | None = None
    latency_s: float = 0.0
    #: encoded image files the tool returned (:class:`ToolImage`): they reach a vision-language model as
    #: image tokens inside the tool's result, after ``content``'s text
    images: list[bytes] = []


class ToolImage(msgspec.Struct, frozen=True):
    """What a tool returns to show the model an image (a screenshot, a chart): an encoded image file
    (PNG, JPEG, ...) and optional text.  A tool may also return a list of these and strings."""

    data: bytes
    text: str = ""


class _TimedOut(Exception):
    """The tool ran past its ``timeout_s`` (and was cancelled or abandoned)."""


@dataclasses.dataclass
class _Counts:
    calls: int = 0
    ok: int = 0
    cancelled: int = 0
    latency_s_total: float = 0.0
    errors: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(TOOL_ERROR_KINDS, 0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "ok": self.ok,
            "errors": dict(self.errors),
            "timeouts": self.errors["timeout"],
            "cancelled": self.cancelled,
            "latency_s_total": self.latency_s_total,
        }


class ToolRegistry:
    """The tools of an agent, and the one place their calls run.

    :meth:`execute` never raises for a tool-side problem; see the module docstring.  Per-tool
    concurrency caps are per registry (and per event loop).  Counters: :meth:`stats`.
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._semaphores: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = {}
        self._total = _Counts()
        self._per_tool: dict[str, _Counts] = {}
        for item in tools:
            self.register(item)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def register(self, item: Tool | Callable[..., Any]) -> Tool:
        """Add a :class:`Tool` (or a function, made into one with defaults); usable as a decorator."""
        registered = item if isinstance(item, Tool) else Tool(item)
        if registered.name in self._tools:
            raise ConfigError("name", registered.name, "a tool with this name is already registered")
        self._tools[registered.name] = registered
        self._per_tool[registered.name] = _Counts()
        return registered

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or ``None``."""
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        """Tool names, in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI-format entries of every tool (for the chat template's ``tools=``)."""
        return [registered.schema() for registered in self._tools.values()]

    async def execute(self, call: ToolCall) -> ToolResult:
        """Run one call and describe the outcome; raises only if this coroutine itself is cancelled."""
        started = time.perf_counter()
        registered = self._tools.get(call.name)
        if registered is None:
            return self._finish(call, None, self._unknown_tool_message(call.name), "unknown_tool", started)
        try:
            kwargs = registered.validate(call.arguments)
        except ToolArgumentError as exc:
            return self._finish(call, registered, str(exc), "bad_arguments", started)
        try:
            async with self._limit(registered):
                content, kind = await _run(registered, kwargs)
        except asyncio.CancelledError:
            self._count_cancelled(registered.name)
            raise
        if isinstance(content, tuple):  # the tool returned images
            text, images = content
            return msgspec.structs.replace(self._finish(call, registered, text, kind, started), images=images)
        return self._finish(call, registered, content, kind, started)

    def stats(self) -> dict[str, Any]:
        """Counters since creation (or :meth:`reset_stats`), as plain data.

        ``{"calls", "ok", "errors": {kind: n}, "timeouts", "cancelled", "latency_s_total", "tools": {name: {same}}}``;
        unknown-tool calls count in the totals only.
        """
        result = self._total.as_dict()
        result["tools"] = {name: counts.as_dict() for name, counts in self._per_tool.items()}
        return result

    def reset_stats(self) -> None:
        """Zero every counter (e.g. at the start of a training step)."""
        self._total = _Counts()
        self._per_tool = {name: _Counts() for name in self._tools}

    def _limit(self, registered: Tool) -> contextlib.AbstractAsyncContextManager[Any]:
        if registered.max_concurrency is None:
            return contextlib.nullcontext()
        loop = asyncio.get_running_loop()
        entry = self._semaphores.get(registered.name)
        if entry is None or entry[0] is not loop:
            entry = (loop, asyncio.Semaphore(registered.max_concurrency))
            self._semaphores[registered.name] = entry
        return entry[1]

    def _unknown_tool_message(self, name: str) -> str:
        if not self._tools:
            return f"unknown tool {name!r}; no tools are available"
        return f"unknown tool {name!r}; available tools: {', '.join(repr(n) for n in self._tools)}"

    def _finish(
        self, call: ToolCall, registered: Tool | None, content: str, kind: str | None, started: float
    ) -> ToolResult:
        latency = time.perf_counter() - started
        counters = [self._total] if registered is None else [self._total, self._per_tool[registered.name]]
        for counts in counters:
            counts.calls += 1
            counts.latency_s_total += latency
            if kind is None:
                counts.ok += 1
            else:
                counts.errors[kind] += 1
        return ToolResult(
            call_id=call.id, name=call.name, content=content, ok=kind is None, error_kind=kind, latency_s=latency
        )

    def _count_cancelled(self, name: str) -> None:
        for counts in (self._total, self._per_tool[name]):
            counts.calls += 1
            counts.cancelled += 1


async def _run(registered: Tool, kwargs: Mapping[str, Any]) -> tuple[str | tuple[str, list[bytes]], str | None]:
    """Run the tool under its timeout: ``(content, error_kind)``, content ``(text, images)`` when it returned
    images; re-raises only real cancellation."""
    try:
        value = await _call_with_timeout(registered, kwargs)
    except _TimedOut:
        return f"tool {registered.name!r} timed out after {registered.timeout_s:g} s", "timeout"
    except asyncio.CancelledError as exc:
        if _being_cancelled():
            raise
        return _failure_message(registered, exc), "raised"
    except Exception as exc:
        return _failure_message(registered, exc), "raised"
    images = _images_of(value)
    if images is not None:
        return images, None
    try:
        return _encode_result(value), None
    except Exception as exc:
        return f"tool {registered.name!r} returned a value that cannot be encoded as JSON: {exc}", "raised"


async def _call_with_timeout(registered: Tool, kwargs: Mapping[str, Any]) -> Any:
    if registered.timeout_s is None:
        return await registered.invoke(kwargs)
    deadline = asyncio.timeout(registered.timeout_s)
    try:
        async with deadline:
            return await registered.invoke(kwargs)
    except TimeoutError:
        if deadline.expired():
            raise _TimedOut from None
        raise  # the tool's own TimeoutError: it failed, it did not time out


def _being_cancelled() -> bool:
    """Whether the running task has a pending cancellation (as opposed to the tool raising CancelledError)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _failure_message(registered: Tool, exc: BaseException) -> str:
    logger.debug("tool %r raised", registered.name, exc_info=exc)
    detail = str(exc)
    reason = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return f"tool {registered.name!r} failed: {reason}"


def _images_of(value: Any) -> tuple[str, list[bytes]] | None:
    """``(text, images)`` of a ToolImage, or of a list of ToolImages and strings; None for anything else."""
    parts = value if isinstance(value, list) else [value]
    if not any(isinstance(p, ToolImage) for p in parts) or not all(isinstance(p, ToolImage | str) for p in parts):
        return None
    texts = [p.text if isinstance(p, ToolImage) else p for p in parts]
    return "".join(texts), [p.data for p in parts if isinstance(p, ToolImage)]


def _encode_result(value: Any) -> str:
    """Strings go back as they are; anything else as JSON (unknown types via ``str``)."""
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value, enc_hook=str).decode()
