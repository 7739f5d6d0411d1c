"""Tools for multi-turn agent rollouts: typed functions the policy calls, run without ever breaking a rollout.

A tool is an ordinary typed Python function.  :func:`tool` derives from its signature and docstring the
JSON Schema the model is shown, and :class:`ToolRegistry` runs the calls the model makes.  In RL the
caller is a policy that is still learning, so a bad call is data, not a bug: :meth:`ToolRegistry.execute`
never raises for a tool-side problem (unknown tool, bad arguments, the tool raising or hanging).  It
returns a :class:`ToolResult` whose ``content`` tells the model precisely what went wrong
(``argument 'n' must be an integer, got "three"``), so the next turn can fix it, and whose
``error_kind`` lets the trainer count and shape rewards.  Only cancellation of ``execute`` itself
propagates: that is the rollout being stopped, not the tool failing.

Arguments are checked against the derived schema (JSON types, enums, nested objects, tuples) before
the function runs, then converted to the annotated Python types with msgspec, so a tool receives
``Enum`` members, ``msgspec.Struct`` / dataclass / ``TypedDict`` values and tuples, not raw JSON.
Synchronous tools run in a worker thread (``asyncio.to_thread``) so they never block the event loop
that drives hundreds of concurrent rollouts; on timeout an async tool is cancelled, a thread is
abandoned (Python cannot kill it) and keeps a default-executor worker until it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

import msgspec

from rollout_sdk.agents.parsers import ToolCall
from rollout_sdk.errors import ConfigError, RolloutError

from .docstrings import parse_docstring
from .schema import signature_schema
from .validation import conversion_problem, validate_arguments

__all__ = [
    "TOOL_ERROR_KINDS",
    "Tool",
    "ToolArgumentError",
    "ToolRegistry",
    "ToolResult",
    "tool",
]

logger = logging.getLogger(__name__)

#: Every ``ToolResult.error_kind`` besides ``None`` (success).
TOOL_ERROR_KINDS = ("unknown_tool", "bad_arguments", "raised", "timeout")

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolResult(msgspec.Struct):
    """The outcome of one tool call.  ``content`` goes back to the model: the result or the error message."""

    call_id: str
    name: str
    content: str
    ok: bool
    error_kind: str | None = None
    latency_s: float = 0.0


class ToolArgumentError(RolloutError, ValueError):
    """Arguments that do not match a tool's parameters.  ``problems`` lists each one, with its path."""

    def __init__(self, tool_name: str, problems: list[str]) -> None:
        self.tool_name = tool_name
        self.problems = list(problems)
        super().__init__(f"invalid arguments for tool {tool_name!r}: {'; '.join(self.problems)}")


# -- Tool -----------------------------------------------------------------------------------------


class Tool:
    """A typed function the model can call, with its JSON Schema and run limits.

    ``fn`` is the original function and stays callable.  ``parameters`` is the JSON Schema of the
    arguments (``additionalProperties: false``); ``timeout_s`` (``None``: no limit) bounds one run;
    ``max_concurrency`` (``None``: unbounded) caps simultaneous runs per :class:`ToolRegistry`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = 30.0,
        max_concurrency: int | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a tool must wrap a function, got {fn!r}")
        self.fn = fn
        self.name = _check_name(name if name is not None else getattr(fn, "__name__", ""))
        self.timeout_s = _check_timeout(timeout_s)
        self.max_concurrency = _check_max_concurrency(max_concurrency)
        summary, arg_docs = parse_docstring(inspect.getdoc(fn))
        self.description = summary if description is None else description
        self._params, self.parameters = signature_schema(fn, self.name, arg_docs)
        self.is_async = _is_async_callable(fn)

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, timeout_s={self.timeout_s!r}, max_concurrency={self.max_concurrency!r})"

    def schema(self) -> dict[str, Any]:
        """The OpenAI tools entry: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``arguments`` against the schema and convert them to the annotated types.

        Returns the keyword arguments for ``fn`` (absent optional ones left to the function's defaults).
        Raises :class:`ToolArgumentError` listing every problem, each naming the argument path and value.
        """
        problems = validate_arguments(arguments, self.parameters)
        if problems:
            raise ToolArgumentError(self.name, problems)
        kwargs: dict[str, Any] = {}
        for param in self._params:
            if param.name in arguments:
                try:
                    kwargs[param.name] = msgspec.convert(arguments[param.name], param.annotation)
                except Exception as exc:
                    problems.append(conversion_problem(param.name, arguments[param.name], exc))
        if problems:
            raise ToolArgumentError(self.name, problems)
        return kwargs

    async def invoke(self, kwargs: Mapping[str, Any]) -> Any:
        """Run ``fn`` with validated ``kwargs``: awaited if async, in a worker thread if not.  No limits."""
        if self.is_async:
            return await self.fn(**kwargs)
        return await asyncio.to_thread(self.fn, **kwargs)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError("name", name, "a tool name must be 1-64 characters of letters, digits, '_' or '-'")
    return name


def _check_timeout(timeout_s: float | None) -> float | None:
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s):
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds or None")
    if timeout_s <= 0:
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds or None")
    return float(timeout_s)


def _check_max_concurrency(value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("max_concurrency", value, "must be a positive integer or None")
    return value


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = 30.0,
    max_concurrency: int | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = 30.0,
    max_concurrency: int | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function into a :class:`Tool`; use bare (``@tool``) or with options (``@tool(...)``).

    The name defaults to the function's, the description to the docstring's first paragraph, and a
    Google-style ``Args:`` section describes the parameters.  Unsupported annotations, unannotated
    parameters and ``*args`` / ``**kwargs`` raise ``TypeError`` here, at decoration time.
    """

    def wrap(function: Callable[..., Any]) -> Tool:
        return Tool(function, name=name, description=description, timeout_s=timeout_s, max_concurrency=max_concurrency)

    return wrap if fn is None else wrap(fn)


# -- registry -------------------------------------------------------------------------------------


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


async def _run(registered: Tool, kwargs: Mapping[str, Any]) -> tuple[str, str | None]:
    """Run the tool under its timeout: ``(content, error_kind)``; re-raises only real cancellation."""
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


def _encode_result(value: Any) -> str:
    """Strings go back as they are; anything else as JSON (unknown types via ``str``)."""
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value, enc_hook=str).decode()
