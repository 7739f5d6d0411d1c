"""gpt-oss's harmony format: messages on channels; calls are messages addressed ``to=functions.NAME``.

What the model writes after the prompt's ``<|start|>assistant``::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
    <|call|>

(no break before ``<|call|>``: the breaks here are for reading).

or, answering: ``...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>``.  A message is a
header (``<|start|>ROLE``, ``<|channel|>CHANNEL``, ``to=RECIPIENT``, ``<|constrain|>json`` or `` json``, in
either order) then ``<|message|>`` and a body ending at ``<|end|>``, ``<|call|>``, ``<|return|>``, the next
``<|start|>`` or the end of the text (the engine stops on ``<|call|>`` and ``<|return|>`` and may cut them).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from .base import ParsedTurn, ParseError, ToolCall, _arguments, _Collector, _json_item, _Parser, _show
from .scan import _Text

_START = "<|start|>"
_CHANNEL = "<|channel|>"
_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", _START)


class _Message(msgspec.Struct, frozen=True):
    #: where the message's text starts (its header), where its body starts and ends, where the next starts
    start: int
    body: int
    end: int
    stop: int
    channel: str
    recipient: str
    #: text before the header that belongs to no message (prose the model wrote outside the format)
    prose_from: int


def _messages(t: _Text) -> Iterator[_Message]:
    """The harmony messages of ``t`` in order (one forward pass).  Text with no ``<|message|>`` after it is
    prose, reported as a message with neither channel nor recipient (``body == start``)."""
    pos = 0
    while pos < t.n:
        m = t.find(_MESSAGE, pos)
        if m == -1:
            yield _Message(pos, pos, t.n, t.n, "", "", pos)
            return
        header_at, _ = t.first([_START, _CHANNEL], pos)
        start = header_at if header_at != -1 and header_at < m else m
        header = t.s[start:m]
        t.work += len(header)
        channel, recipient = _header(header)
        body = m + len(_MESSAGE)
        end, tag = t.first(list(_ENDS), body)
        if recipient:  # a call's body is JSON: a tag inside its strings is content
            item = _json_item(t, t.skip_ws(body), _ENDS, _START)
            if not item.problem:
                end, tag = t.first(list(_ENDS), item.end)
        if end == -1:
            end, stop = t.n, t.n
        else:
            stop = end if tag == _START else end + len(tag)
        yield _Message(start, body, end, stop, channel, recipient, pos)
        pos = max(stop, body)


def _header(header: str) -> tuple[str, str]:
    """``(channel, recipient)`` of a message header."""
    channel = ""
    if _CHANNEL in header:
        words = header.split(_CHANNEL, 1)[1].split("<|", 1)[0].split()
        channel = words[0] if words else ""
    recipient = ""
    at = header.find("to=")
    if at != -1:
        rest = header[at + 3 :].split("<|", 1)[0].split()
        recipient = rest[0] if rest else ""
    return channel, recipient


class HarmonyParser(_Parser):
    """gpt-oss (harmony): a message with a recipient (``to=functions.NAME``) is a call, its body the JSON
    arguments (module docstring).  ``to=functions.NAME`` calls ``NAME``; any other recipient (a built-in
    tool: ``python``, ``browser.search``) is the call's name as written.  Messages on the ``final`` and
    ``commentary`` channels without a recipient (the answer, preambles) are the content; ``analysis``
    messages are reasoning, neither content nor calls (the ``harmony`` reasoning parser returns them).
    Text outside any message is content.  A call whose body is not one JSON object, or has text after it
    before its end, is an error; an empty body is no arguments.
    """

    openers = ("to=",)
    call_format = (
        "<|start|>assistant<|channel|>commentary to=functions.TOOL_NAME <|constrain|>json<|message|>{...}<|call|>"
    )

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        out = _Collector(first_id)
        for msg in _messages(t):
            if msg.start > msg.prose_from:
                out.outside.append(t.s[msg.prose_from : msg.start])
            if msg.body == msg.start and not msg.channel and not msg.recipient:
                out.outside.append(t.s[msg.start : msg.end])
            elif msg.recipient:
                out.add(self._call(t, msg, out))
            elif msg.channel != "analysis":
                out.outside.append(t.s[msg.body : msg.end] + "\n")
        return out.turn()

    def _call(self, t: _Text, msg: _Message, out: _Collector) -> ToolCall | ParseError:
        raw = t.s[msg.start : msg.stop]
        name = msg.recipient.removeprefix("functions.")
        if not name or any(c in name for c in "<>{}\"'"):
            why = f"a message to {_show(msg.recipient)} names no tool: write {self.call_format}"
            return ParseError("missing_name", why, raw)
        at = t.skip_ws(msg.body)
        if at >= msg.end:
            return ToolCall(name=name, arguments={}, id=out.next_id(), raw=raw)
        item = _json_item(t, at, _ENDS, _START)
        if item.problem:
            return ParseError("bad_json", item.problem, raw)
        arguments = _arguments(item.value, name)
        if isinstance(arguments, str):
            return ParseError("bad_arguments_type", arguments, raw)
        return ToolCall(name=name, arguments=arguments, id=out.next_id(), raw=raw)


class HarmonyReasoningParser:
    """The ``analysis`` channel of harmony text is the reasoning; the rest of the text is the content,
    unchanged, for :class:`HarmonyParser` to parse (name ``harmony``).  ``(None, text)`` when the text
    has no analysis message."""

    def split(self, text: str) -> tuple[str | None, str]:
        t = _Text(text)
        reasoning: list[str] = []
        kept: list[str] = []
        cursor = 0
        for msg in _messages(t):
            if msg.channel == "analysis" and not msg.recipient:
                kept.append(text[cursor : msg.start])
                reasoning.append(text[msg.body : msg.end].strip())
                cursor = msg.stop
        if not reasoning:
            return None, text
        kept.append(text[cursor:])
        return "\n".join(reasoning), "".join(kept).strip()
