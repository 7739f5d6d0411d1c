"""Typed values from the tool schemas offered to the model, for formats whose values are untyped text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .scan import _loads


def _parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``{tool name: {parameter name: schema}}`` from OpenAI tool schemas (or bare function schemas)."""
    out: dict[str, dict[str, Any]] = {}
    for item in tools or ():
        if not isinstance(item, Mapping):
            continue
        fn = item.get("function", item)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    types: set[str] = set()
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(x for x in declared if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            types |= _schema_types(branch)
    return types


def _typed_value(value: str, schema: Any) -> Any:
    """A parameter value as its schema's type says (a string when it does not say, or it does not fit)."""
    types = _schema_types(schema)
    if not types or ("string" in types and not ("null" in types and value.strip() == "null")):
        return value
    text = value.strip()
    if "boolean" in types and text in ("True", "False"):
        return text == "True"
    try:
        decoded = _loads(text)
    except ValueError:
        return value
    if not _fits(decoded, types):
        return value
    if isinstance(decoded, float) and "number" not in types:  # an integer parameter written as 3.0
        return int(decoded)
    return decoded


def _fits(value: Any, types: set[str]) -> bool:
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if isinstance(value, list):
        return "array" in types
    if isinstance(value, dict):
        return "object" in types
    return False
