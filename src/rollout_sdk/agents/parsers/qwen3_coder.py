"""The Qwen3-Coder XML format: ``<tool_call><function=f><parameter=p>value</parameter></function></tool_call>``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .base import ParseError, ToolCall, _Collector, _show
from .scan import _Text
from .schema import _parameter_schemas, _typed_value
from .tagged import _TaggedBlocks


class Qwen3CoderParser(_TaggedBlocks):
    """The Qwen3-Coder XML format, one function per block (several are several calls)::

        <tool_call>
        <function=write_file>
        <parameter=path>
        notes.txt
        </parameter>
        <parameter=content>
        any text, <b>markup</b> included
        </parameter>
        </function>
        </tool_call>

    A value is the raw text between ``<parameter=name>`` and the first ``</parameter>``, less one newline
    at each end (how the chat template writes it).  Values are strings unless ``tools`` (the OpenAI tool
    schemas offered to the model) give the parameter a type: then a value of an integer, number, boolean,
    null, array or object parameter is read as JSON (``True``/``False`` too, which the template writes for
    Python booleans); a value that does not read as that type stays a string, so the registry's argument
    check names the problem.  Malformed markup (a value that holds ``<parameter=`` or ``</function>``, i.e.
    a missing ``</parameter>``; text between parameters; a parameter given twice; text after
    ``</function>``) is an error for the whole block.
    """

    function_open = "<function="
    function_close = "</function>"
    param_open = "<parameter="
    param_close = "</parameter>"
    call_format = (
        "<tool_call>\n<function=TOOL_NAME>\n<parameter=ARGUMENT_NAME>\nvalue\n</parameter>\n</function>\n</tool_call>"
    )

    def __init__(self, *, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = _parameter_schemas(tools)

    def _parse_block(self, t: _Text, start: int, out: _Collector) -> int:
        pos = t.skip_ws(start + len(self.open_tag))
        calls: list[tuple[str, dict[str, Any], str]] = []
        while t.at(self.function_open, pos):
            parsed = self._function(t, pos)
            if isinstance(parsed, _Failure):
                return self._fail(t, start, parsed, out)
            calls.append(parsed[:3])
            pos = t.skip_ws(parsed[3])
        if not calls:
            got = _show(t.s[pos : pos + 20])
            return self._fail(
                t,
                start,
                _Failure(
                    pos, "missing_name", f"expected {self.function_open}TOOL_NAME> after {self.open_tag}, got {got}"
                ),
                out,
            )
        if not t.at(self.close_tag, pos):
            if pos >= t.n or t.at(self.open_tag, pos):
                return self._fail(t, start, _Failure(pos, "unclosed_tag", ""), out)
            got = _show(t.s[pos : pos + 20])
            why = f"text after {self.function_close} where {self.close_tag} was expected: {got}"
            return self._fail(t, start, _Failure(pos, "bad_markup", why), out)
        stop = pos + len(self.close_tag)
        raw = t.s[start:stop]
        for name, arguments, call_raw in calls:
            out.call(
                ToolCall(name=name, arguments=arguments, id=out.next_id(), raw=raw if len(calls) == 1 else call_raw)
            )
        return stop

    def _function(self, t: _Text, pos: int) -> tuple[str, dict[str, Any], str, int] | _Failure:
        """The ``<function=...>...</function>`` at ``pos``: ``(name, arguments, raw, end)``."""
        name_at = pos + len(self.function_open)
        name_end = t.name_at(name_at)
        name = t.s[name_at:name_end].strip()
        if not t.at(">", name_end) or not name:
            return _Failure(pos, "missing_name", f"expected {self.function_open}TOOL_NAME> with a non-empty name")
        schema = self.schemas.get(name, {})
        arguments: dict[str, Any] = {}
        p = name_end + 1
        while True:
            p = t.skip_ws(p)
            if t.at(self.function_close, p):
                end = p + len(self.function_close)
                return name, arguments, t.s[pos:end], end
            if not t.at(self.param_open, p):
                if p >= t.n:
                    return _Failure(
                        p, "unclosed_tag", f"{self.function_open}{name}> has no {self.function_close} before the end"
                    )
                got = _show(t.s[p : p + 20])
                return _Failure(
                    p, "bad_markup", f"in {name!r}, expected {self.param_open}NAME> or {self.function_close}, got {got}"
                )
            pname_at = p + len(self.param_open)
            pname_end = t.name_at(pname_at)
            pname = t.s[pname_at:pname_end].strip()
            if not t.at(">", pname_end) or not pname:
                return _Failure(p, "bad_markup", f"in {name!r}, expected {self.param_open}NAME> with a non-empty name")
            value_at = pname_end + 1
            close = t.find(self.param_close, value_at)
            reopen = t.find(self.open_tag, value_at)
            if close == -1 or (reopen != -1 and reopen < close):
                where = "the end of the text" if close == -1 else f"the next {self.open_tag}"
                what = f"{self.param_open}{pname}> of {name!r} has no {self.param_close} before {where}"
                return _Failure(p, "unclosed_tag", what)
            value = t.s[value_at:close]
            t.work += len(value)
            for marker in (self.param_open, self.function_close):
                if marker in value:
                    return _Failure(
                        p,
                        "bad_markup",
                        f"{self.param_open}{pname}> of {name!r} is not closed with {self.param_close} before {marker}",
                    )
            if pname in arguments:
                return _Failure(p, "bad_arguments_type", f"argument {pname!r} of {name!r} is given twice")
            arguments[pname] = _typed_value(_one_newline_less(value), schema.get(pname))
            p = close + len(self.param_close)

    def _fail(self, t: _Text, start: int, failure: _Failure, out: _Collector) -> int:
        """A malformed block: one error, nothing in it runs.  The block ends at the first close tag from
        where it went wrong, or (none before the next open tag) just before that open tag."""
        _, stop = self._block_end(t, failure.pos)
        raw = t.s[start:stop]
        if failure.message:
            out.error(ParseError(failure.kind, f"{failure.message}; the call was not run.", raw))
        else:
            out.error(self._unclosed(start, raw, truncated=stop == t.n))
        return stop


class _Failure(msgspec.Struct, frozen=True):
    pos: int
    kind: str
    message: str


def _one_newline_less(value: str) -> str:
    """The template writes ``<parameter=p>\\n{value}\\n</parameter>``: take those two newlines off."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value
