"""Tool arguments checked against the schema, every problem named with its path and value."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from .schema import json_type

__all__ = ["conversion_problem", "validate_arguments"]


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


def validate_arguments(arguments: Any, schema: dict[str, Any]) -> list[str]:
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
    return json_type(value) == expected


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


_MSGSPEC_PATH_RE = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def conversion_problem(name: str, value: Any, exc: Exception) -> str:
    """A message for a value the schema accepts but msgspec refuses (``Meta`` constraints, ``__post_init__``)."""
    if not isinstance(exc, msgspec.ValidationError):
        return f"{_arg(name)} is invalid: {type(exc).__name__}: {exc}, got {_show(value)}"
    match = _MSGSPEC_PATH_RE.match(str(exc))
    message, sub = (match["message"], match["path"] or "") if match else (str(exc), "")
    if sub:
        return f"{_arg(name + sub)} is invalid: {message}"
    return f"{_arg(name)} is invalid: {message}, got {_show(value)}"
