"""Tool calls and reasoning out of the policy's decoded text, without ever crashing on what the policy writes.

During RL the policy is still learning the tool-call format, so malformed calls are routine, not
exceptional: bad JSON, a call without a name, a tag that is never closed because generation hit the
length limit.  A parser here therefore never raises on model output.  Every malformed call becomes a
:class:`ParseError` whose message is written for the model (it is fed back as the tool turn, see
:func:`format_tool_error`), and a malformed call never costs the valid calls of the same turn.

The format is pluggable: :class:`ToolCallParser` is the protocol every parser implements, and
:func:`get_parser` picks one by name (:func:`parser_names`).  The built-in formats:

=================  ====================================================================================
``hermes``         Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
``qwen3_coder``    Qwen3-Coder XML: ``<tool_call><function=f><parameter=p>value</parameter></function>``
                   ``</tool_call>``
``llama3_json``    Llama 3.1 / 3.2 / 3.3 JSON: ``<|python_tag|>{"name": ..., "parameters": {...}}`` or the
                   bare object at the start of the turn; several calls separated by ``;``
``mistral``        Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`` and the
                   compact ``[TOOL_CALLS]f[CALL_ID]id[ARGS]{...}`` (``[CALL_ID]`` optional)
``pythonic``       Llama 4, Llama 3.2 (1B/3B): ``[f(a=1, b="x"), g()]``, Python literals read with ``ast``,
                   never evaluated
``deepseek_v3``    DeepSeek V3 / R1: ``<｜tool▁calls▁begin｜>`` sections, arguments in a ```json fence
``deepseek_v31``   DeepSeek V3.1: the same sections, ``NAME<｜tool▁sep｜>{...}``
``kimi_k2``        Kimi-K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}``; the
                   model's ids are kept
``gpt_oss``        gpt-oss harmony (alias ``harmony``): messages ``to=functions.NAME``; reasoning parser
                   ``harmony`` returns the ``analysis`` channel
``glm45``          GLM-4.5 / 4.6 / 4.7: ``<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>``
=================  ====================================================================================

Rules every format follows (each tested in tests/test_agent_parsers.py and tests/test_tool_formats.py):

* A call block with anything after its JSON value (``{...}}}``: one closing brace too many; trailing
  words) is an error, and **nothing in that block runs**: the extra text may mean the value the model
  meant was cut short (a ``write_file`` whose ``content`` ended early).  The error is ``bad_json``
  ("Extra data") in the JSON formats, ``bad_markup`` in the XML one.
* Tags inside JSON strings are content: a block ends at the close tag that follows the decoded value.
* ``NaN``, ``Infinity`` and numbers that overflow to infinity are not JSON; JSON nested deeper than the
  decoder allows is ``bad_json`` too: no call with such an argument ever runs, and nothing raises.
* :meth:`ParsedTurn.in_text_order` lists calls and errors in the order they appear in the text: the
  order an agent loop feeds results and errors back to the model.
* Parsing is linear in the length of the text, whatever the text (no search restarts from an earlier
  position, no backtracking regex): every search goes through :class:`_Text`, which counts what it scans.

Reasoning (``<think>...</think>``) is split off by a :class:`ReasoningParser` (:func:`get_reasoning_parser`)
*before* tool calls are parsed, so calls drafted while thinking are never run.  The reasoning stays in
the recorded tokens (the model generated it) and is trained like any other output token.

The package holds one module per format (``hermes.py``, ``qwen3_coder.py``, ``llama3_json.py``,
``mistral.py``, ``pythonic.py``, ``deepseek.py``, ``kimi_k2.py``, ``harmony.py``, ``glm45.py``), their
base (``base.py``: the result types, the protocol, a call's JSON shape; ``scan.py``:
the forward-only text and JSON decoding; ``tagged.py``: tag-delimited blocks; ``sections.py``: calls in a
section of special tokens) and the reasoning parsers
(``reasoning.py``).  A new format is one new module and one line in the registry below.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_sdk.errors import ConfigError

from .base import PARSE_ERROR_KINDS, ParsedTurn, ParseError, ToolCall, ToolCallParser
from .deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from .glm45 import Glm45Parser
from .harmony import HarmonyParser, HarmonyReasoningParser
from .hermes import HermesParser
from .kimi_k2 import KimiK2Parser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .pythonic import PythonicParser
from .qwen3_coder import Qwen3CoderParser
from .reasoning import NoReasoningParser, ReasoningParser, ThinkReasoningParser
from .scan import _Text

__all__ = [
    "PARSE_ERROR_KINDS",
    "DeepSeekV3Parser",
    "DeepSeekV31Parser",
    "Glm45Parser",
    "HarmonyParser",
    "HarmonyReasoningParser",
    "HermesParser",
    "KimiK2Parser",
    "Llama3JsonParser",
    "MistralParser",
    "NoReasoningParser",
    "ParseError",
    "ParsedTurn",
    "PythonicParser",
    "Qwen3CoderParser",
    "ReasoningParser",
    "ThinkReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "format_tool_error",
    "get_parser",
    "get_reasoning_parser",
    "parser_names",
    "reasoning_parser_names",
    "register_parser",
    "register_reasoning_parser",
    "split_reasoning",
]


def format_tool_error(error: ParseError, call_format: str | None = None) -> str:
    """The tool-turn message an agent loop feeds back to the model for a malformed call.

    ``call_format`` is the shape of a call in the parser's format (``parser.call_format``); the
    default is the Hermes one.
    """
    shape = call_format or HermesParser.call_format
    return (
        f"Error: your tool call could not be parsed ({error.kind}): {error.message}\nWrite each tool call as:\n{shape}"
    )


ParserFactory = Callable[..., ToolCallParser]

_PARSERS: dict[str, ParserFactory] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "kimi_k2": KimiK2Parser,
    "gpt_oss": HarmonyParser,
    "harmony": HarmonyParser,
    "glm45": Glm45Parser,
}


def register_parser(name: str, factory: ParserFactory) -> None:
    """Make ``get_parser(name)`` return ``factory()``.  Re-registering a name replaces it.

    A factory that takes a ``tools`` keyword gets the tool schemas :func:`get_parser` was given.
    """
    if not name:
        raise ConfigError("parser", name, "a parser name must be a non-empty string")
    _PARSERS[name.lower()] = factory


def parser_names() -> list[str]:
    """The names :func:`get_parser` accepts, sorted."""
    return sorted(_PARSERS)


def get_parser(name: str, *, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallParser:
    """A new parser for the format ``name`` (:func:`parser_names`; ``"qwen25"`` is ``"hermes"``).

    ``tools``: the OpenAI tool schemas offered to the model; formats whose values are untyped text
    (``qwen3_coder``) read each value as its parameter's type.
    """
    factory = _PARSERS.get(name.lower()) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError("parser", name, f"unknown tool-call parser; known: {', '.join(parser_names())}")
    if tools is not None and _takes_tools(factory):
        return factory(tools=tools)
    return factory()


def _takes_tools(factory: ParserFactory) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "tools" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


_REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "none": NoReasoningParser,
    "think": ThinkReasoningParser,
    "think_open": lambda: ThinkReasoningParser(opened_by_prompt=True),
    "harmony": HarmonyReasoningParser,
}


def register_reasoning_parser(name: str, factory: Callable[[], ReasoningParser]) -> None:
    """Make ``get_reasoning_parser(name)`` return ``factory()``.  Re-registering a name replaces it."""
    if not name:
        raise ConfigError("reasoning_parser", name, "a reasoning parser name must be a non-empty string")
    _REASONING_PARSERS[name.lower()] = factory


def reasoning_parser_names() -> list[str]:
    """The names :func:`get_reasoning_parser` accepts, sorted."""
    return sorted(_REASONING_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new reasoning parser: ``"none"`` (no reasoning), ``"think"`` (``<think>...</think>``),
    ``"think_open"`` (the prompt opens the think block), ``"harmony"`` (gpt-oss's ``analysis`` channel)."""
    factory = _REASONING_PARSERS.get(name.lower()) if isinstance(name, str) else None
    if factory is None:
        known = ", ".join(reasoning_parser_names())
        raise ConfigError("reasoning_parser", name, f"unknown reasoning parser; known: {known}")
    return factory()


def split_reasoning(reasoning: ReasoningParser, parser: ToolCallParser, text: str) -> tuple[str | None, str]:
    """``reasoning.split(text)``, told where ``parser``'s first tool call could start when both know how
    (:class:`ThinkReasoningParser` and the built-in formats' ``call_start``): think tags inside a call's
    arguments then stay the call's text instead of swallowing or cutting the call.  What the agent loop
    and the gateway call."""
    locate = getattr(parser, "call_start", None)
    if isinstance(reasoning, ThinkReasoningParser) and callable(locate):
        return reasoning.split(text, calls_at=locate(text))
    return reasoning.split(text)


def _scan_work(parser: Any, text: str) -> int:
    """How many characters a built-in parser's searches, skips and decodes covered on ``text``."""
    t = _Text(text)
    parser._parse(t, 0)
    return t.work
