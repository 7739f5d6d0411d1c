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
"""

from __future__ import annotations

import json
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

    @property
    def has_tool_activity(self) -> bool:
        """Whether the model tried to call a tool at all (successfully or not)."""
        return bool(self.calls or self.errors)


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

    Any number of blocks may appear anywhere in the text.  A block holding several JSON objects one
    after the other yields one call per object.  ``arguments`` may be an object or, OpenAI style, a
    string holding a JSON object; a missing ``arguments`` means no arguments.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into prose, calls (ids ``call_0``, ...) and errors, in text order."""
        outside: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ParseError] = []
        pos = 0
        while pos < len(text):
            start = text.find(self.open_tag, pos)
            stray = text.find(self.close_tag, pos)
            if stray != -1 and (start == -1 or stray < start):
                outside.append(text[pos:stray])
                errors.append(self._stray_close(stray))
                pos = stray + len(self.close_tag)
                continue
            if start == -1:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            pos = self._parse_block(text, start, calls, errors)
        return ParsedTurn(content="".join(outside).strip(), calls=calls, errors=errors)

    def _parse_block(self, text: str, start: int, calls: list[ToolCall], errors: list[ParseError]) -> int:
        """Parse the block opening at ``start``; return where scanning resumes."""
        body_start = start + len(self.open_tag)
        end = text.find(self.close_tag, body_start)
        reopen = text.find(self.open_tag, body_start)
        if end == -1 or (reopen != -1 and reopen < end):
            stop = len(text) if end == -1 else reopen
            errors.append(self._unclosed(start, text[start:stop], truncated=end == -1))
            return stop
        stop = end + len(self.close_tag)
        raw = text[start:stop]
        items = _decode_values(text[body_start:end])
        several = sum(not isinstance(item, ParseError) for item in items) > 1
        for item in items:
            if isinstance(item, ParseError):
                errors.append(ParseError(item.kind, item.message, raw))
                continue
            result = _call_from_value(item.value, item.raw if several else raw, f"call_{len(calls)}")
            if isinstance(result, ParseError):
                errors.append(result)
            else:
                calls.append(result)
        return stop

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
    decoder = json.JSONDecoder()
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
        items.append(_Decoded(value, text[idx:end]))
        idx = _skip_whitespace(text, end)
    return items


def _bad_json(exc: json.JSONDecodeError) -> ParseError:
    where = f"line {exc.lineno} column {exc.colno} (char {exc.pos})"
    return ParseError("bad_json", f"invalid JSON in tool call: {exc.msg}: {where}")


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
    arguments = _arguments(value.get("arguments", {}), name)
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
        decoded = json.loads(value)
    except json.JSONDecodeError as exc:
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
