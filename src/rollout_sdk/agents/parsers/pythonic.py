"""The pythonic format (Llama 4, Llama 3.2 light-weight models): ``[f(a=1, b="x"), g()]``."""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from .base import ParsedTurn, ParseError, ToolCall, _Collector, _Parser, _show
from .scan import _Text

#: a call list where one may start: a line (or the text) opening with ``[NAME(``
_LIST_START = re.compile(r"(?m)^[ \t]*\[[ \t]*[A-Za-z_][\w.]*[ \t]*\(")
#: inside a call list: the next bracket or quote (everything else is skipped in one step)
_INTERESTING = re.compile(r"[\[\](){}'\"#\n]")
_STRINGS = {
    q: re.compile(p, re.DOTALL if len(q) == 3 else 0)
    for q, p in (
        ('"""', r'"""(?:[^"\\]|\\.|"(?!""))*"""'),
        ("'''", r"'''(?:[^'\\]|\\.|'(?!''))*'''"),
        ('"', r'"(?:[^"\\\n]|\\.)*"'),
        ("'", r"'(?:[^'\\\n]|\\.)*'"),
    )
}
_PAIRS = {")": "(", "]": "[", "}": "{"}
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser(_Parser):
    """Calls as a Python list of function calls with keyword arguments::

        [get_weather(city="Paris", days=3), search(query='北京', tags=["a", "b"], exact=True)]

    The list starts the text, a line, or follows ``<|python_start|>`` (Llama 4; a ``<|python_end|>``
    right after it is part of the call).  Values are Python literals (strings in either quote, numbers,
    ``True``/``False``/``None`` and JSON's ``true``/``false``/``null``, lists, tuples, dicts with string
    keys); the list is parsed with :mod:`ast` and **never evaluated**.  A value that is not a literal (a
    name, an expression, a call), a positional argument, ``**kwargs`` or an argument given twice makes
    that call an error (the other calls of the list run); a list that does not parse as Python, or is
    never closed, is one error.  Text around the list is content.  Strings keep their Python meaning
    (``'it\\'s'``, ``"\\n"`` decoded): a template that writes values without quotes or escapes (vLLM's
    Llama 4 pythonic template formats them with ``%s``) replays a different text than the model wrote.
    """

    python_start = "<|python_start|>"
    python_end = "<|python_end|>"
    openers = (python_start, "[")
    call_format = '[TOOL_NAME(ARGUMENT_NAME="value", OTHER_ARGUMENT=1), OTHER_TOOL()]'

    def call_start(self, text: str) -> int:
        tag = text.find(self.python_start)
        m = _LIST_START.search(text)
        hits = [i for i in (tag, m.start() if m else -1) if i != -1]
        return min(hits, default=-1)

    def _parse(self, t: _Text, first_id: int = 0) -> ParsedTurn:
        out = _Collector(first_id)
        pos = 0
        searched = -1  # where the last _LIST_START search found its match (or -1 if it ran to the end)
        match: re.Match[str] | None = None
        while pos < t.n:
            if match is None or match.start() < pos:
                if searched == t.n:
                    match = None
                else:
                    match = _LIST_START.search(t.s, pos)
                    searched = match.end() if match else t.n
                    t.work += searched - pos
            tag = t.find(self.python_start, pos)
            starts = [i for i in (tag, match.start() if match else -1) if i != -1]
            if not starts:
                out.outside.append(t.s[pos:])
                break
            at = min(starts)
            out.outside.append(t.s[pos:at])
            if at == tag:
                bracket = t.skip_ws(at + len(self.python_start))
                if not t.at("[", bracket):
                    why = f"{self.python_start} must be followed by a list of calls {self.call_format}"
                    stop = self._line_end(t, bracket)
                    out.error(ParseError("bad_markup", why, t.s[at:stop]))
                    pos = max(stop, at + 1)
                    continue
            else:
                bracket = t.s.index("[", at, match.end()) if match else at
            pos = self._list(t, at, bracket, out)
        return out.turn()

    def _line_end(self, t: _Text, pos: int) -> int:
        end = t.find("\n", pos)
        return t.n if end == -1 else end

    def _list(self, t: _Text, start: int, bracket: int, out: _Collector) -> int:
        """The call list whose ``[`` is at ``bracket`` (its text starts at ``start``); return where
        scanning resumes."""
        end, problem = _list_end(t, bracket)
        if problem:
            out.error(ParseError("bad_json", f"{problem}; no call was run.", t.s[start:end]))
            return max(end, start + 1)
        stop = end
        after = t.skip_ws(end)
        if t.at(self.python_end, after):
            stop = after + len(self.python_end)
        raw = t.s[start:stop]
        source = t.s[bracket:end]
        t.work += 2 * len(source)
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            why = getattr(exc, "msg", None) or str(exc) or type(exc).__name__
            out.error(ParseError("bad_json", f"the call list is not valid Python ({why}); no call was run.", raw))
            return stop
        calls = tree.body.elts if isinstance(tree.body, ast.List) else []
        if not calls:
            out.error(ParseError("not_object", f"an empty list of calls: expected {self.call_format}", raw))
            return stop
        for node in calls:
            out.add(self._call(node, raw if len(calls) == 1 else _segment(source, node), out))
        return stop

    def _call(self, node: ast.expr, raw: str, out: _Collector) -> ToolCall | ParseError:
        if not isinstance(node, ast.Call):
            return ParseError("not_object", f"each item of the list must be a call NAME(...), got {_show(raw)}", raw)
        name = _dotted(node.func)
        if not name:
            return ParseError("missing_name", f"a call's function must be a name, got {_show(raw)}", raw)
        if node.args:
            why = f"tool call {name!r} has positional arguments: write every argument as NAME=value"
            return ParseError("bad_arguments_type", why, raw)
        arguments: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                why = f"tool call {name!r} uses **: write every argument as NAME=value"
                return ParseError("bad_arguments_type", why, raw)
            if kw.arg in arguments:
                return ParseError("bad_arguments_type", f"argument {kw.arg!r} of {name!r} is given twice", raw)
            value = _literal(kw.value)
            if isinstance(value, _NotLiteral):
                literals = "string, number, True/False/None, list, dict"
                why = f"argument {kw.arg!r} of {name!r} must be a literal ({literals}): {value.why}"
                return ParseError("bad_arguments_type", why, raw)
            arguments[kw.arg] = value
        return ToolCall(name=name, arguments=arguments, id=out.next_id(), raw=raw)


class _NotLiteral:
    def __init__(self, why: str) -> None:
        self.why = why


def _literal(node: ast.expr) -> Any:
    """A literal's JSON value, or :class:`_NotLiteral`.  Recursion is bounded by Python's parser (it refuses
    more than 200 nested brackets)."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, str, int)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else _NotLiteral("a number too large to be finite")
        return _NotLiteral(f"a {type(v).__name__} constant")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _literal(node.operand)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
        return _NotLiteral("a sign before something that is not a number")
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e) for e in node.elts]
        bad = next((i for i in items if isinstance(i, _NotLiteral)), None)
        return bad if bad is not None else items
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key_node, value_node in zip(node.keys, node.values, strict=True):
            key = _literal(key_node) if key_node is not None else _NotLiteral("a ** in a dict")
            if not isinstance(key, str):
                return key if isinstance(key, _NotLiteral) else _NotLiteral("a dict key that is not a string")
            value = _literal(value_node)
            if isinstance(value, _NotLiteral):
                return value
            out[key] = value
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    return _NotLiteral(f"got a {type(node).__name__} expression")


def _dotted(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def _segment(source: str, node: ast.expr) -> str:
    return ast.get_source_segment(source, node) or source


def _list_end(t: _Text, bracket: int) -> tuple[int, str]:
    """Where the bracketed list at ``bracket`` ends (past its ``]``), skipping strings and comments in one
    forward pass; or ``(where scanning stopped, why)``."""
    s = t.s
    stack: list[str] = []
    pos = bracket
    try:
        while True:
            m = _INTERESTING.search(s, pos)
            if m is None:
                t.work += t.n - pos
                return t.n, "the call list is never closed with ]"
            t.work += m.end() - pos
            c, at = m.group(), m.start()
            if c in "([{":
                stack.append(c)
                pos = at + 1
            elif c in ")]}":
                if not stack or stack.pop() != _PAIRS[c]:
                    return at + 1, f"the call list has an unmatched {c!r} at character {at}"
                pos = at + 1
                if not stack:
                    return pos, ""
            elif c == "#":
                line = s.find("\n", at)
                end = t.n if line == -1 else line
                t.work += end - at
                pos = end
            elif c == "\n":
                pos = at + 1
            else:
                quote = s[at : at + 3] if s.startswith(c * 3, at) else c
                lit = _STRINGS[quote].match(s, at)
                if lit is None:
                    line = s.find("\n", at) if len(quote) == 1 else -1
                    end = t.n if line == -1 else line
                    t.work += end - at
                    return end, f"a string at character {at} is never closed"
                t.work += lit.end() - at
                pos = lit.end()
    except RecursionError:  # pragma: no cover - regexes here do not recurse
        return t.n, "the call list is nested too deeply"
