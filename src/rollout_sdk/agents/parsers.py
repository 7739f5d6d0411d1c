"""Tool calls out of the policy's decoded text, without ever crashing on what the policy writes.

During RL the policy is still learning the tool-call format, so malformed calls are routine, not
exceptional: bad JSON, a call without a name, a tag that is never closed because generation hit the
length limit.  A parser here therefore never raises on model output.  Every malformed call becomes a
:class:`ParseError` whose message is written for the model (it is fed back as the tool turn, see
:func:`format_tool_error`), and a malformed call never costs the valid calls of the same turn.

The format is pluggable: :class:`ToolCallParser` is the protocol every parser implements, and
:func:`get_parser` picks one by name.  :class:`HermesParser` handles the Hermes / Qwen2.5 format::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Decisions (each tested in tests/test_agent_parsers.py):

* A block ends at the ``</tool_call>`` that follows the decoded JSON value, so tags inside JSON strings
  (code, HTML, a model quoting the format) are content.  Only when the JSON does not decode does the
  block end at the first ``</tool_call>`` found by string search (the error then names the JSON problem).
* ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow to infinity are not JSON: ``bad_json``
  (or ``bad_arguments_type`` inside string arguments); no call with a non-finite argument ever runs.
* ``"parameters"`` is accepted as an alias of ``"arguments"`` (common in the wild); both at once is an
  error (``bad_arguments_type``), since we cannot know which one the model meant.
* Calls inside ``<think>...</think>`` (or after an unclosed ``<think>``) are drafts, not calls: they are
  not run and not reported; the thinking stays in ``content``.  ``HermesParser(thinking_open=True)``
  is for templates whose prompt opens the think block: text up to the first ``</think>`` is thinking.
* Several objects in one tag are one call each; text after the object(s) that is not another object is
  a ``bad_json`` error ("Extra data") reported after the calls before it, which still run.
* :meth:`ParsedTurn.in_text_order` lists calls and errors in the order they appear in the text: the
  order an agent loop feeds results and errors back to the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

from rollout_sdk.errors import ConfigError

__all__ = [
    "PARSE_ERROR_KINDS",
    "HermesParser",
    "ParseError",
    "ParsedTurn",
    "ToolCall",
    "ToolCallParser",
    "format_tool_error",
    "get_parser",
    "parser_names",
    "register_parser",
]

#: Every ``ParseError.kind`` the built-in parsers produce.
PARSE_ERROR_KINDS = (
    "bad_json",
    "not_object",
    "missing_name",
    "bad_arguments_type",
    "unclosed_tag",
    "stray_close_tag",
)


class ToolCall(msgspec.Struct):
    """One tool call the model asked for.

    ``id`` is deterministic within a turn (``call_0``, ``call_1``, ... in text order) so that replaying
    the same text yields the same ids; ``raw`` is the text the call was parsed from.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""
    raw: str = ""


class ParseError(msgspec.Struct):
    """A tool call that could not be parsed.  ``message`` is written to be shown to the model."""

    kind: str
    message: str
    raw: str = ""


class ParsedTurn(msgspec.Struct):
    """One assistant turn split into prose, well-formed calls and malformed ones."""

    content: str
    calls: list[ToolCall] = msgspec.field(default_factory=list)
    errors: list[ParseError] = msgspec.field(default_factory=list)
    #: text order of calls and errors: ``("call", i)`` is ``calls[i]``, ``("error", j)`` is ``errors[j]``
    order: list[tuple[str, int]] = msgspec.field(default_factory=list)

    @property
    def has_tool_activity(self) -> bool:
        """Whether the model tried to call a tool at all (successfully or not)."""
        return bool(self.calls or self.errors)

    def in_text_order(self) -> list[ToolCall | ParseError]:
        """Calls and errors in the order they appear in the text (calls then errors when a custom
        parser did not record ``order``)."""
        if len(self.order) != len(self.calls) + len(self.errors):
            return [*self.calls, *self.errors]
        return [self.calls[i] if kind == "call" else self.errors[i] for kind, i in self.order]


@runtime_checkable
class ToolCallParser(Protocol):
    """What every tool-call parser implements.  ``parse`` must not raise on any model output."""

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into prose, tool calls and parse errors."""
        ...


# -- Hermes / Qwen2.5 -----------------------------------------------------------------------------

_CALL_SHAPE = '{"name": <tool name>, "arguments": {<argument name>: <value>, ...}}'


class HermesParser:
    """The Hermes / Qwen2.5 format: a JSON object per ``<tool_call>...</tool_call>`` block.

    Any number of blocks may appear anywhere in the text outside thinking.  A block holding several
    JSON objects one after the other yields one call per object.  ``arguments`` (alias ``parameters``)
    may be an object or, OpenAI style, a string holding a JSON object; a missing ``arguments`` means no
    arguments.  See the module docstring for every decision on malformed text.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    think_open = "<think>"
    think_close = "</think>"

    def __init__(self, *, thinking_open: bool = False) -> None:
        self.thinking_open = thinking_open

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into prose, calls (ids ``call_0``, ...) and errors, in text order."""
        out = _Collector()
        pos = 0
        if self.thinking_open:
            end = text.find(self.think_close)
            if end != -1:
                pos = end + len(self.think_close)
                out.outside.append(text[:pos])
        while pos < len(text):
            start = text.find(self.open_tag, pos)
            stray = text.find(self.close_tag, pos)
            think = text.find(self.think_open, pos)
            first = min((i for i in (start, stray, think) if i != -1), default=-1)
            if first == -1:
                out.outside.append(text[pos:])
                break
            out.outside.append(text[pos:first])
            if first == think:  # a draft: skip to the end of the thinking, calls inside are not run
                end = text.find(self.think_close, think)
                stop = len(text) if end == -1 else end + len(self.think_close)
                out.outside.append(text[think:stop])
                pos = stop
            elif first == stray:
                out.error(self._stray_close(stray))
                pos = stray + len(self.close_tag)
            else:
                pos = self._parse_block(text, start, out)
        return out.turn()

    def _parse_block(self, text: str, start: int, out: _Collector) -> int:
        """Parse the block opening at ``start``; return where scanning resumes."""
        body_start = start + len(self.open_tag)
        json_start = _skip_whitespace(text, body_start)
        values, json_end, failed = _decode_objects(text, json_start)
        if failed or not values:
            return self._parse_block_by_search(text, start, out)
        # the block ends at the first close tag after the decoded values: tags inside strings are content
        end, stop = self._close_after(text, start, json_end, out)
        if end == -1:
            return stop
        raw = text[start:stop]
        several = len(values) > 1
        for value, value_raw in values:
            result = _call_from_value(value, value_raw if several else raw, f"call_{len(out.calls)}")
            if isinstance(result, ParseError):
                out.error(result)
            else:
                out.call(result)
        junk_at = _skip_whitespace(text, json_end)
        if junk_at < end:
            out.error(_extra_data(text[json_start:end], junk_at - json_start, raw))
        return stop

    def _parse_block_by_search(self, text: str, start: int, out: _Collector) -> int:
        """The JSON does not decode: the block ends at the next close tag found by string search."""
        body_start = start + len(self.open_tag)
        end, stop = self._close_after(text, start, body_start, out)
        if end == -1:
            return stop
        raw = text[start:stop]
        items = _decode_values(text[body_start:end])
        several = sum(not isinstance(item, ParseError) for item in items) > 1
        for item in items:
            if isinstance(item, ParseError):
                out.error(ParseError(item.kind, item.message, raw))
                continue
            result = _call_from_value(item.value, item.raw if several else raw, f"call_{len(out.calls)}")
            if isinstance(result, ParseError):
                out.error(result)
            else:
                out.call(result)
        return stop

    def _close_after(self, text: str, start: int, pos: int, out: _Collector) -> tuple[int, int]:
        """The block opened at ``start`` closes at the first close tag from ``pos``: ``(end, stop)``, the
        tag's index and the index past it.  A block with no close tag before the text ends or the next
        open tag is an error (recorded in ``out``): ``(-1, where parsing resumes)``."""
        end = text.find(self.close_tag, pos)
        reopen = text.find(self.open_tag, pos)
        if end == -1 or (reopen != -1 and reopen < end):
            stop = len(text) if end == -1 else reopen
            out.error(self._unclosed(start, text[start:stop], truncated=end == -1))
            return -1, stop
        return end, end + len(self.close_tag)

    def _unclosed(self, start: int, raw: str, *, truncated: bool) -> ParseError:
        where = "the end of the text" if truncated else f"the next {self.open_tag}"
        return ParseError(
            "unclosed_tag",
            f"{self.open_tag} at character {start} has no matching {self.close_tag} before {where}; "
            f"the call was not run. Close every call with {self.close_tag}.",
            raw,
        )

    def _stray_close(self, pos: int) -> ParseError:
        return ParseError(
            "stray_close_tag",
            f"{self.close_tag} at character {pos} has no matching {self.open_tag} before it. "
            f"Open every call with {self.open_tag}.",
            self.close_tag,
        )


class _Collector:
    """Prose, calls and errors of one turn, with their text order."""

    def __init__(self) -> None:
        self.outside: list[str] = []
        self.calls: list[ToolCall] = []
        self.errors: list[ParseError] = []
        self.order: list[tuple[str, int]] = []

    def call(self, call: ToolCall) -> None:
        self.order.append(("call", len(self.calls)))
        self.calls.append(call)

    def error(self, error: ParseError) -> None:
        self.order.append(("error", len(self.errors)))
        self.errors.append(error)

    def turn(self) -> ParsedTurn:
        return ParsedTurn(content="".join(self.outside).strip(), calls=self.calls, errors=self.errors, order=self.order)


class _NotJson(ValueError):
    """A JSON constant or number that is not finite (NaN, Infinity, 1e999)."""


def _reject_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NotJson(f"{literal} is not a finite number, so not valid JSON here")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def _loads(text: str) -> Any:
    """``json.loads`` without NaN / Infinity (they are not JSON)."""
    return _DECODER.decode(text)


def _decode_objects(text: str, idx: int) -> tuple[list[tuple[Any, str]], int, bool]:
    """Decode JSON values from ``text[idx:]``: the first one, then further objects separated by
    whitespace.  Returns ``(values with their raw text, end of the last value, failed)``; ``failed`` when
    the first value does not decode (the caller then delimits the block by string search)."""
    values: list[tuple[Any, str]] = []
    end = idx
    while True:
        at = idx if not values else _skip_whitespace(text, end)
        if values and (at >= len(text) or text[at] != "{"):
            return values, end, False
        try:
            value, stop = _DECODER.raw_decode(text, at)
        except ValueError:
            return values, end, not values
        values.append((value, text[at:stop]))
        end = stop


def _extra_data(json_text: str, pos: int, raw: str) -> ParseError:
    return ParseError("bad_json", _bad_json_message(json.JSONDecodeError("Extra data", json_text, pos)), raw)


class _Decoded(msgspec.Struct, frozen=True):
    value: Any
    raw: str


def _decode_values(body: str) -> list[_Decoded | ParseError]:
    """Decode the JSON values of one block, one after the other.

    A ``bad_json`` error ends the block (what follows cannot be delimited).  After the first value,
    only another object may follow; anything else is "Extra data".  Positions in messages count from
    the start of the JSON text (the block's body with surrounding whitespace removed).
    """
    text = body.strip()
    if not text:
        return [ParseError("bad_json", f"empty tool call: expected a JSON object {_CALL_SHAPE}")]
    decoder = _DECODER
    items: list[_Decoded | ParseError] = []
    idx = 0
    while idx < len(text):
        if items and text[idx] != "{":
            items.append(_bad_json(json.JSONDecodeError("Extra data", text, idx)))
            break
        try:
            value, end = decoder.raw_decode(text, idx)
        except json.JSONDecodeError as exc:
            items.append(_bad_json(exc))
            break
        except _NotJson as exc:
            items.append(ParseError("bad_json", f"invalid JSON in tool call: {exc}"))
            break
        items.append(_Decoded(value, text[idx:end]))
        idx = _skip_whitespace(text, end)
    return items


def _bad_json(exc: json.JSONDecodeError) -> ParseError:
    return ParseError("bad_json", _bad_json_message(exc))


def _bad_json_message(exc: json.JSONDecodeError) -> str:
    where = f"line {exc.lineno} column {exc.colno} (char {exc.pos})"
    return f"invalid JSON in tool call: {exc.msg}: {where}"


def _skip_whitespace(text: str, idx: int) -> int:
    while idx < len(text) and text[idx].isspace():
        idx += 1
    return idx


def _call_from_value(value: Any, raw: str, call_id: str) -> ToolCall | ParseError:
    """Check the shape of one decoded call."""
    if not isinstance(value, dict):
        return ParseError(
            "not_object",
            f"a tool call must be a JSON object {_CALL_SHAPE}, got {_json_type(value)} {_show(value)}",
            raw,
        )
    name = value.get("name")
    if "name" not in value:
        return ParseError("missing_name", f'tool call has no "name" field: {_show(value)}', raw)
    if not isinstance(name, str) or not name.strip():
        return ParseError("missing_name", f'tool call "name" must be a non-empty string, got {_show(name)}', raw)
    if "arguments" in value and "parameters" in value:
        return ParseError(
            "bad_arguments_type",
            f'tool call {name!r} has both "arguments" and "parameters": give "arguments" only, not both',
            raw,
        )
    arguments = _arguments(value.get("arguments", value.get("parameters", {})), name)
    if isinstance(arguments, str):
        return ParseError("bad_arguments_type", arguments, raw)
    return ToolCall(name=name, arguments=arguments, id=call_id, raw=raw)


def _arguments(value: Any, name: str) -> dict[str, Any] | str:
    """The arguments as a dict, or the error message when they are not an object."""
    if isinstance(value, dict):
        return value
    prefix = f'"arguments" of tool call {name!r} must be a JSON object'
    if not isinstance(value, str):
        return f"{prefix}, got {_json_type(value)} {_show(value)}"
    try:
        decoded = _loads(value)
    except ValueError as exc:  # JSONDecodeError, or a non-finite number
        return f"{prefix}, got a string that is not valid JSON ({exc}): {_show(value)}"
    if not isinstance(decoded, dict):
        return f"{prefix}, got a string holding {_json_type(decoded)}: {_show(value)}"
    return decoded


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- feedback and lookup --------------------------------------------------------------------------


def format_tool_error(error: ParseError) -> str:
    """The tool-turn message an agent loop feeds back to the model for a malformed call."""
    return (
        f"Error: your tool call could not be parsed ({error.kind}): {error.message}\n"
        f"Write each tool call as:\n<tool_call>\n{_CALL_SHAPE}\n</tool_call>"
    )


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
}


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Make ``get_parser(name)`` return ``factory()``.  Re-registering a name replaces it."""
    if not name:
        raise ConfigError("parser", name, "a parser name must be a non-empty string")
    _PARSERS[name.lower()] = factory


def parser_names() -> list[str]:
    """The names :func:`get_parser` accepts, sorted."""
    return sorted(_PARSERS)


def get_parser(name: str) -> ToolCallParser:
    """A new parser for the format ``name`` (``"hermes"``; ``"qwen25"`` is an alias)."""
    factory = _PARSERS.get(name.lower())
    if factory is None:
        raise ConfigError("parser", name, f"unknown tool-call parser; known: {', '.join(parser_names())}")
    return factory()
