"""The GLM-4.5 / 4.6 / 4.7 format: ``<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import ParseError, ToolCall, _Collector, _show
from .scan import _loads, _Text
from .schema import _parameter_schemas, _schema_types, _typed_value
from .tagged import _TaggedBlocks


class Glm45Parser(_TaggedBlocks):
    """GLM-4.5 (and 4.6; GLM-4.7 writes the same without the newlines)::

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Paris</arg_value>
        </tool_call>

    A value is the raw text between ``<arg_value>`` and the first ``</arg_value>``: GLM's chat template
    writes a string value as it is and any other value as JSON (``tojson``).  So a value is a string when
    ``tools`` give its parameter the type string; read as that type when they give another
    (``qwen3_coder``'s rule); and, with no schema for it, JSON when it reads as a JSON number, boolean,
    null, array or object, else its text.  Malformed markup (text between arguments, a key without a
    value, a value holding ``<arg_key>`` (a missing ``</arg_value>``), a key given twice) is an error for
    the whole block.  Reasoning is ``<think>...</think>`` (reasoning parser ``think``).
    """

    think_open = "<think>"
    think_close = "</think>"
    key_open = "<arg_key>"
    key_close = "</arg_key>"
    value_open = "<arg_value>"
    value_close = "</arg_value>"
    call_format = "<tool_call>TOOL_NAME\n<arg_key>ARGUMENT_NAME</arg_key>\n<arg_value>value</arg_value>\n</tool_call>"

    def __init__(self, *, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = _parameter_schemas(tools)

    def _parse_block(self, t: _Text, start: int, out: _Collector) -> int:
        body = start + len(self.open_tag)
        name_end, _ = t.first(["\n", self.key_open, self.close_tag, self.open_tag], body)
        name_end = t.n if name_end == -1 else name_end
        name = t.s[body:name_end].strip()
        t.work += name_end - body
        if not name or any(c.isspace() for c in name) or "<" in name or "{" in name:
            why = f"expected the tool name right after {self.open_tag}, got {_show(name[:40])}"
            return self._fail(t, start, name_end, "missing_name", why, out)
        schema = self.schemas.get(name)
        arguments: dict[str, Any] = {}
        pos = name_end
        while True:
            pos = t.skip_ws(pos)
            if t.at(self.close_tag, pos):
                stop = pos + len(self.close_tag)
                out.call(ToolCall(name=name, arguments=arguments, id=out.next_id(), raw=t.s[start:stop]))
                return stop
            if pos >= t.n or t.at(self.open_tag, pos):
                return self._fail(t, start, pos, "unclosed_tag", "", out)
            if not t.at(self.key_open, pos):
                got = _show(t.s[pos : pos + 20])
                why = f"in {name!r}, expected {self.key_open} or {self.close_tag}, got {got}"
                return self._fail(t, start, pos, "bad_markup", why, out)
            key_at = pos + len(self.key_open)
            key_end = t.find(self.key_close, key_at)
            nxt, _ = t.first([self.value_open, self.close_tag, self.open_tag], key_at)
            if key_end == -1 or (nxt != -1 and nxt < key_end):
                why = f"in {name!r}, {self.key_open} is not closed with {self.key_close}"
                return self._fail(t, start, key_at, "bad_markup", why, out)
            key = t.s[key_at:key_end].strip()
            t.work += key_end - key_at
            value_at = t.skip_ws(key_end + len(self.key_close))
            if not key or not t.at(self.value_open, value_at):
                why = f"in {name!r}, each {self.key_open}NAME{self.key_close} needs a name and an {self.value_open}"
                return self._fail(t, start, value_at, "bad_markup", why, out)
            value_at += len(self.value_open)
            close = t.find(self.value_close, value_at)
            reopen = t.find(self.open_tag, value_at)
            if close == -1 or (reopen != -1 and reopen < close):
                why = f"{self.value_open} of {key!r} in {name!r} has no {self.value_close}"
                return self._fail(t, start, value_at, "unclosed_tag", why, out)
            value = t.s[value_at:close]
            t.work += len(value)
            if self.key_open in value:
                why = f"{self.value_open} of {key!r} in {name!r} is not closed before the next {self.key_open}"
                return self._fail(t, start, value_at, "bad_markup", why, out)
            if key in arguments:
                why = f"argument {key!r} of {name!r} is given twice"
                return self._fail(t, start, close, "bad_arguments_type", why, out)
            arguments[key] = self._value(value, schema, key)
            pos = close + len(self.value_close)

    def _value(self, value: str, schema: dict[str, Any] | None, key: str) -> Any:
        declared = schema.get(key) if schema is not None else None
        if _schema_types(declared):
            return _typed_value(value, declared)
        try:
            decoded = _loads(value)
        except ValueError:
            return value
        return value if isinstance(decoded, str) else decoded

    def _fail(self, t: _Text, start: int, pos: int, kind: str, message: str, out: _Collector) -> int:
        """A malformed block: one error, nothing in it runs.  It ends at the first ``</tool_call>`` from
        ``pos``, or (none before the next ``<tool_call>``) just before that ``<tool_call>``."""
        end, stop = self._block_end(t, pos)
        raw = t.s[start:stop]
        if end == -1:
            unclosed = self._unclosed(start, raw, truncated=stop == t.n)
            if message:
                unclosed = ParseError("unclosed_tag", f"{message}; {unclosed.message}", raw)
            out.error(unclosed)
        else:
            out.error(ParseError(kind, f"{message or 'malformed call'}; the call was not run.", raw))
        return max(stop, start + 1)
