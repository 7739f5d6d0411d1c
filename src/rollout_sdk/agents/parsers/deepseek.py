"""The DeepSeek V3 and V3.1 formats: calls between fullwidth special tokens.

V3 (DeepSeek-V3, V3-0324, R1-0528)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (DeepSeek-V3.1, V3.1-Terminus) drops the type and the fence::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>

(one line: the breaks here are for reading).

The markers are the tokenizer's special tokens, written with FULLWIDTH VERTICAL LINE (U+FF5C) and LOWER
ONE EIGHTH BLOCK (U+2581); an ASCII look-alike (``<|tool▁calls▁begin|>``) is prose.  DeepSeek's chat
templates write ``arguments`` into the prompt as they are (string concatenation): a conversation replayed
through them needs the arguments as JSON text, which :class:`~rollout_sdk.agents.ChatTemplate` gives any
template that renders them so (``template_arguments``).
"""

from __future__ import annotations

from .base import _Collector
from .sections import _Head, _SectionCalls

_BAR = "\uff5c"
_SP = "\u2581"


def _token(words: str) -> str:
    return f"<{_BAR}{words.replace(' ', _SP)}{_BAR}>"


class DeepSeekV31Parser(_SectionCalls):
    """DeepSeek V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (module docstring)."""

    section_open = _token("tool calls begin")
    section_close = _token("tool calls end")
    call_open = _token("tool call begin")
    call_close = _token("tool call end")
    sep = _token("tool sep")
    call_format = (
        f"{section_open}{call_open}<tool name>{sep}{{<argument name>: <value>, ...}}{call_close}{section_close}"
    )

    def _head(self, text: str, out: _Collector) -> _Head:
        return _name(text, f"{self.call_open}<tool name>{self.sep}")


class DeepSeekV3Parser(_SectionCalls):
    """DeepSeek V3: ``function<｜tool▁sep｜>NAME`` then the arguments in a ```json fence (module docstring).
    The type before the separator must be ``function``."""

    section_open = DeepSeekV31Parser.section_open
    section_close = DeepSeekV31Parser.section_close
    call_open = DeepSeekV31Parser.call_open
    call_close = DeepSeekV31Parser.call_close
    sep = DeepSeekV31Parser.sep
    fence_open = "```json"
    fence_close = "```"
    call_format = (
        f"{section_open}{call_open}function{sep}<tool name>\n```json\n{{<argument name>: <value>, ...}}\n```"
        f"{call_close}{section_close}"
    )

    def _call(self, t, start, out):  # type: ignore[no-untyped-def]
        body = start + len(self.call_open)
        sep = t.find(self.sep, body)
        if sep != -1 and t.s[body:sep].strip() != "function" and sep - body < 64:
            t.work += sep - body
            kind = _show_type(t.s[body:sep])
            return self._fail(t, start, sep, "bad_markup", f"a call of type {kind}: only 'function' is known", out)
        return super()._call(t, start, out)

    def _head(self, text: str, out: _Collector) -> _Head:
        return _name(text, f"function{self.sep}<tool name>")


def _show_type(text: str) -> str:
    return repr(text.strip()[:40])


def _name(text: str, shape: str) -> _Head:
    name = text.strip()
    if not name or any(c.isspace() for c in name) or "<" in name:
        shown = repr(name[:60]) + ("..." if len(name) > 60 else "")
        return _Head(problem=f"a call needs one tool name, written {shape}, got {shown}")
    return _Head(name=name)
