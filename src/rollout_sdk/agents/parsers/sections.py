"""Calls inside a section of special tokens (DeepSeek V3 / V3.1, Kimi-K2): the shared scan.

::

    <section open> <call open> HEAD <sep> ARGUMENTS <call close> ... <section close>

Text before a section (and after it) is content; inside a section only calls and whitespace may stand.
A subclass reads the head of one call (:meth:`_SectionCalls._head`: a name, maybe an id) and says how the
arguments are framed.  Every search goes forward through :class:`~.scan._Text` (linear time).
"""

from __future__ import annotations

import msgspec

from .base import ParsedTurn, ParseError, ToolCall, _arguments, _Collector, _json_item, _Parser, _show
from .scan import _Text


class _Head(msgspec.Struct, frozen=True):
    """A call's head: its name and the id the model wrote ("": none), or why it is malformed."""

    name: str = ""
    id: str = ""
    problem: str = ""


class _SectionCalls(_Parser):
    section_open = ""
    section_close = ""
    call_open = ""
    call_close = ""
    sep = ""
    #: text between the separator's head and the JSON value (DeepSeek V3's fence), and after the value
    fence_open = ""
    fence_close = ""

    @property
    def openers(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.section_open,)

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        out = _Collector(first_id)
        pos = 0
        while pos < t.n:
            start = t.find(self.section_open, pos)
            if start == -1:
                out.outside.append(t.s[pos:])
                break
            out.outside.append(t.s[pos:start])
            pos = self._section(t, start + len(self.section_open), out)
        return out.turn()

    def _section(self, t: _Text, pos: int, out: _Collector) -> int:
        """The calls of a section whose text starts at ``pos``; return where the section ends.  A section
        the text ends in without its close marker (the model stopped right after its last call) is
        accepted: each call has its own close marker, and an unclosed call is an error."""
        while True:
            at = t.skip_ws(pos)
            if at >= t.n:
                return t.n
            if t.at(self.section_close, at):
                return at + len(self.section_close)
            if t.at(self.call_open, at):
                pos = self._call(t, at, out)
                continue
            nxt, _ = t.first([self.call_open, self.section_close], at)
            stop = t.n if nxt == -1 else nxt
            got = _show(t.s[at : min(stop, at + 40)])
            message = (
                f"text inside {self.section_open}...{self.section_close} that is not a call: {got}; "
                f"write each call as {self.call_format}"  # type: ignore[attr-defined]
            )
            out.error(ParseError("bad_markup", message, t.s[at:stop]))
            pos = stop

    def _call(self, t: _Text, start: int, out: _Collector) -> int:
        body = start + len(self.call_open)
        close = t.find(self.call_close, body)
        sep = t.find(self.sep, body)
        if sep == -1 or (close != -1 and sep > close):
            return self._fail(t, start, body, "missing_name", f"a call without {self.sep} after its name", out)
        head_text = t.s[body:sep]
        t.work += len(head_text)
        pos = sep + len(self.sep)
        if self.fence_open:  # DeepSeek V3: the name line, then the fence
            fence = t.find(self.fence_open, pos)
            if fence == -1 or (close != -1 and fence > close):
                why = f"a call whose arguments are not in a {self.fence_open!r} block"
                return self._fail(t, start, pos, "bad_markup", why, out)
            head_text = t.s[pos:fence]
            t.work += len(head_text)
            pos = fence + len(self.fence_open)
        head = self._head(head_text, out)
        if head.problem:
            return self._fail(t, start, pos, "missing_name", head.problem, out)
        follows = (self.fence_close or self.call_close,)
        item = _json_item(t, t.skip_ws(pos), follows, self.call_close)
        if item.problem:
            return self._fail(t, start, pos, "bad_json", item.problem, out)
        end = t.skip_ws(item.end)
        if self.fence_close:
            if not t.at(self.fence_close, end):
                why = f"the arguments of {head.name!r} are not closed with {self.fence_close!r}"
                return self._fail(t, start, end, "bad_markup", why, out)
            end = t.skip_ws(end + len(self.fence_close))
        if not t.at(self.call_close, end):
            if end >= t.n:
                return self._fail(t, start, end, "unclosed_tag", "", out)
            why = f"text after the arguments of {head.name!r} where {self.call_close} was expected"
            return self._fail(t, start, end, "bad_markup", why, out)
        stop = end + len(self.call_close)
        raw = t.s[start:stop]
        arguments = _arguments(item.value, head.name)
        if isinstance(arguments, str):
            out.error(ParseError("bad_arguments_type", arguments, raw))
        else:
            call_id = head.id or out.next_id()
            out.call(ToolCall(name=head.name, arguments=arguments, id=call_id, raw=raw, id_in_text=bool(head.id)))
        return stop

    def _head(self, text: str, out: _Collector) -> _Head:
        raise NotImplementedError

    def _fail(self, t: _Text, start: int, pos: int, kind: str, message: str, out: _Collector) -> int:
        """A malformed call: one error, nothing in it runs.  It ends at the first close marker from ``pos``,
        or (none before the next call or the section's end) just before that: then it is unclosed."""
        close = t.find(self.call_close, pos)
        nxt, _ = t.first([self.call_open, self.section_close], pos)
        if close != -1 and (nxt == -1 or close < nxt):
            stop = close + len(self.call_close)
        else:
            stop = t.n if nxt == -1 else nxt
            where = "the end of the text" if nxt == -1 else f"the next {t.s[nxt : nxt + 24]!r}"
            unclosed = f"{self.call_open} at character {start} has no {self.call_close} before {where}"
            kind, message = "unclosed_tag", f"{message}; {unclosed}" if message else unclosed
        out.error(ParseError(kind, f"{message}; the call was not run.", t.s[start:stop]))
        return max(stop, start + 1)
