"""What every tool-call format shares: the result types, the parser protocol, and a call's JSON shape.

A format module (``hermes.py``, ``mistral.py``, ...) subclasses :class:`_Parser` (or
:class:`~.tagged._TaggedBlocks`) and implements ``_parse``; the registry in ``__init__`` maps names to them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from .scan import _loads, _Text

#: Every ``ParseError.kind`` the built-in parsers produce.
PARSE_ERROR_KINDS = (
    "bad_json",
    "not_object",
    "missing_name",
    "bad_arguments_type",
    "unclosed_tag",
    "stray_close_tag",
    "bad_markup",
)


class ToolCall(msgspec.Struct):
    """One tool call the model asked for.

    ``id`` is deterministic (``call_0``, ``call_1``, ... in text order, counting on from the calls of
    earlier turns when the caller says how many there were: ``parse(text, calls_before=n)``; formats whose
    model writes an id keep the model's) so that replaying the same conversation yields the same ids;
    ``raw`` is the text the call was parsed from.  ``id_in_text``: the model wrote the id (Kimi-K2's
    ``functions.f:IDX``, Mistral's ``"id"`` or ``[CALL_ID]``); a template writes it back into the
    conversation, so whoever hands the call out (the gateway) must keep it as written.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""
    raw: str = ""
    id_in_text: bool = False


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
    """What every tool-call parser implements.  ``parse`` must not raise on any model output.

    A parser may also have a ``call_format`` attribute: the shape of one call in its format, shown to
    the model after a parse error (:func:`format_tool_error`).
    """

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into prose, tool calls and parse errors."""
        ...


class _Collector:
    """Prose, calls and errors of one turn, with their text order."""

    def __init__(self, first_id: int = 0) -> None:
        #: calls before this turn in the conversation: ids count on from there, unique per conversation
        self.first_id = first_id
        self.outside: list[str] = []
        self.calls: list[ToolCall] = []
        self.errors: list[ParseError] = []
        self.order: list[tuple[str, int]] = []

    def next_id(self) -> str:
        return f"call_{self.first_id + len(self.calls)}"

    def call(self, call: ToolCall) -> None:
        self.order.append(("call", len(self.calls)))
        self.calls.append(call)

    def error(self, error: ParseError) -> None:
        self.order.append(("error", len(self.errors)))
        self.errors.append(error)

    def add(self, result: ToolCall | ParseError) -> None:
        if isinstance(result, ParseError):
            self.error(result)
        else:
            self.call(result)

    def turn(self) -> ParsedTurn:
        return ParsedTurn(content="".join(self.outside).strip(), calls=self.calls, errors=self.errors, order=self.order)


# -- the shape of a JSON call ---------------------------------------------------------------------


def _shape(key: str) -> str:
    return f'{{"name": <tool name>, "{key}": {{<argument name>: <value>, ...}}}}'


def _call_from_value(
    value: Any, raw: str, call_id: str, *, key: str = "arguments", alias: str = "parameters"
) -> ToolCall | ParseError:
    """Check the shape of one decoded call: an object with a ``name`` and ``key`` (or ``alias``)."""
    if not isinstance(value, dict):
        return ParseError(
            "not_object",
            f"a tool call must be a JSON object {_shape(key)}, got {_json_type(value)} {_show(value)}",
            raw,
        )
    name = value.get("name")
    if "name" not in value:
        return ParseError("missing_name", f'tool call has no "name" field: {_show(value)}', raw)
    if not isinstance(name, str) or not name.strip():
        return ParseError("missing_name", f'tool call "name" must be a non-empty string, got {_show(name)}', raw)
    if key in value and alias in value:
        return ParseError(
            "bad_arguments_type",
            f'tool call {name!r} has both "{key}" and "{alias}": give "{key}" only, not both',
            raw,
        )
    arguments = _arguments(value.get(key, value.get(alias, {})), name, key)
    if isinstance(arguments, str):
        return ParseError("bad_arguments_type", arguments, raw)
    return ToolCall(name=name, arguments=arguments, id=call_id, raw=raw)


def _arguments(value: Any, name: str, key: str = "arguments") -> dict[str, Any] | str:
    """The arguments as a dict, or the error message when they are not an object."""
    if isinstance(value, dict):
        return value
    prefix = f'"{key}" of tool call {name!r} must be a JSON object'
    if not isinstance(value, str):
        return f"{prefix}, got {_json_type(value)} {_show(value)}"
    try:
        decoded = _loads(value)
    except ValueError as exc:  # JSONDecodeError, a non-finite number, too deep
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


class _Item(msgspec.Struct, frozen=True):
    """One call's JSON value: ``end`` is past the value, or (with a ``problem``) past the call's text."""

    value: Any
    end: int
    problem: str = ""


def _json_item(t: _Text, at: int, follows: tuple[str, ...], boundary: str) -> _Item:
    """The JSON value of one call at ``at``, after which only whitespace and then one of ``follows`` (or
    the end of the text) may come.  Anything else after the value is an "Extra data" problem: the whole
    call is an error, since the value the model meant may have been cut short.  With a problem, the call's
    text ends at the next ``boundary`` tag (or the end)."""
    value, end, problem = t.decode(at)
    if not problem:
        after = t.skip_ws(end)
        if after >= t.n or any(t.at(tag, after) for tag in follows):
            return _Item(value, end)
        problem, end = t.message("Extra data", after, at), after
    nxt = t.find(boundary, max(end, at))
    return _Item(None, t.n if nxt == -1 else nxt, problem)


class _Parser:
    """What the built-in parsers share: ``parse`` scans the text once, forward (:class:`_Text`)."""

    def __init__(self, *, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        """``tools``: the tool schemas offered to the model (used by formats whose values are untyped)."""

    #: where a call can start (the format's opening markers); see :meth:`call_start`
    openers: tuple[str, ...] = ()

    def required_id(self, n: int) -> str | None:
        """The id this format's chat templates require for the conversation's ``n``-th call (from 0) when
        the model wrote none, or None when any string will do (most formats: templates drop the ids).
        The gateway hands out these ids, counting the session's calls, instead of its own."""
        return None

    def parse(self, text: str, *, calls_before: int = 0) -> ParsedTurn:
        """Split ``text`` into prose, calls (in text order, deterministic ids) and errors.

        ``calls_before``: how many calls earlier turns of the conversation made; generated ids count on
        from there (``call_{calls_before}``, ...), so they are unique in the conversation and the same
        when the conversation is replayed.
        """
        return self._parse(_Text(text), calls_before)

    def call_start(self, text: str) -> int:
        """Where the first tool call of ``text`` could start (-1: nowhere): a reasoning block is only
        recognised before it, never inside a call's arguments.  Linear in ``text``."""
        hits = [i for i in (text.find(tag) for tag in self.openers) if i != -1]
        return min(hits, default=-1)

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        raise NotImplementedError
