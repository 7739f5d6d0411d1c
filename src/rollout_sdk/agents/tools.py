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
import enum
import inspect
import json
import logging
import math
import re
import time
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, overload

import msgspec

from rollout_sdk.agents.parsers import ToolCall
from rollout_sdk.errors import ConfigError, RolloutError

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


# -- JSON Schema from type hints ------------------------------------------------------------------

_SUPPORTED = (
    "str, int, float, bool, None, Any, list[T], tuple[...], dict[str, T], Literal[...], Enum, "
    "Optional[T] / unions, msgspec.Struct, dataclass, TypedDict"
)
_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class _SchemaBuilder:
    """Derives the schema of one parameter; ``param`` and the path name it in errors."""

    def __init__(self, tool_name: str, param: str) -> None:
        self.tool_name = tool_name
        self.param = param

    def build(self, tp: Any) -> dict[str, Any]:
        return self._schema(tp, self.param, ())

    def _fail(self, tp: Any, path: str, reason: str = "unsupported type annotation") -> TypeError:
        where = f" (at {path!r})" if path != self.param else ""
        return TypeError(
            f"tool {self.tool_name!r}: parameter {self.param!r}{where}: {reason} {_type_name(tp)}; "
            f"supported: {_SUPPORTED}"
        )

    def _schema(self, tp: Any, path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        tp = _strip_annotated(tp)
        if tp is Any:
            return {}
        if tp is None or tp is type(None):
            return {"type": "null"}
        if tp in _SCALARS:
            return {"type": _SCALARS[tp]}
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Union or origin is types.UnionType:
            return {"anyOf": [self._schema(arg, path, seen) for arg in args]}
        if origin is Literal:
            return self._enum(list(args), tp, path)
        if tp is list or origin is list:
            return self._array(args, path, seen)
        if tp is tuple or origin is tuple:
            return self._tuple(args, path, seen)
        if tp is dict or origin is dict:
            return self._dict(tp, args, path, seen)
        if isinstance(tp, type):
            return self._class(tp, path, seen)
        raise self._fail(tp, path)

    def _enum(self, values: list[Any], tp: Any, path: str) -> dict[str, Any]:
        if not values or not all(v is None or isinstance(v, (str, int)) for v in values):
            raise self._fail(tp, path, "enum values must be str, int, bool or None in")
        kinds = {_json_type(v) for v in values}
        schema: dict[str, Any] = {"type": kinds.pop()} if len(kinds) == 1 else {}
        schema["enum"] = values
        return schema

    def _array(self, args: tuple[Any, ...], path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        if not args:
            return {"type": "array"}
        return {"type": "array", "items": self._schema(args[0], f"{path}[]", seen)}

    def _tuple(self, args: tuple[Any, ...], path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": self._schema(args[0], f"{path}[]", seen)}
        items = [self._schema(arg, f"{path}[{i}]", seen) for i, arg in enumerate(args)]
        return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}

    def _dict(self, tp: Any, args: tuple[Any, ...], path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        if not args:
            return {"type": "object"}
        if _strip_annotated(args[0]) is not str:
            raise self._fail(tp, path, "dict keys must be str (JSON object keys) in")
        return {"type": "object", "additionalProperties": self._schema(args[1], f"{path}{{}}", seen)}

    def _class(self, tp: type, path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        if issubclass(tp, enum.Enum):
            return self._enum([member.value for member in tp], tp, path)
        if tp in seen:
            raise self._fail(tp, path, "recursive type")
        seen = (*seen, tp)
        if issubclass(tp, msgspec.Struct):
            return self._struct(tp, path, seen)
        if dataclasses.is_dataclass(tp):
            return self._dataclass(tp, path, seen)
        if typing.is_typeddict(tp):
            return self._typeddict(tp, path, seen)
        raise self._fail(tp, path)

    def _struct(self, tp: type[msgspec.Struct], path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        config = tp.__struct_config__
        if config.array_like or config.tag is not None:
            raise self._fail(tp, path, "array_like or tagged Structs are not supported:")
        fields = [
            (f.encode_name, f.type, _MISSING if f.default is msgspec.NODEFAULT else f.default, f.required)
            for f in msgspec.structs.fields(tp)
        ]
        return self._object(fields, path, seen)

    def _dataclass(self, tp: type, path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        hints = self._hints(tp, path)
        fields = []
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = _MISSING if f.default is dataclasses.MISSING else f.default
            fields.append((f.name, hints[f.name], default, required))
        return self._object(fields, path, seen)

    def _typeddict(self, tp: type, path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        hints = self._hints(tp, path)
        required_keys: frozenset[str] = getattr(tp, "__required_keys__", frozenset(hints))
        fields = [
            (name, hint, _MISSING, _typeddict_required(hint, name in required_keys)) for name, hint in hints.items()
        ]
        return self._object(fields, path, seen)

    def _hints(self, tp: type, path: str) -> dict[str, Any]:
        try:
            return typing.get_type_hints(tp, include_extras=True)
        except Exception as exc:
            raise self._fail(tp, path, f"cannot resolve the annotations ({type(exc).__name__}: {exc}) of") from exc

    def _object(self, fields: list[tuple[str, Any, Any, bool]], path: str, seen: tuple[Any, ...]) -> dict[str, Any]:
        properties: dict[str, Any] = {}
        required: list[str] = []
        for name, hint, default, is_required in fields:
            properties[name] = _with_default(self._schema(hint, f"{path}.{name}", seen), default)
            if is_required:
                required.append(name)
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_MISSING: Any = object()


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = tp.__origin__
    if typing.get_origin(tp) in (typing.Required, typing.NotRequired):
        return _strip_annotated(typing.get_args(tp)[0])
    return tp


def _typeddict_required(hint: Any, listed: bool) -> bool:
    """Whether a TypedDict key is required.

    ``Required[...]`` / ``NotRequired[...]`` win over ``__required_keys__``: under
    ``from __future__ import annotations`` Python 3.11 cannot see them when it builds that set.
    """
    while typing.get_origin(hint) is typing.Annotated:
        hint = hint.__origin__
    origin = typing.get_origin(hint)
    if origin is typing.NotRequired:
        return False
    return listed or origin is typing.Required


def _annotated_description(tp: Any) -> str | None:
    """A description attached with ``Annotated[T, "text"]`` or ``Annotated[T, msgspec.Meta(description=...)]``."""
    if typing.get_origin(tp) is not typing.Annotated:
        return None
    for meta in tp.__metadata__:
        if isinstance(meta, str):
            return meta
        if isinstance(meta, msgspec.Meta) and meta.description:
            return meta.description
    return None


def _with_default(schema: dict[str, Any], default: Any) -> dict[str, Any]:
    """``schema`` plus ``"default"`` when the default is JSON-encodable (shown to the model)."""
    if default is _MISSING or default is inspect.Parameter.empty:
        return schema
    try:
        builtin = msgspec.to_builtins(default)
        json.dumps(builtin, allow_nan=False)
    except (TypeError, ValueError):
        return schema
    return {**schema, "default": builtin}


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__name__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"
    return repr(tp)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    return "object"


# -- docstrings -----------------------------------------------------------------------------------

_SECTION_RE = re.compile(
    r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Returns?|Yields?|Raises|"
    r"Examples?|Notes?|Attributes|See Also|Warnings?|Todo)\s*:\s*$",
    re.IGNORECASE,
)
_ARGS_SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments"}
_ARG_LINE_RE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """The first paragraph (one line) and the Google-style ``Args:`` descriptions of ``doc``."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION_RE.match(line):
            break
        summary.append(line.strip())
    return " ".join(summary), _arg_descriptions(lines)


def _arg_descriptions(lines: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    i = 0
    while i < len(lines):
        match = _SECTION_RE.match(lines[i])
        if match and match.group(1).lower() in _ARGS_SECTIONS:
            i = _read_args_section(lines, i + 1, _indent(lines[i]), found)
        else:
            i += 1
    return found


def _read_args_section(lines: list[str], i: int, header_indent: int, found: dict[str, str]) -> int:
    """Read entries (``name (type): text`` plus more-indented continuation lines); return the next line."""
    entry_indent: int | None = None
    current: str | None = None
    while i < len(lines):
        line = lines[i]
        if line.strip():
            indent = _indent(line)
            if indent <= header_indent:
                break
            entry_indent = indent if entry_indent is None else entry_indent
            match = _ARG_LINE_RE.match(line.strip())
            if indent == entry_indent and match:
                current = match["name"]
                found[current] = match["text"].strip()
            elif current is not None:
                found[current] = f"{found[current]} {line.strip()}".strip()
        i += 1
    return i


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# -- argument validation --------------------------------------------------------------------------

_NOUNS = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "null": "null",
    "array": "an array",
    "object": "an object",
}


def _validate(arguments: Any, schema: dict[str, Any]) -> list[str]:
    """Every mismatch between ``arguments`` and the top-level object ``schema``, as messages."""
    if not isinstance(arguments, Mapping):
        return [f"arguments must be a JSON object, got {_show(arguments)}"]
    problems: list[str] = []
    _check_object(arguments, schema, "", problems)
    return problems


def _check(value: Any, schema: dict[str, Any], path: str, problems: list[str]) -> None:
    if "enum" in schema:
        if not any(_same(value, option) for option in schema["enum"]):
            problems.append(f"{_arg(path)} must be {_describe(schema)}, got {_show(value)}")
    elif "anyOf" in schema:
        _check_any_of(value, schema, path, problems)
    elif "type" in schema:
        if not _is_type(value, schema["type"]):
            problems.append(f"{_arg(path)} must be {_describe(schema)}, got {_show(value)}")
        elif schema["type"] == "array":
            _check_array(value, schema, path, problems)
        elif schema["type"] == "object":
            _check_object(value, schema, path, problems)


def _check_any_of(value: Any, schema: dict[str, Any], path: str, problems: list[str]) -> None:
    """Pass if a branch passes; else report the one branch of the value's shape, or all branches."""
    shaped: list[list[str]] = []
    for branch in schema["anyOf"]:
        found: list[str] = []
        _check(value, branch, path, found)
        if not found:
            return
        if "enum" not in branch and ("type" not in branch or _is_type(value, branch["type"])):
            shaped.append(found)
    if len(shaped) == 1:
        problems.extend(shaped[0])
    else:
        problems.append(f"{_arg(path)} must be {_describe(schema)}, got {_show(value)}")


def _check_array(value: Any, schema: dict[str, Any], path: str, problems: list[str]) -> None:
    prefix = schema.get("prefixItems")
    if prefix is not None:
        if len(value) != len(prefix):
            problems.append(f"{_arg(path)} must be an array of {len(prefix)} items, got {len(value)}: {_show(value)}")
            return
        for i, (item, item_schema) in enumerate(zip(value, prefix, strict=True)):
            _check(item, item_schema, f"{path}[{i}]", problems)
    elif "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", problems)


def _check_object(value: Mapping[str, Any], schema: dict[str, Any], path: str, problems: list[str]) -> None:
    properties: dict[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    problems.extend(_missing(name, path) for name in schema.get("required", ()) if name not in value)
    if extra is False:
        problems.extend(_unexpected(key, path, properties) for key in value if key not in properties)
    for name, prop in properties.items():
        if name in value:
            _check(value[name], prop, _join(path, name), problems)
    if isinstance(extra, dict):
        for key, item in value.items():
            if key not in properties:
                _check(item, extra, _join(path, key), problems)


def _missing(name: str, path: str) -> str:
    return f"missing required argument {name!r}" if not path else f"{_arg(path)} is missing required field {name!r}"


def _unexpected(key: Any, path: str, properties: Mapping[str, Any]) -> str:
    accepted = ", ".join(repr(name) for name in properties)
    hint = f"accepted: {accepted}" if accepted else "it takes none"
    if not path:
        return f"unexpected argument {key!r} ({hint})"
    return f"{_arg(path)} has unexpected field {key!r} ({hint})"


def _is_type(value: Any, expected: str | list[str]) -> bool:
    if isinstance(expected, list):
        return any(_is_type(value, one) for one in expected)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "object":
        return isinstance(value, Mapping)
    return _json_type(value) == expected


def _same(value: Any, option: Any) -> bool:
    """JSON equality: ``true`` is not ``1`` and ``1.0`` is not ``1``."""
    return type(value) is type(option) and bool(value == option)


def _describe(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(_show(option) for option in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_describe(branch) for branch in schema["anyOf"])
    kind = schema.get("type")
    if kind is None:
        return "any value"
    kinds: list[str] = kind if isinstance(kind, list) else [kind]
    return " or ".join(_NOUNS.get(one, one) for one in kinds)


def _arg(path: str) -> str:
    return f"argument {path!r}"


def _join(path: str, key: str) -> str:
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _show(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except ValueError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- Tool -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Param:
    name: str
    annotation: Any


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
        summary, arg_docs = _parse_docstring(inspect.getdoc(fn))
        self.description = summary if description is None else description
        self._params, self.parameters = _signature_schema(fn, self.name, arg_docs)
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
        problems = _validate(arguments, self.parameters)
        if problems:
            raise ToolArgumentError(self.name, problems)
        kwargs: dict[str, Any] = {}
        for param in self._params:
            if param.name in arguments:
                try:
                    kwargs[param.name] = msgspec.convert(arguments[param.name], param.annotation)
                except Exception as exc:
                    problems.append(_conversion_problem(param.name, arguments[param.name], exc))
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


def _signature_schema(
    fn: Callable[..., Any], tool_name: str, arg_docs: Mapping[str, str]
) -> tuple[tuple[_Param, ...], dict[str, Any]]:
    """The parameters of ``fn`` and their top-level object schema; TypeError for what cannot be a tool."""
    hints = _type_hints(fn, tool_name)
    params: list[_Param] = []
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        _check_param_kind(param, tool_name)
        if param.name not in hints:
            raise TypeError(
                f"tool {tool_name!r}: parameter {param.name!r} has no type annotation; "
                "tool parameters need one to derive the JSON schema"
            )
        annotation = hints[param.name]
        _check_msgspec_supports(annotation, tool_name, param.name)
        schema = _with_default(_SchemaBuilder(tool_name, param.name).build(annotation), param.default)
        description = arg_docs.get(param.name) or _annotated_description(annotation)
        if description:
            schema = {"description": description, **schema}
        properties[param.name] = schema
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        params.append(_Param(param.name, annotation))
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return tuple(params), schema


def _type_hints(fn: Callable[..., Any], tool_name: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise TypeError(
            f"tool {tool_name!r}: cannot resolve the type annotations of {fn!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _check_param_kind(param: inspect.Parameter, tool_name: str) -> None:
    if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        star = "*" if param.kind is inspect.Parameter.VAR_POSITIONAL else "**"
        raise TypeError(
            f"tool {tool_name!r}: parameter {star}{param.name} is not allowed; "
            "a tool takes named, typed parameters (the model passes a JSON object)"
        )
    if param.kind is inspect.Parameter.POSITIONAL_ONLY:
        raise TypeError(
            f"tool {tool_name!r}: parameter {param.name!r} is positional-only; "
            "tool arguments are passed by name (the model passes a JSON object)"
        )


def _check_msgspec_supports(annotation: Any, tool_name: str, param: str) -> None:
    """Fail at decoration, not at the first call, if msgspec cannot convert to ``annotation``."""
    try:
        msgspec.json.Decoder(annotation)
    except TypeError as exc:
        raise TypeError(
            f"tool {tool_name!r}: parameter {param!r}: unsupported type annotation {_type_name(annotation)}: {exc}; "
            f"supported: {_SUPPORTED}"
        ) from exc


_MSGSPEC_PATH_RE = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _conversion_problem(name: str, value: Any, exc: Exception) -> str:
    """A message for a value the schema accepts but msgspec refuses (``Meta`` constraints, ``__post_init__``)."""
    if not isinstance(exc, msgspec.ValidationError):
        return f"{_arg(name)} is invalid: {type(exc).__name__}: {exc}, got {_show(value)}"
    match = _MSGSPEC_PATH_RE.match(str(exc))
    message, sub = (match["message"], match["path"] or "") if match else (str(exc), "")
    if sub:
        return f"{_arg(name + sub)} is invalid: {message}"
    return f"{_arg(name)} is invalid: {message}, got {_show(value)}"


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
