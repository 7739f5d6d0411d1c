"""Tool calls and reasoning out of the policy's decoded text, without ever crashing on what the policy writes.

During RL the policy is still learning the tool-call format, so malformed calls are routine, not
exceptional: bad JSON, a call without a name, a tag that is never closed because generation hit the
length limit.  A parser here therefore never raises on model output.  Every malformed call becomes a
:class:`ParseError` whose message is written for the model (it is fed back as the tool turn, see
:func:`format_tool_error`), and a malformed call never costs the valid calls of the same turn.

The format is pluggable: :class:`ToolCallParser` is the protocol every parser implements, and
:func:`get_parser` picks one by name (:func:`parser_names`).  The built-in formats:

=================  ====================================================================================
``hermes``         Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
``qwen3_coder``    Qwen3-Coder XML: ``<tool_call><function=f><parameter=p>value</parameter></function>``
                   ``</tool_call>``
``llama3_json``    Llama 3.1 / 3.2 / 3.3 JSON: ``<|python_tag|>{"name": ..., "parameters": {...}}`` or the
                   bare object at the start of the turn; several calls separated by ``;``
``mistral``        Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`` and the
                   compact ``[TOOL_CALLS]f[CALL_ID]id[ARGS]{...}`` (``[CALL_ID]`` optional)
=================  ====================================================================================

Rules every format follows (each tested in tests/test_agent_parsers.py and tests/test_tool_formats.py):

* A call block with anything after its JSON value (``{...}}}``: one closing brace too many; trailing
  words) is an error, and **nothing in that block runs**: the extra text may mean the value the model
  meant was cut short (a ``write_file`` whose ``content`` ended early).  The error is ``bad_json``
  ("Extra data") in the JSON formats, ``bad_markup`` in the XML one.
* Tags inside JSON strings are content: a block ends at the close tag that follows the decoded value.
* ``NaN``, ``Infinity`` and numbers that overflow to infinity are not JSON; JSON nested deeper than the
  decoder allows is ``bad_json`` too: no call with such an argument ever runs, and nothing raises.
* :meth:`ParsedTurn.in_text_order` lists calls and errors in the order they appear in the text: the
  order an agent loop feeds results and errors back to the model.
* Parsing is linear in the length of the text, whatever the text (no search restarts from an earlier
  position, no backtracking regex): every search goes through :class:`_Text`, which counts what it scans.

Reasoning (``<think>...</think>``) is split off by a :class:`ReasoningParser` (:func:`get_reasoning_parser`)
*before* tool calls are parsed, so calls drafted while thinking are never run.  The reasoning stays in
the recorded tokens (the model generated it) and is trained like any other output token.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from rollout_sdk.errors import ConfigError

__all__ = [
    "PARSE_ERROR_KINDS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "NoReasoningParser",
    "ParseError",
    "ParsedTurn",
    "Qwen3CoderParser",
    "ReasoningParser",
    "ThinkReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "format_tool_error",
    "get_parser",
    "get_reasoning_parser",
    "parser_names",
    "reasoning_parser_names",
    "register_parser",
    "register_reasoning_parser",
]

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

    ``id`` is deterministic within a turn (``call_0``, ``call_1``, ... in text order; Mistral keeps the
    model's own id) so that replaying the same text yields the same ids; ``raw`` is the text the call was
    parsed from.
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
    """What every tool-call parser implements.  ``parse`` must not raise on any model output.

    A parser may also have a ``call_format`` attribute: the shape of one call in its format, shown to
    the model after a parse error (:func:`format_tool_error`).
    """

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into prose, tool calls and parse errors."""
        ...


# -- scanning -------------------------------------------------------------------------------------

_WS = re.compile(r"\s*")
#: a function or parameter name in the XML format: up to the next ``>``, never across ``<`` or a line
_XML_NAME = re.compile(r"[^<>\n]*")


class _Text:
    """The text being parsed, searched forward only.

    ``find(tag, pos)`` remembers where ``tag`` next occurs, so asking again from any position up to that
    occurrence costs nothing; a parser whose positions only move forward therefore scans each character
    a bounded number of times per tag.  ``work`` counts the characters every search, skip and JSON
    decode covered: the test of linear time reads it (operation counts, not wall-clock).
    """

    __slots__ = ("_found", "n", "s", "work")

    def __init__(self, s: str) -> None:
        self.s = s
        self.n = len(s)
        self._found: dict[str, tuple[int, int]] = {}  # tag -> (searched from, found at or -1)
        self.work = 0

    def find(self, tag: str, pos: int) -> int:
        cached = self._found.get(tag)
        if cached is not None and cached[0] <= pos and (cached[1] == -1 or pos <= cached[1]):
            return cached[1]
        hit = self.s.find(tag, pos)
        self.work += (self.n if hit == -1 else hit + len(tag)) - pos
        self._found[tag] = (pos, hit)
        return hit

    def first(self, tags: Sequence[str], pos: int) -> tuple[int, str]:
        """The earliest of ``tags`` from ``pos``: ``(index, tag)``, or ``(-1, "")``."""
        best, which = -1, ""
        for tag in tags:
            i = self.find(tag, pos)
            if i != -1 and (best == -1 or i < best):
                best, which = i, tag
        return best, which

    def skip_ws(self, pos: int) -> int:
        end = _match_end(_WS, self.s, pos)
        self.work += end - pos + 1
        return end

    def name_at(self, pos: int) -> int:
        """Where an XML name starting at ``pos`` ends (at ``>``, ``<``, a newline or the end)."""
        end = _match_end(_XML_NAME, self.s, pos)
        self.work += end - pos + 1
        return end

    def at(self, tag: str, pos: int) -> bool:
        return self.s.startswith(tag, pos)

    def decode(self, pos: int, origin: int | None = None) -> tuple[Any, int, str]:
        """One JSON value at ``pos``: ``(value, end, "")``, or ``(None, where it failed, message)``.

        Only finite numbers are JSON here; JSON nested too deeply is an error, never a RecursionError.
        Positions in messages count from ``origin`` (default ``pos``).  The decoder reads a window that
        doubles until the value (or its error) lies inside it: an error is never built against the whole
        text (``JSONDecodeError`` counts lines from the start of its document: quadratic over many errors).
        """
        origin = pos if origin is None else origin
        size = 64
        while True:
            stop = min(self.n, pos + size)
            doc = self.s[pos:stop]
            self.work += len(doc)
            more = stop < self.n
            try:
                value, end = _DECODER.raw_decode(doc, 0)
            except json.JSONDecodeError as exc:
                if more and (exc.pos >= len(doc) - 16 or exc.msg.startswith(("Unterminated", "Invalid \\u"))):
                    size *= 2  # the error may be the window's end, not the value's
                    continue
                return None, pos + exc.pos, self.message(exc.msg, pos + exc.pos, origin)
            except RecursionError:
                return None, pos, "invalid JSON in tool call: the value is nested too deeply"
            if more and end >= len(doc) - 16:  # a number (or the value) may go on past the window
                size *= 2
                continue
            problem = _non_finite(value)
            if problem:
                return None, pos, f"invalid JSON in tool call: {problem}"
            return value, pos + end, ""

    def message(self, msg: str, at: int, origin: int) -> str:
        """A JSON error message with its line, column and character counted from ``origin``."""
        seg = self.s[origin:at]
        self.work += len(seg)
        line, column = seg.count("\n") + 1, len(seg) - seg.rfind("\n")
        return f"invalid JSON in tool call: {msg}: line {line} column {column} (char {len(seg)})"


def _match_end(pattern: re.Pattern[str], s: str, pos: int) -> int:
    m = pattern.match(s, pos)
    return pos if m is None else m.end()


_DECODER = json.JSONDecoder()


def _non_finite(value: Any) -> str:
    """Why ``value`` (decoded JSON) is not JSON after all: a NaN or an infinity in it; else ``""``."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            literal = "NaN" if math.isnan(v) else "Infinity (or a number too large to be finite)"
            return f"{literal} is not valid JSON (numbers must be finite)"
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return ""


def _loads(text: str) -> Any:
    """``json.loads`` without NaN / Infinity (they are not JSON) and without RecursionError."""
    try:
        value = _DECODER.decode(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    problem = _non_finite(value)
    if problem:
        raise ValueError(problem)
    return value


class _Collector:
    """Prose, calls and errors of one turn, with their text order."""

    def __init__(self) -> None:
        self.outside: list[str] = []
        self.calls: list[ToolCall] = []
        self.errors: list[ParseError] = []
        self.order: list[tuple[str, int]] = []

    def next_id(self) -> str:
        return f"call_{len(self.calls)}"

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


# -- tag-delimited blocks (Hermes, Qwen3-Coder) ---------------------------------------------------


class _Parser:
    """What the built-in parsers share: ``parse`` scans the text once, forward (:class:`_Text`)."""

    def __init__(self, *, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        """``tools``: the tool schemas offered to the model (used by formats whose values are untyped)."""

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into prose, calls (in text order, deterministic ids) and errors."""
        return self._parse(_Text(text))

    def _parse(self, t: _Text) -> ParsedTurn:
        raise NotImplementedError


class _TaggedBlocks(_Parser):
    """Blocks between an open and a close tag, anywhere in the text; subclasses parse one block."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    #: tags whose region is prose even when it holds the open tag (Hermes: ``<think>``)
    think_open = ""
    think_close = ""

    def _parse(self, t: _Text) -> ParsedTurn:
        out = _Collector()
        pos = self._start(t, out)
        tags = [self.open_tag, self.close_tag, *([self.think_open] if self.think_open else [])]
        while pos < t.n:
            first, tag = t.first(tags, pos)
            if first == -1:
                out.outside.append(t.s[pos:])
                break
            out.outside.append(t.s[pos:first])
            if tag == self.think_open:  # a draft: skip to the end of the thinking, calls inside are not run
                end = t.find(self.think_close, first)
                stop = t.n if end == -1 else end + len(self.think_close)
                out.outside.append(t.s[first:stop])
                pos = stop
            elif tag == self.close_tag:
                out.error(self._stray_close(first))
                pos = first + len(self.close_tag)
            else:
                pos = self._parse_block(t, first, out)
        return out.turn()

    def _start(self, t: _Text, out: _Collector) -> int:
        return 0

    def _parse_block(self, t: _Text, start: int, out: _Collector) -> int:
        raise NotImplementedError

    def _block_end(self, t: _Text, pos: int) -> tuple[int, int]:
        """Where a block whose text goes on at ``pos`` ends: ``(end, stop)``, the index of the first close
        tag from ``pos`` and the index past it; ``(-1, stop)`` when no close tag comes before the next open
        tag (``stop`` is that tag) or the end of the text (``stop`` is the end)."""
        end = t.find(self.close_tag, pos)
        if end == -1:
            return -1, t.n
        reopen = t.find(self.open_tag, pos)
        if reopen != -1 and reopen < end:
            return -1, reopen
        return end, end + len(self.close_tag)

    def _close_after(self, t: _Text, start: int, pos: int, out: _Collector) -> tuple[int, int]:
        """:meth:`_block_end`, recording an unclosed block (opened at ``start``) as an error."""
        end, stop = self._block_end(t, pos)
        if end == -1:
            out.error(self._unclosed(start, t.s[start:stop], truncated=stop == t.n))
        return end, stop

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


# -- Hermes / Qwen2.5 -----------------------------------------------------------------------------


class HermesParser(_TaggedBlocks):
    """The Hermes / Qwen2.5 format: a JSON object per ``<tool_call>...</tool_call>`` block::

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    Any number of blocks may appear anywhere in the text outside thinking.  A block holding several
    JSON objects one after the other (whitespace between them) yields one call per object; anything
    else after the object(s) makes the whole block an error.  ``arguments`` (alias ``parameters``) may be
    an object or, OpenAI style, a string holding a JSON object; a missing ``arguments`` means no
    arguments, both at once is an error.  Calls inside ``<think>...</think>`` (or after an unclosed
    ``<think>``) are drafts, not calls: not run and not reported; the thinking stays in ``content``.
    ``HermesParser(thinking_open=True)`` is for templates whose prompt opens the think block: text up to
    the first ``</think>`` is thinking.
    """

    think_open = "<think>"
    think_close = "</think>"
    call_format = f"<tool_call>\n{_shape('arguments')}\n</tool_call>"

    def __init__(self, *, thinking_open: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.thinking_open = thinking_open

    def _start(self, t: _Text, out: _Collector) -> int:
        if not self.thinking_open:
            return 0
        end = t.find(self.think_close, 0)
        if end == -1:
            return 0
        pos = end + len(self.think_close)
        out.outside.append(t.s[:pos])
        return pos

    def _parse_block(self, t: _Text, start: int, out: _Collector) -> int:
        """Parse the block opening at ``start``; return where scanning resumes."""
        body_start = start + len(self.open_tag)
        json_start = t.skip_ws(body_start)
        values: list[tuple[Any, str]] = []
        json_end = json_start
        problem = ""
        while True:
            at = json_start if not values else t.skip_ws(json_end)
            if values and not t.at("{", at):
                break
            value, stop, problem = t.decode(at)
            if problem:
                break
            values.append((value, t.s[at:stop]))
            json_end = stop
        if not values:  # the JSON does not decode: the block ends at the next close tag by string search
            end, stop = self._close_after(t, start, body_start, out)
            if end != -1:
                out.error(ParseError("bad_json", self._first_problem(t, body_start, end), t.s[start:stop]))
            return stop
        # the block ends at the first close tag after the decoded values: tags inside strings are content
        end, stop = self._close_after(t, start, json_end, out)
        if end == -1:
            return stop
        raw = t.s[start:stop]
        junk_at = t.skip_ws(json_end)
        if junk_at < end:  # anything after the value(s): the whole block is an error, nothing runs
            out.error(ParseError("bad_json", self._first_problem(t, json_start, end), raw))
            return stop
        several = len(values) > 1
        for value, value_raw in values:
            out.add(_call_from_value(value, value_raw if several else raw, out.next_id()))
        return stop

    def _first_problem(self, t: _Text, pos: int, end: int) -> str:
        """Why the JSON text in ``t.s[pos:end]`` (surrounding whitespace removed) does not decode."""
        body = t.s[pos:end].strip()
        if not body:
            return f"empty tool call: expected a JSON object {_shape('arguments')}"
        inner = _Text(body)
        at = 0
        while True:  # objects one after the other, as the block was read; the first problem is the answer
            _, stop, problem = inner.decode(at, origin=0)
            if problem:
                break
            at = inner.skip_ws(stop)
            if at >= inner.n or not inner.at("{", at):
                problem = inner.message("Extra data", min(at, inner.n), 0)
                break
        t.work += inner.work
        return problem


# -- Qwen3-Coder XML ------------------------------------------------------------------------------


class Qwen3CoderParser(_TaggedBlocks):
    """The Qwen3-Coder XML format, one function per block (several are several calls)::

        <tool_call>
        <function=write_file>
        <parameter=path>
        notes.txt
        </parameter>
        <parameter=content>
        any text, <b>markup</b> included
        </parameter>
        </function>
        </tool_call>

    A value is the raw text between ``<parameter=name>`` and the first ``</parameter>``, less one newline
    at each end (how the chat template writes it).  Values are strings unless ``tools`` (the OpenAI tool
    schemas offered to the model) give the parameter a type: then a value of an integer, number, boolean,
    null, array or object parameter is read as JSON (``True``/``False`` too, which the template writes for
    Python booleans); a value that does not read as that type stays a string, so the registry's argument
    check names the problem.  Malformed markup (a value that holds ``<parameter=`` or ``</function>``, i.e.
    a missing ``</parameter>``; text between parameters; a parameter given twice; text after
    ``</function>``) is an error for the whole block.
    """

    function_open = "<function="
    function_close = "</function>"
    param_open = "<parameter="
    param_close = "</parameter>"
    call_format = (
        "<tool_call>\n<function=TOOL_NAME>\n<parameter=ARGUMENT_NAME>\nvalue\n</parameter>\n</function>\n</tool_call>"
    )

    def __init__(self, *, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = _parameter_schemas(tools)

    def _parse_block(self, t: _Text, start: int, out: _Collector) -> int:
        pos = t.skip_ws(start + len(self.open_tag))
        calls: list[tuple[str, dict[str, Any], str]] = []
        while t.at(self.function_open, pos):
            parsed = self._function(t, pos)
            if isinstance(parsed, _Failure):
                return self._fail(t, start, parsed, out)
            calls.append(parsed[:3])
            pos = t.skip_ws(parsed[3])
        if not calls:
            got = _show(t.s[pos : pos + 20])
            return self._fail(
                t,
                start,
                _Failure(
                    pos, "missing_name", f"expected {self.function_open}TOOL_NAME> after {self.open_tag}, got {got}"
                ),
                out,
            )
        if not t.at(self.close_tag, pos):
            if pos >= t.n or t.at(self.open_tag, pos):
                return self._fail(t, start, _Failure(pos, "unclosed_tag", ""), out)
            got = _show(t.s[pos : pos + 20])
            why = f"text after {self.function_close} where {self.close_tag} was expected: {got}"
            return self._fail(t, start, _Failure(pos, "bad_markup", why), out)
        stop = pos + len(self.close_tag)
        raw = t.s[start:stop]
        for name, arguments, call_raw in calls:
            out.call(
                ToolCall(name=name, arguments=arguments, id=out.next_id(), raw=raw if len(calls) == 1 else call_raw)
            )
        return stop

    def _function(self, t: _Text, pos: int) -> tuple[str, dict[str, Any], str, int] | _Failure:
        """The ``<function=...>...</function>`` at ``pos``: ``(name, arguments, raw, end)``."""
        name_at = pos + len(self.function_open)
        name_end = t.name_at(name_at)
        name = t.s[name_at:name_end].strip()
        if not t.at(">", name_end) or not name:
            return _Failure(pos, "missing_name", f"expected {self.function_open}TOOL_NAME> with a non-empty name")
        schema = self.schemas.get(name, {})
        arguments: dict[str, Any] = {}
        p = name_end + 1
        while True:
            p = t.skip_ws(p)
            if t.at(self.function_close, p):
                end = p + len(self.function_close)
                return name, arguments, t.s[pos:end], end
            if not t.at(self.param_open, p):
                if p >= t.n:
                    return _Failure(
                        p, "unclosed_tag", f"{self.function_open}{name}> has no {self.function_close} before the end"
                    )
                got = _show(t.s[p : p + 20])
                return _Failure(
                    p, "bad_markup", f"in {name!r}, expected {self.param_open}NAME> or {self.function_close}, got {got}"
                )
            pname_at = p + len(self.param_open)
            pname_end = t.name_at(pname_at)
            pname = t.s[pname_at:pname_end].strip()
            if not t.at(">", pname_end) or not pname:
                return _Failure(p, "bad_markup", f"in {name!r}, expected {self.param_open}NAME> with a non-empty name")
            value_at = pname_end + 1
            close = t.find(self.param_close, value_at)
            reopen = t.find(self.open_tag, value_at)
            if close == -1 or (reopen != -1 and reopen < close):
                where = "the end of the text" if close == -1 else f"the next {self.open_tag}"
                what = f"{self.param_open}{pname}> of {name!r} has no {self.param_close} before {where}"
                return _Failure(p, "unclosed_tag", what)
            value = t.s[value_at:close]
            t.work += len(value)
            for marker in (self.param_open, self.function_close):
                if marker in value:
                    return _Failure(
                        p,
                        "bad_markup",
                        f"{self.param_open}{pname}> of {name!r} is not closed with {self.param_close} before {marker}",
                    )
            if pname in arguments:
                return _Failure(p, "bad_arguments_type", f"argument {pname!r} of {name!r} is given twice")
            arguments[pname] = _typed_value(_one_newline_less(value), schema.get(pname))
            p = close + len(self.param_close)

    def _fail(self, t: _Text, start: int, failure: _Failure, out: _Collector) -> int:
        """A malformed block: one error, nothing in it runs.  The block ends at the first close tag from
        where it went wrong, or (none before the next open tag) just before that open tag."""
        _, stop = self._block_end(t, failure.pos)
        raw = t.s[start:stop]
        if failure.message:
            out.error(ParseError(failure.kind, f"{failure.message}; the call was not run.", raw))
        else:
            out.error(self._unclosed(start, raw, truncated=stop == t.n))
        return stop


class _Failure(msgspec.Struct, frozen=True):
    pos: int
    kind: str
    message: str


def _one_newline_less(value: str) -> str:
    """The template writes ``<parameter=p>\\n{value}\\n</parameter>``: take those two newlines off."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


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


# -- JSON after a marker (Llama 3.x, Mistral) -----------------------------------------------------


class Llama3JsonParser(_Parser):
    """The Llama 3.1 / 3.2 / 3.3 JSON format::

        <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

    or the bare object when the turn starts with ``{`` (the JSON tool-calling prompt of Meta's template).
    Text before ``<|python_tag|>`` is content; everything after it is calls: JSON objects separated by
    ``;`` or by another ``<|python_tag|>``.  ``parameters`` (alias ``arguments``) may be an object or a
    string holding one.  Anything after a call's JSON value that is not a separator makes that call an
    error (the calls before it still run); JSON that does not decode makes the rest up to the next
    ``<|python_tag|>`` one error.  The built-in tools' Python syntax (``brave_search.call(query=...)``) is not
    JSON: ``bad_json``.
    """

    tag = "<|python_tag|>"
    separator = ";"
    call_format = f"<|python_tag|>{_shape('parameters')}"

    def _parse(self, t: _Text) -> ParsedTurn:
        out = _Collector()
        lead = t.skip_ws(0)
        start = lead if t.at("{", lead) else t.find(self.tag, 0)
        if start == -1:
            out.outside.append(t.s)
            return out.turn()
        out.outside.append(t.s[:start])
        pos = start
        while pos < t.n:
            item = pos
            if t.at(self.tag, pos):
                pos += len(self.tag)
            elif t.at(self.separator, pos):
                pos += len(self.separator)
            at = t.skip_ws(pos)
            value = _json_item(t, at, (self.separator, self.tag), self.tag)
            if value.problem:
                problem = value.problem
                if at >= value.end:
                    problem = f"empty tool call after {t.s[item:pos]!r}: expected a JSON object {_shape('parameters')}"
                out.error(ParseError("bad_json", problem, t.s[item : value.end]))
                pos = max(value.end, item + 1)
                continue
            raw = t.s[item : value.end]
            out.add(_call_from_value(value.value, raw, out.next_id(), key="parameters", alias="arguments"))
            pos = t.skip_ws(value.end)
        return out.turn()


class MistralParser(_Parser):
    """The Mistral formats, after ``[TOOL_CALLS]`` (text before it is content)::

        [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
        [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}

    The first (Mistral 7B v0.3, Mixtral, Nemo, Small 3.1) is a JSON array of calls (one object is
    accepted as a list of one); an ``"id"`` string becomes the call's id.  The compact forms (newer
    tokenizers: Small 3.2, Magistral, Devstral) take one call per ``[TOOL_CALLS]``.  Without a model id, a
    call's id is ``call`` and five digits (``call00000``): Mistral's templates require ids of nine
    letters or digits.  Anything after a call's JSON value other than the next ``[TOOL_CALLS]`` makes that
    whole ``[TOOL_CALLS]`` section an error.
    """

    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    id_marker = "[CALL_ID]"
    call_format = '[TOOL_CALLS] [{"name": <tool name>, "arguments": {<argument name>: <value>, ...}}]'

    def _parse(self, t: _Text) -> ParsedTurn:
        out = _Collector()
        pos = t.find(self.marker, 0)
        if pos == -1:
            out.outside.append(t.s)
            return out.turn()
        out.outside.append(t.s[:pos])
        while pos < t.n:
            pos = self._section(t, pos, out)
        return out.turn()

    def _next_marker(self, t: _Text, pos: int) -> int:
        i = t.find(self.marker, pos)
        return t.n if i == -1 else i

    def _section(self, t: _Text, start: int, out: _Collector) -> int:
        """The ``[TOOL_CALLS]`` section at ``start``; return where the next one starts."""
        at = t.skip_ws(start + len(self.marker))
        bound = self._next_marker(t, at)
        if at >= bound:
            message = f"empty {self.marker}: expected a JSON list of calls {self.call_format}"
            out.error(ParseError("bad_json", message, t.s[start:bound]))
            return bound
        if t.at("[", at) or t.at("{", at):
            return self._json_list(t, start, at, out)
        return self._compact(t, start, at, bound, out)

    def _json_list(self, t: _Text, start: int, at: int, out: _Collector) -> int:
        value = _json_item(t, at, (self.marker,), self.marker)
        raw = t.s[start : value.end]
        if value.problem:
            out.error(ParseError("bad_json", value.problem, raw))
            return value.end
        items = value.value if isinstance(value.value, list) else [value.value]
        if not items:
            out.error(ParseError("not_object", f"an empty list of tool calls: expected {self.call_format}", raw))
        for item in items:
            out.add(_call_from_value(item, raw, self._id(out, item)))
        return t.skip_ws(value.end)

    def _compact(self, t: _Text, start: int, at: int, bound: int, out: _Collector) -> int:
        args = t.find(self.args_marker, at)
        if args == -1 or args > bound:
            message = (
                f"{self.marker} at character {start} is not followed by a JSON list or NAME{self.args_marker}{{...}}"
            )
            out.error(ParseError("bad_json", message, t.s[start:bound]))
            return bound
        head = t.s[at:args]
        t.work += len(head)
        call_id = ""
        if self.id_marker in head:
            head, call_id = (x.strip() for x in head.split(self.id_marker, 1))
        name = head.strip()
        if not name or any(c.isspace() for c in name) or "[" in name:
            message = f"tool call name must be a non-empty word before {self.args_marker}, got {_show(name)}"
            out.error(ParseError("missing_name", message, t.s[start:bound]))
            return bound
        value = _json_item(t, t.skip_ws(args + len(self.args_marker)), (self.marker,), self.marker)
        raw = t.s[start : value.end]
        arguments = value.problem or _arguments(value.value, name)
        if isinstance(arguments, str):
            out.error(ParseError("bad_json" if value.problem else "bad_arguments_type", arguments, raw))
        else:
            out.call(ToolCall(name=name, arguments=arguments, id=call_id or self._id(out, None), raw=raw))
        return value.end if value.problem else t.skip_ws(value.end)

    def _id(self, out: _Collector, item: Any) -> str:
        given = item.get("id") if isinstance(item, dict) else None
        return given if isinstance(given, str) and given.strip() else f"call{len(out.calls):05d}"


# -- reasoning ------------------------------------------------------------------------------------


@runtime_checkable
class ReasoningParser(Protocol):
    """Splits a turn's text into its reasoning and its content.  ``split`` must not raise on any text.

    Returns ``(reasoning or None, content)``: ``None`` when the text holds no reasoning.  The agent loop
    and the gateway parse tool calls in the content only, so calls drafted while reasoning never run.
    """

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning or None, content)``."""
        ...


class NoReasoningParser:
    """For models that do not reason in their output: everything is content."""

    def split(self, text: str) -> tuple[str | None, str]:
        return None, text


class ThinkReasoningParser:
    """``<think>...</think>`` reasoning (Qwen3, QwQ, DeepSeek-R1 and their distillations).

    * ``before<think>R</think>after``: reasoning ``R``, content ``before`` + ``after``;
    * ``R</think>after`` (the template put ``<think>`` in the prompt): reasoning ``R``;
    * ``<think>R`` never closed (cut by the token limit): all of ``R`` is reasoning, no content after it;
    * no think tags: ``(None, text)``, the text unchanged.

    Reasoning and content are stripped of surrounding whitespace.  The first ``</think>`` ends the
    reasoning.  ``opened_by_prompt=True`` (name ``"think_open"``) is for templates that always open the
    block in the prompt: text without ``</think>`` is then all reasoning (a turn cut while thinking).
    """

    open_tag = "<think>"
    close_tag = "</think>"

    def __init__(self, *, opened_by_prompt: bool = False) -> None:
        self.opened_by_prompt = opened_by_prompt

    def split(self, text: str) -> tuple[str | None, str]:
        start = text.find(self.open_tag)
        close = text.find(self.close_tag)
        if start != -1 and (close == -1 or start < close):
            before = text[:start]
            body = start + len(self.open_tag)
            close = text.find(self.close_tag, body)
            if close == -1:
                return text[body:].strip(), before.strip()
            return text[body:close].strip(), (before + text[close + len(self.close_tag) :]).strip()
        if close != -1:
            return text[:close].strip(), text[close + len(self.close_tag) :].strip()
        if self.opened_by_prompt:
            return text.strip(), ""
        return None, text


# -- feedback and lookup --------------------------------------------------------------------------


def format_tool_error(error: ParseError, call_format: str | None = None) -> str:
    """The tool-turn message an agent loop feeds back to the model for a malformed call.

    ``call_format`` is the shape of a call in the parser's format (``parser.call_format``); the
    default is the Hermes one.
    """
    shape = call_format or HermesParser.call_format
    return (
        f"Error: your tool call could not be parsed ({error.kind}): {error.message}\nWrite each tool call as:\n{shape}"
    )


ParserFactory = Callable[..., ToolCallParser]

_PARSERS: dict[str, ParserFactory] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def register_parser(name: str, factory: ParserFactory) -> None:
    """Make ``get_parser(name)`` return ``factory()``.  Re-registering a name replaces it.

    A factory that takes a ``tools`` keyword gets the tool schemas :func:`get_parser` was given.
    """
    if not name:
        raise ConfigError("parser", name, "a parser name must be a non-empty string")
    _PARSERS[name.lower()] = factory


def parser_names() -> list[str]:
    """The names :func:`get_parser` accepts, sorted."""
    return sorted(_PARSERS)


def get_parser(name: str, *, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParser:
    """A new parser for the format ``name`` (:func:`parser_names`; ``"qwen25"`` is ``"hermes"``).

    ``tools``: the OpenAI tool schemas offered to the model; formats whose values are untyped text
    (``qwen3_coder``) read each value as its parameter's type.
    """
    factory = _PARSERS.get(name.lower()) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError("parser", name, f"unknown tool-call parser; known: {', '.join(parser_names())}")
    if tools is not None and _takes_tools(factory):
        return factory(tools=tools)
    return factory()


def _takes_tools(factory: ParserFactory) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "tools" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


_REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "none": NoReasoningParser,
    "think": ThinkReasoningParser,
    "think_open": lambda: ThinkReasoningParser(opened_by_prompt=True),
}


def register_reasoning_parser(name: str, factory: Callable[[], ReasoningParser]) -> None:
    """Make ``get_reasoning_parser(name)`` return ``factory()``.  Re-registering a name replaces it."""
    if not name:
        raise ConfigError("reasoning_parser", name, "a reasoning parser name must be a non-empty string")
    _REASONING_PARSERS[name.lower()] = factory


def reasoning_parser_names() -> list[str]:
    """The names :func:`get_reasoning_parser` accepts, sorted."""
    return sorted(_REASONING_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new reasoning parser: ``"none"`` (no reasoning), ``"think"`` (``<think>...</think>``),
    ``"think_open"`` (the prompt opens the think block)."""
    factory = _REASONING_PARSERS.get(name.lower()) if isinstance(name, str) else None
    if factory is None:
        known = ", ".join(reasoning_parser_names())
        raise ConfigError("reasoning_parser", name, f"unknown reasoning parser; known: {known}")
    return factory()


def _scan_work(parser: Any, text: str) -> int:
    """How many characters a built-in parser's searches, skips and decodes covered on ``text``."""
    t = _Text(text)
    parser._parse(t)
    return t.work
