"""The Llama 3.1 / 3.2 / 3.3 JSON format: ``<|python_tag|>{"name": ..., "parameters": {...}}``."""

from __future__ import annotations

from .base import ParsedTurn, ParseError, _call_from_value, _Collector, _json_item, _Parser, _shape
from .scan import _Text


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
    openers = (tag,)
    separator = ";"
    call_format = f"<|python_tag|>{_shape('parameters')}"

    def call_start(self, text: str) -> int:
        lead = len(text) - len(text.lstrip())
        return lead if text.startswith("{", lead) else super().call_start(text)

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        out = _Collector(first_id)
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
