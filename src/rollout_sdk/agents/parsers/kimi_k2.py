"""The Kimi-K2 format: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``."""

from __future__ import annotations

from .base import _Collector
from .sections import _Head, _SectionCalls


class KimiK2Parser(_SectionCalls):
    """Kimi-K2 (Instruct, Thinking)::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
        {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

    (one line: the break is for reading).

    The id is what the model writes, ``functions.NAME:IDX`` with IDX counting the calls of the
    conversation from 0; it is kept as the call's id, because Kimi's chat template writes each call's id
    back into the conversation (``<|tool_call_begin|>{{ id }}``) and names the result by it (``## Return of
    {{ tool_call_id }}``): any other id would make the replayed conversation differ from what the model
    wrote.  ``NAME:IDX`` without the ``functions.`` prefix is accepted (as SGLang does); a head that is not
    ``[functions.]NAME:IDX`` is ``missing_name``.
    """

    section_open = "<|tool_calls_section_begin|>"
    section_close = "<|tool_calls_section_end|>"
    call_open = "<|tool_call_begin|>"
    call_close = "<|tool_call_end|>"
    sep = "<|tool_call_argument_begin|>"
    call_format = (
        f"{section_open}{call_open}functions.<tool name>:<call index>{sep}{{<argument name>: <value>, ...}}"
        f"{call_close}{section_close}"
    )
    #: the call ids are the model's text: the gateway returns them as they are
    ids_in_text = True

    def _head(self, text: str, out: _Collector) -> _Head:
        head = text.strip()
        name, colon, index = head.rpartition(":")
        name = name.removeprefix("functions.")
        ok = colon and name and index.isascii() and index.isdigit() and not any(c.isspace() or c in "<>" for c in head)
        if not ok:
            shown = repr(head[:60]) + ("..." if len(head) > 60 else "")
            return _Head(problem=f"a call's head must be functions.<tool name>:<call index>, got {shown}")
        return _Head(name=name, id=head)
