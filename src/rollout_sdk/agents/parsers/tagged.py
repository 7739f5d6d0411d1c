"""Blocks between an open and a close tag anywhere in the text (Hermes, Qwen3-Coder): the shared scan."""

from __future__ import annotations

from .base import ParsedTurn, ParseError, _Collector, _Parser
from .scan import _Text


class _TaggedBlocks(_Parser):
    """Blocks between an open and a close tag, anywhere in the text; subclasses parse one block."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    openers = (open_tag,)
    #: tags whose region is prose even when it holds the open tag (Hermes: ``<think>``)
    think_open = ""
    think_close = ""

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        out = _Collector(first_id)
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
