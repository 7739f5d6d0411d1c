"""The text a parser reads, searched forward only, and the JSON decoding every format shares.

Every search, skip and decode goes through :class:`_Text`, which counts the characters it covers: that
count is how the tests prove parsing is linear in the text (operation counts, not wall-clock).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

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
