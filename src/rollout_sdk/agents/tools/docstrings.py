"""Google-style docstrings: a tool's description and its parameters' descriptions."""

from __future__ import annotations

import inspect
import re

__all__ = ["parse_docstring"]


# -- docstrings -----------------------------------------------------------------------------------

_SECTION_RE = re.compile(
    r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Returns?|Yields?|Raises|"
    r"Examples?|Notes?|Attributes|See Also|Warnings?|Todo)\s*:\s*$",
    re.IGNORECASE,
)
_ARGS_SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments"}
_ARG_LINE_RE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """The first paragraph (one line) and the Google-style ``Args:`` descriptions of ``doc``."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION_RE.match(line):
            break
        summary.append(line.strip())
    return " ".join(summary), _arg_descriptions(lines)


def _arg_descriptions(lines: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    i = 0
    while i < len(lines):
        match = _SECTION_RE.match(lines[i])
        if match and match.group(1).lower() in _ARGS_SECTIONS:
            i = _read_args_section(lines, i + 1, _indent(lines[i]), found)
        else:
            i += 1
    return found


def _read_args_section(lines: list[str], i: int, header_indent: int, found: dict[str, str]) -> int:
    """Read entries (``name (type): text`` plus more-indented continuation lines); return the next line."""
    entry_indent: int | None = None
    current: str | None = None
    while i < len(lines):
        line = lines[i]
        if line.strip():
            indent = _indent(line)
            if indent <= header_indent:
                break
            entry_indent = indent if entry_indent is None else entry_indent
            match = _ARG_LINE_RE.match(line.strip())
            if indent == entry_indent and match:
                current = match["name"]
                found[current] = match["text"].strip()
            elif current is not None:
                found[current] = f"{found[current]} {line.strip()}".strip()
        i += 1
    return i


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
