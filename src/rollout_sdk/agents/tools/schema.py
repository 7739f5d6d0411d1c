"""JSON Schema of a tool's parameters, derived from its type hints."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

__all__ = ["Param", "json_type", "signature_schema"]


# -- JSON Schema from type hints ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    annotation: Any


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
        kinds = {json_type(v) for v in values}
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


def json_type(value: Any) -> str:
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


def signature_schema(
    fn: Callable[..., Any], tool_name: str, arg_docs: Mapping[str, str]
) -> tuple[tuple[Param, ...], dict[str, Any]]:
    """The parameters of ``fn`` and their top-level object schema; TypeError for what cannot be a tool."""
    hints = _type_hints(fn, tool_name)
    params: list[Param] = []
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
        params.append(Param(param.name, annotation))
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
