"""Derive command-line options from a component's keyword-only config dataclass.

Each field becomes ``--<prefix><field-name>`` with the field's default and type; its help is the field's
``#:`` comment in the config's source (read when the parser is built, so the config is documented once),
then its default.  Fields whose type is not a plain scalar (or Optional scalar) are skipped: they are set
from Python, not the shell.  Fields documented as deprecated are accepted but not listed.

Also the argument types every command shares (checked when the command line is parsed, before any work:
a path whose directory is missing, an address without its scheme, a log level) and :class:`OneLineErrors`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ConfigError

__all__ = [
    "LOG_LEVELS",
    "OneLineErrors",
    "add_config_args",
    "add_sglang_args",
    "config_from_args",
    "existing_dir",
    "field_help",
    "log_level",
    "number",
    "port_number",
    "server_address",
    "sglang_fields",
    "writable_file",
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


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment in ``cls``'s source, one line (its first sentence when long); {} when the
    source cannot be read (a zipped install): the help then shows the default only."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in source.splitlines():
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", text)
        if m and pending:
            docs[m.group(1)] = _one_line(" ".join(pending))
        if not text.startswith("#"):
            pending = []
    return docs


def _one_line(text: str, limit: int = 110) -> str:
    text = text.replace("``", "")
    if len(text) <= limit:
        return text
    for sep in (". ", "; ", " (", ": "):
        cut = text.find(sep)
        if 0 < cut <= limit:
            return text[:cut]
    return text[: limit - 3].rsplit(" ", 1)[0] + "..."


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    prefix: str = "",
    title: str | None = None,
    skip: tuple[str, ...] = (),
    only_given: bool = False,
    hidden: bool = False,
    description: str | None = None,
    extra_help: dict[str, str] | None = None,
) -> None:
    """``only_given``: a flag not given leaves no attribute (the config's default, or another source, applies).
    ``hidden``: accepted but not listed in ``--help`` (test hooks).  ``extra_help``: help for fields the
    config's source does not document."""
    group = parser.add_argument_group(title or cls.__name__, description)
    docs = {**field_help(cls), **(extra_help or {})}
    for f, tp, optional in _fields(cls):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        dest = prefix.replace("-", "_") + f.name
        doc = docs.get(f.name, "")
        deprecated = doc.lower().startswith("deprecated")
        shown = f"{doc} (default: {default})" if doc else f"(default: {default})"
        help_text = argparse.SUPPRESS if hidden or deprecated else shown
        if tp is bool:
            group.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS if only_given else default,
                help=help_text,
            )
            continue
        conv: Callable[[str], Any] = number(tp) if tp in (int, float) else tp
        if optional:

            def conv_optional(text: str, _conv: Callable[[str], Any] = conv) -> Any:
                return None if text.lower() in ("none", "") else _conv(text)

            conv_optional.__name__ = getattr(conv, "__name__", "value")
            conv = conv_optional

        group.add_argument(
            flag,
            dest=dest,
            type=conv,
            default=argparse.SUPPRESS if only_given else default,
            metavar=tp.__name__.upper(),
            help=help_text,
        )


def number(tp: type) -> Callable[[str], Any]:
    """An argparse ``type`` for an int or float flag: finite numbers only (``nan`` and ``inf`` parse as
    floats and pass every ``<``/``>`` check a config makes); each config's ``__post_init__`` checks the range."""

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


#: the levels ``--log-level`` takes (any case)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """An argparse ``type`` for ``--log-level``: one of :data:`LOG_LEVELS`, any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return text.upper()


def writable_file(text: str) -> str:
    """An argparse ``type`` for a file the command writes later (``--address-file``, ``--json``): its
    directory exists and is writable now, so a typo fails before minutes of start-up, not after."""
    path = os.path.expanduser(text)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no directory {folder!r}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {folder!r} is not writable")
    return path


def existing_dir(text: str) -> str:
    """An argparse ``type`` for a local model directory."""
    path = os.path.expanduser(text)
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return path


def server_address(text: str) -> str:
    """An argparse ``type`` for an engine server's ZMQ address, ``tcp://host:port``."""
    m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d+)", text)
    if m is None:
        hint = f" (did you mean 'tcp://{text}'?)" if re.fullmatch(r"[^\s:/]+:\d+", text) else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not a server address tcp://host:port{hint}")
    port_number(m.group(2))
    return text


class OneLineErrors(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the full usage of ``serve`` is a page long), that
    names the sub-command's own help, and suggests the close option for a mistyped one (``--potr``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # no abbreviations: with a hundred options sharing prefixes they mislead (a typo of a hidden test
        # hook would run it), and a mistyped option gets a suggestion instead
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            close = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(  # type: ignore[override]
        self, args: typing.Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:  # the sub-command's parser knows its options: it says what is wrong, and what was meant
            parser: OneLineErrors = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    chosen = action.choices.get(getattr(ns, action.dest, None) or "")
                    if isinstance(chosen, OneLineErrors):
                        parser = chosen
            parser.error(parser._unrecognized(extras))
        return ns

    def _unrecognized(self, extras: list[str]) -> str:
        options = [  # the listed options only: a hidden test hook is no suggestion
            o for o, a in self._option_string_actions.items() if o.startswith("--") and a.help != argparse.SUPPRESS
        ]
        hints = []
        for arg in extras:
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
                if close:
                    hints.append(f"did you mean {close[0]}?")
        return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def config_from_args(cls: type[C], args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> C:
    values = {}
    for f, _, _ in _fields(cls):
        dest = prefix.replace("-", "_") + f.name
        if hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    values.update(overrides)

    try:
        return cls(**values)
    except ConfigError as exc:  # name the flag the user typed, not the config's field
        if exc.field in values and exc.field not in overrides:
            raise ConfigError("--" + prefix + exc.field.replace("_", "-"), exc.value, exc.reason) from None
        raise


def add_sglang_args(parser: argparse.ArgumentParser) -> None:
    """SGLang engine options: ``--sglang-<field>`` flags (each scalar field of ``SglangEngineConfig``; the
    model is ``--model``) and ``--sglang '<JSON>'`` for any field, flags winning.  Shared by
    ``rollout-sdk serve`` and ``python -m rollout_sdk.launch`` so both take the same options."""
    from ..engines.sglang import SglangEngineConfig  # lazy: cli-start

    sglang_own = {  # fields that are SGLang's own server arguments, passed through as they are
        f.name: f"SGLang's {f.name} server argument"
        for f in dataclasses.fields(SglangEngineConfig)
        if f.name not in field_help(SglangEngineConfig)
    }
    add_config_args(
        parser,
        SglangEngineConfig,
        prefix="sglang-",
        title="sglang engine (--engine sglang)",
        skip=("model_path",),
        only_given=True,
        extra_help=sglang_own,
    )
    parser.add_argument(
        "--sglang", default="{}", metavar="JSON", help="more SglangEngineConfig fields as a JSON object"
    )


def sglang_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The SglangEngineConfig fields the command line gives (JSON first, then the flags)."""
    from ..engines.sglang import SglangEngineConfig  # lazy: cli-start

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
