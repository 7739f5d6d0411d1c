"""Argument types checked where a user passes them: one line naming the argument and the type it wants.

Python does not check annotations, and msgspec checks a Struct's field types only while decoding bytes: a
``SamplingParams(temperature="hot")`` built in user code would otherwise fail deep inside the scheduler
(or, for ``max_new_tokens=16.5``, only when the engine sees it).  :func:`expect` is the one check every
public constructor and call uses; :func:`check_config_types` applies it to a config dataclass's scalar
fields.  ``bool`` is not accepted where a number is asked for (``True`` is an ``int`` to Python, never a
temperature to a user); an ``int`` is accepted where a ``float`` is.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, InvalidRequestError

__all__ = ["check_config_types", "expect", "expect_ids"]

_NAMES = {int: "an int", float: "a number", str: "a string", bool: "a bool (True/False)"}


def _matches(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # True is an int to Python, never a count or a temperature to a user
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def expect(
    field: str,
    value: Any,
    kind: type | tuple[type, ...],
    *,
    optional: bool = False,
    error: type[InvalidRequestError] | type[ConfigError] = InvalidRequestError,
) -> None:
    """Raise ``error(field, value, "must be <kind>")`` unless ``value`` is of ``kind`` (or None, ``optional``)."""
    if value is None and optional:
        return
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if any(_matches(value, k) for k in kinds):
        return
    want = " or ".join(_NAMES.get(k, f"a {k.__name__}") for k in kinds) + (" or None" if optional else "")
    raise error(field, value, f"must be {want} (got {type(value).__name__})")


def expect_ids(
    field: str, value: Any, *, error: type[InvalidRequestError] | type[ConfigError] = InvalidRequestError
) -> None:
    """A list (or tuple) of int token ids."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error(field, value, f"must be a list of int token ids (got {type(value).__name__})")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise error(f"{field}[{i}]", t, f"must be an int token id (got {type(t).__name__})")


_SCALARS = (int, float, str, bool)


@functools.cache
def _scalar_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """(name, scalar type, optional) of each field typed as a scalar or an Optional scalar."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if tp in _SCALARS:
            out.append((f.name, tp, False))
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1 and rest[0] in _SCALARS and len(args) == 2:
                out.append((f.name, rest[0], True))
    return tuple(out)


def check_config_types(config: Any) -> None:
    """Every scalar field of the dataclass ``config`` holds its annotated type (ConfigError naming it)."""
    for name, kind, optional in _scalar_fields(type(config)):  # type: ignore[arg-type]
        expect(name, getattr(config, name), kind, optional=optional, error=ConfigError)
