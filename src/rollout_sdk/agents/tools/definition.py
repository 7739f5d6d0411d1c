"""A tool: an ordinary typed Python function the policy calls, with the JSON Schema the model is shown.

:func:`tool` (or :class:`Tool`) derives from the function's signature and docstring the JSON Schema of its
arguments.  Arguments are checked against that schema (JSON types, enums, nested objects, tuples) before
the function runs, then converted to the annotated Python types with msgspec, so a tool receives
``Enum`` members, ``msgspec.Struct`` / dataclass / ``TypedDict`` values and tuples, not raw JSON.
Synchronous tools run in a worker thread (``asyncio.to_thread``) so they never block the event loop
that drives hundreds of concurrent rollouts.  The calls themselves run in a :class:`ToolRegistry`
(``registry.py``), with the timeouts, concurrency caps and error reporting.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, overload

import msgspec

from rollout_sdk.errors import ConfigError, RolloutError

from .docstrings import parse_docstring
from .schema import signature_schema
from .validation import conversion_problem, validate_arguments

__all__ = ["Tool", "ToolArgumentError", "tool"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolArgumentError(RolloutError, ValueError):
    """Arguments that do not match a tool's parameters.  ``problems`` lists each one, with its path."""

    def __init__(self, tool_name: str, problems: list[str]) -> None:
        self.tool_name = tool_name
        self.problems = list(problems)
        super().__init__(f"invalid arguments for tool {tool_name!r}: {'; '.join(self.problems)}")


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
