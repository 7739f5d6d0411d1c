"""The Mistral formats: ``[TOOL_CALLS] [{...}, ...]`` and the compact ``[TOOL_CALLS]f[ARGS]{...}``."""

from __future__ import annotations

from typing import Any

from .base import ParsedTurn, ParseError, ToolCall, _arguments, _call_from_value, _Collector, _json_item, _Parser, _show
from .scan import _Text


class MistralParser(_Parser):
    """The Mistral formats, after ``[TOOL_CALLS]`` (text before it is content)::

        [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
        [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}

    The first (Mistral 7B v0.3, Mixtral, Nemo, Small 3.1) is a JSON array of calls (one object is
    accepted as a list of one); an ``"id"`` string becomes the call's id.  The compact forms (newer
    tokenizers: Small 3.2, Magistral, Devstral) take one call per ``[TOOL_CALLS]``.  Without a model id, a
    call's id is ``call`` and five digits counting the conversation's calls (``call00000``, ``call00001``,
    ... with ``parse(text, calls_before=n)``): Mistral's templates require ids of nine
    letters or digits.  Anything after a call's JSON value other than the next ``[TOOL_CALLS]`` makes that
    whole ``[TOOL_CALLS]`` section an error.
    """

    marker = "[TOOL_CALLS]"
    openers = (marker,)
    args_marker = "[ARGS]"
    id_marker = "[CALL_ID]"
    call_format = '[TOOL_CALLS] [{"name": <tool name>, "arguments": {<argument name>: <value>, ...}}]'

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        out = _Collector(first_id)
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
            call = _call_from_value(item, raw, self._id(out, item))
            if isinstance(call, ToolCall):
                call.id_in_text = _given_id(item) is not None
            out.add(call)
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
            given = bool(call_id)
            out.call(ToolCall(name, arguments, id=call_id or self._id(out, None), raw=raw, id_in_text=given))
        return value.end if value.problem else t.skip_ws(value.end)

    def _id(self, out: _Collector, item: Any) -> str:
        given = _given_id(item)
        return given if given is not None else self.required_id(out.first_id + len(out.calls))

    def required_id(self, n: int) -> str:
        """Mistral's templates refuse ids other than nine letters or digits: ``call`` and five digits."""
        return f"call{n % 100_000:05d}"


def _given_id(item: Any) -> str | None:
    """The id the model wrote in a JSON call object (``"id": "..."``), if any."""
    given = item.get("id") if isinstance(item, dict) else None
    return given if isinstance(given, str) and given.strip() else None
