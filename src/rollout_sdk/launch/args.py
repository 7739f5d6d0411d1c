"""Derive command-line options from a component's keyword-only config dataclass.

Each field becomes ``--<prefix><field-name>`` with the field's default and type; the field's ``#:``
comment in the source is not available at run time, so help shows the type and default.  Fields whose
type is not a plain scalar (or Optional scalar) are skipped: they are set from Python, not the shell.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "OneLineErrors",
    "add_config_args",
    "add_sglang_args",
    "config_from_args",
    "number",
    "port_number",
    "sglang_fields",
]

C = TypeVar("C")
_SCALARS = (int, float, str, bool)


def _scalar(tp: Any) -> tuple[type, bool] | None:
    """(scalar type, optional) for ``int``, ``int | None``, ...; None for anything else."""
    if tp in _SCALARS:
        return tp, False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS and len(typing.get_args(tp)) == 2:
            return args[0], True
    return None


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], type, bool]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        s = _scalar(hints[f.name])
        if s is not None:
            out.append((f, s[0], s[1]))
    return out


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    prefix: str = "",
    title: str | None = None,
    skip: tuple[str, ...] = (),
    only_given: bool = False,
) -> None:
    """``only_given``: a flag not given leaves no attribute (the config's default, or another source, applies)."""
    group = parser.add_argument_group(title or cls.__name__)
    for f, tp, optional in _fields(cls):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        dest = prefix.replace("-", "_") + f.name
        if tp is bool:
            group.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS if only_given else default,
                help=f"(default: {default})",
            )
            continue
        conv: Callable[[str], Any] = number(tp) if tp in (int, float) else tp
        if optional:

            def conv_optional(text: str, _conv: Callable[[str], Any] = conv) -> Any:
                return None if text.lower() in ("none", "") else _conv(text)

            conv = conv_optional

        group.add_argument(
            flag,
            dest=dest,
            type=conv,
            default=argparse.SUPPRESS if only_given else default,
            metavar=tp.__name__.upper(),
            help=f"(default: {default})",
        )


def number(tp: type) -> Callable[[str], Any]:
    """An argparse ``type`` for an int or float flag: finite numbers only (``nan`` and ``inf`` parse as
    floats and pass every ``<``/``>`` check a config makes); each config's ``__post_init__`` checks the range."""
    import math

    def convert(text: str) -> Any:
        try:
            value = tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if tp is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        return value

    convert.__name__ = tp.__name__  # argparse names the type in its messages
    return convert


def port_number(text: str) -> int:
    """An argparse ``type`` for a TCP port: 0 (a free one) to 65535."""
    value = int(number(int)(text))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535; 0 picks a free one)")
    return value


class OneLineErrors(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the full usage of ``serve`` is a page long)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def config_from_args(cls: type[C], args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> C:
    values = {}
    for f, _, _ in _fields(cls):
        dest = prefix.replace("-", "_") + f.name
        if hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    values.update(overrides)
    return cls(**values)


def add_sglang_args(parser: argparse.ArgumentParser) -> None:
    """SGLang engine options: ``--sglang-<field>`` flags (each scalar field of ``SglangEngineConfig``; the
    model is ``--model``) and ``--sglang '<JSON>'`` for any field, flags winning.  Shared by
    ``rollout-sdk serve`` and ``python -m rollout_sdk.launch`` so both take the same options."""
    from ..engines.sglang import SglangEngineConfig

    add_config_args(
        parser, SglangEngineConfig, prefix="sglang-", title="sglang engine (--engine sglang)", skip=("model_path",),
        only_given=True,
    )
    parser.add_argument(
        "--sglang", default="{}", metavar="JSON", help="more SglangEngineConfig fields as a JSON object"
    )


def sglang_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The SglangEngineConfig fields the command line gives (JSON first, then the flags)."""
    import json

    from ..engines.sglang import SglangEngineConfig
    from ..errors import ConfigError

    try:
        fields = json.loads(args.sglang)
    except json.JSONDecodeError as exc:
        raise ConfigError("--sglang", args.sglang, f"is not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ConfigError("--sglang", args.sglang, "must be a JSON object of SglangEngineConfig fields")
    known = {f.name for f in dataclasses.fields(SglangEngineConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError("--sglang", unknown, f"unknown SglangEngineConfig fields (known: {', '.join(sorted(known))})")
    for f, _, _ in _fields(SglangEngineConfig):
        if hasattr(args, "sglang_" + f.name):
            fields[f.name] = getattr(args, "sglang_" + f.name)
    return fields
