"""The Hermes / Qwen2.5 / Qwen3 format: a JSON object per ``<tool_call>...</tool_call>`` block."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import ParseError, _call_from_value, _Collector, _shape
from .scan import _Text
from .tagged import _TaggedBlocks


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
