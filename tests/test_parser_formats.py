# ruff: noqa: E501  (the case tables keep one case per line: each is a model's text as written)
"""The formats beyond Hermes, Qwen3-Coder, Llama-3 JSON and Mistral: pythonic (Llama 4), DeepSeek V3 / V3.1,
Kimi-K2, gpt-oss harmony and GLM-4.5.  Each is written here from its model's public format (the model
cards' chat templates, SGLang's and vLLM's parsers), not from our parser; well-formed calls round-trip,
malformed and adversarial text becomes precise errors (never an exception, never a lost valid call), and
parsing stays linear in the size of the text (counted work, not wall-clock)."""

from __future__ import annotations

import json
import keyword
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import test_tool_formats as tool_formats  # the checks every format's tests share
from rollout_sdk.agents.parsers import (
    HarmonyReasoningParser,
    ToolCallParser,
    get_parser,
    get_reasoning_parser,
    parser_names,
    split_reasoning,
)
from test_tool_formats import FAST, JSON_VALUES, check_calls, check_linear, check_malformed, names_and_args

FORMATS = ["pythonic", "deepseek_v3", "deepseek_v31", "kimi_k2", "gpt_oss", "glm45"]

# -- how each model writes calls ------------------------------------------------------------------

BAR, SP = "\uff5c", "\u2581"


def ds(words: str) -> str:
    """A DeepSeek special token: ``<｜tool▁calls▁begin｜>``."""
    return f"<{BAR}{words.replace(' ', SP)}{BAR}>"


def py_literal(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a Python string literal
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"


def render(fmt: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    if fmt == "pythonic":
        return (
            "["
            + ", ".join(f"{n}(" + ", ".join(f"{k}={py_literal(v)}" for k, v in a.items()) + ")" for n, a in calls)
            + "]"
        )
    if fmt == "deepseek_v3":
        body = "\n".join(
            f"{ds('tool call begin')}function{ds('tool sep')}{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```"
            f"{ds('tool call end')}"
            for n, a in calls
        )
        return f"{ds('tool calls begin')}{body}{ds('tool calls end')}"
    if fmt == "deepseek_v31":
        body = "".join(
            f"{ds('tool call begin')}{n}{ds('tool sep')}{json.dumps(a, ensure_ascii=False)}{ds('tool call end')}"
            for n, a in calls
        )
        return f"{ds('tool calls begin')}{body}{ds('tool calls end')}"
    if fmt == "kimi_k2":
        body = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a, ensure_ascii=False)}"
            "<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    if fmt == "gpt_oss":
        return "".join(
            f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
            f"{json.dumps(a, ensure_ascii=False)}<|call|>"
            for n, a in calls
        )
    assert fmt == "glm45"
    return "".join(
        f"<tool_call>{n}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{glm_value(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>"
        for n, a in calls
    )


def glm_value(v: Any) -> str:
    """GLM's template: a string as it is, anything else as JSON."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def with_prose(fmt: str, prose: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    if fmt == "gpt_oss":  # the answer-less preamble is a commentary message; the reasoning an analysis one
        return f"<|channel|>commentary<|message|>{prose}<|end|>" + render(fmt, calls)
    return f"{prose}\n{render(fmt, calls)}"


def check_invariants(text: str, turn: Any) -> None:
    """What every parse of every text satisfies (Kimi-K2 keeps the ids its model wrote)."""
    tool_formats.check_invariants(text, turn, model_ids=True)


STRING_TOOLS = [  # GLM values are text: with string schemas they stay text whatever they hold
    {"type": "function", "function": {"name": n, "parameters": {"properties": {k: {"type": "string"} for k in "abv"}}}}
    for n in ("f", "g", "ok", "write_file", "get_weather", "search")
]

# -- the registry ---------------------------------------------------------------------------------


def test_every_new_format_is_registered_with_its_call_shape() -> None:
    assert set(FORMATS) <= set(parser_names())
    assert get_parser("harmony").__class__ is get_parser("gpt_oss").__class__
    for fmt in FORMATS:
        parser = get_parser(fmt)
        assert isinstance(parser, ToolCallParser)
        assert parser.call_format  # type: ignore[attr-defined]
    assert isinstance(get_reasoning_parser("harmony"), HarmonyReasoningParser)


# -- well-formed ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_in_text_order_with_prose_before(fmt: str) -> None:
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"q": "北京 天气 🌦", "tags": ["a", None]})]
    text = with_prose(fmt, "Let me look that up.", calls)
    turn = check_calls(text, calls, get_parser(fmt), model_ids=True)
    assert turn.content == "Let me look that up."
    assert get_parser(fmt).parse(text) == turn  # deterministic, ids included


@pytest.mark.parametrize("fmt", FORMATS)
def test_plain_text_is_content(fmt: str) -> None:
    for text in ("The answer is 4.", "See [1] and f(x).", '{"name": "f"}'):
        turn = get_parser(fmt).parse(text)
        assert (turn.content, turn.calls, turn.errors) == (text, [], [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_huge_argument(fmt: str) -> None:
    big = "é" * 1_000_000
    text = with_prose(fmt, "x" * 100_000, [("write_file", {"content": big})])
    turn = get_parser(fmt).parse(text)
    assert names_and_args(turn.calls) == [("write_file", {"content": big})]


def test_pythonic_reads_python_literals_and_never_evaluates() -> None:
    parser = get_parser("pythonic")
    text = "[f(a='it\\'s', b=\"x\\ny\", c=-1.5, d=(1, 2), e={'k': [True, None]}, g=true, h=null), g()]"
    turn = parser.parse(text)
    assert turn.errors == []
    assert names_and_args(turn.calls) == [
        ("f", {"a": "it's", "b": "x\ny", "c": -1.5, "d": [1, 2], "e": {"k": [True, None]}, "g": True, "h": None}),
        ("g", {}),
    ]
    # code is never run: a value that is not a literal is an error naming the argument, the other calls run
    hostile = "[f(a=__import__('os').system('touch /tmp/pwned')), g(b=1), h(c=[x for x in y]), k(d=1+1)]"
    turn = parser.parse(hostile)
    assert names_and_args(turn.calls) == [("g", {"b": 1})]
    assert [e.kind for e in turn.errors] == ["bad_arguments_type"] * 3
    assert "'a' of 'f' must be a literal" in turn.errors[0].message
    # Llama 4 wraps the list in <|python_start|>...<|python_end|>; a dotted name is the tool's name as written
    turn = parser.parse('Sure. <|python_start|>[brave_search.call(query="x")]<|python_end|> done')
    assert names_and_args(turn.calls) == [("brave_search.call", {"query": "x"})]
    assert turn.content == "Sure.  done"


def test_pythonic_lists_start_a_line_and_must_be_calls() -> None:
    parser = get_parser("pythonic")
    assert parser.parse("The list [f(a=1)] in a sentence is prose.").calls == []
    turn = parser.parse("I will call it.\n  [f(a=1)]\nThen answer.")
    assert names_and_args(turn.calls) == [("f", {"a": 1})]
    assert turn.content == "I will call it.\n\nThen answer."


def test_deepseek_look_alike_ascii_markers_are_prose_and_the_type_must_be_function() -> None:
    ascii_markers = render("deepseek_v31", [("f", {})]).replace(BAR, "|")
    assert get_parser("deepseek_v31").parse(ascii_markers).calls == []
    typed = render("deepseek_v3", [("f", {})]).replace("function" + ds("tool sep"), "retrieval" + ds("tool sep"))
    [error] = get_parser("deepseek_v3").parse(typed).errors
    assert error.kind == "bad_markup" and "'retrieval'" in error.message
    # a section without its end marker (the engine stopped right after the last call) still holds its calls
    cut = render("deepseek_v31", [("f", {"a": 1})]).removesuffix(ds("tool calls end"))
    assert names_and_args(get_parser("deepseek_v31").parse(cut).calls) == [("f", {"a": 1})]


def test_kimi_keeps_the_models_ids() -> None:
    text = render("kimi_k2", [("f", {"a": 1}), ("g", {})]).replace("functions.g:1", "g:7")
    turn = get_parser("kimi_k2").parse(text, calls_before=5)
    assert [(c.id, c.name) for c in turn.calls] == [("functions.f:0", "f"), ("g:7", "g")]
    assert get_parser("kimi_k2").ids_in_text  # type: ignore[attr-defined]


def test_harmony_channels_reasoning_preambles_and_answers() -> None:
    text = (
        "<|channel|>analysis<|message|>Need weather. Maybe call to=functions.draft?<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    )
    turn = get_parser("gpt_oss").parse(text)
    assert names_and_args(turn.calls) == [("get_weather", {"city": "Paris"})]  # `to=` in the header, before channel
    assert turn.content == "Checking."
    reasoning, rest = get_reasoning_parser("harmony").split(text)
    assert reasoning == "Need weather. Maybe call to=functions.draft?"
    assert names_and_args(get_parser("gpt_oss").parse(rest).calls) == names_and_args(turn.calls)
    # the answer: the final channel; the engine may cut the stop token <|return|> / <|call|>
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert get_reasoning_parser("harmony").split(answer) == (
        "Easy.",
        "<|start|>assistant<|channel|>final<|message|>It is 4.",
    )
    assert get_parser("gpt_oss").parse(answer).content == "It is 4."
    cut = render("gpt_oss", [("f", {"a": "<|call|>"})]).removesuffix("<|call|>")
    assert names_and_args(get_parser("gpt_oss").parse(cut).calls) == [("f", {"a": "<|call|>"})]
    # a built-in tool keeps its recipient as its name; an empty body is no arguments
    builtin = "<|channel|>analysis to=python code<|message|><|call|>"
    assert names_and_args(get_parser("gpt_oss").parse(builtin).calls) == [("python", {})]
    assert get_reasoning_parser("harmony").split("no harmony here") == (None, "no harmony here")


def test_glm_values_are_typed_as_the_template_writes_them() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"properties": {"n": {"type": "integer"}, "s": {"type": "string"}}},
            },
        }
    ]
    text = render("glm45", [("f", {"n": 3, "s": "42", "free": [1, "x"], "word": "hello"})])
    [call] = get_parser("glm45", tools=tools).parse(text).calls
    assert call.arguments == {"n": 3, "s": "42", "free": [1, "x"], "word": "hello"}
    # GLM-4.7 writes no newlines; the value is the raw text, markup included
    compact = "<tool_call>f<arg_key>s</arg_key><arg_value> a <b>c</b> </tool_call> </arg_value></tool_call>"
    [call] = get_parser("glm45", tools=tools).parse(compact).calls
    assert call.arguments == {"s": " a <b>c</b> </tool_call> "}


# -- malformed ------------------------------------------------------------------------------------

MALFORMED: list[tuple[str, str, str, str]] = [
    # (format, text, kind, a word the message must hold)
    ("pythonic", "[f(a=1), g(b=2]", "bad_json", "unmatched"),
    ("pythonic", "[f(a=1)", "bad_json", "never closed"),
    ("pythonic", "[f(a='unterminated)]", "bad_json", "never closed"),
    ("pythonic", "[f(a=1 b=2)]", "bad_json", "not valid Python"),
    ("pythonic", "[f(1, 2)]", "bad_arguments_type", "positional"),
    ("pythonic", "[f(**kw)]", "bad_arguments_type", "**"),
    ("pythonic", "[f(a=1, a=2)]", "bad_arguments_type", "twice"),
    ("pythonic", "[f(a=x)]", "bad_arguments_type", "literal"),
    ("pythonic", "[f(a=1e999)]", "bad_arguments_type", "finite"),
    ("pythonic", "[f(a={1: 2})]", "bad_arguments_type", "key"),
    ("pythonic", "[f.g().h(a=1)]", "missing_name", "name"),
    ("pythonic", "[f(a=" + "[" * 500 + "]" * 500 + ")]", "bad_json", "not valid Python"),
    ("pythonic", "<|python_start|>f(a=1)", "bad_markup", "list"),
    ("deepseek_v3", ds("tool calls begin") + ds("tool call begin") + "function" + ds("tool sep") + 'f\n{"a": 1}' + ds("tool call end"), "bad_markup", "```json"),
    ("deepseek_v3", ds("tool calls begin") + ds("tool call begin") + "function" + ds("tool sep") + 'f\n```json\n{"a": 1}' + ds("tool call end"), "bad_json", "Extra data"),
    ("deepseek_v31", ds("tool calls begin") + ds("tool call begin") + "f" + ds("tool sep") + '{"a": }' + ds("tool call end"), "bad_json", "Expecting value"),
    ("deepseek_v31", ds("tool calls begin") + ds("tool call begin") + "f" + ds("tool sep") + '{"a": 1}}' + ds("tool call end"), "bad_json", "Extra data"),
    ("deepseek_v31", ds("tool calls begin") + ds("tool call begin") + "f" + ds("tool sep") + "[1]" + ds("tool call end"), "bad_arguments_type", "object"),
    ("deepseek_v31", ds("tool calls begin") + ds("tool call begin") + "two words" + ds("tool sep") + "{}" + ds("tool call end"), "missing_name", "tool name"),
    ("deepseek_v31", ds("tool calls begin") + ds("tool call begin") + "f" + ds("tool sep") + '{"a": 1', "unclosed_tag", "has no"),
    ("deepseek_v31", ds("tool calls begin") + "oops", "bad_markup", "not a call"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}<|tool_call_end|>", "missing_name", "call index"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>", "missing_name", "<|tool_call_argument_begin|>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": NaN}<|tool_call_end|>", "bad_json", "finite"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}", "unclosed_tag", "<|tool_call_end|>"),
    ("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1,}<|call|>", "bad_json", "Expecting"),
    ("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1} and more<|call|>", "bad_json", "Extra data"),
    ("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>\"x\"<|call|>", "bad_arguments_type", "object"),
    ("gpt_oss", "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>", "missing_name", "names no tool"),
    ("glm45", "<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "missing_name", "tool name"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", "bad_markup", "<arg_value>"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1\n<arg_key>b</arg_key><arg_value>2</arg_value></tool_call>", "bad_markup", "<arg_key>"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>oops</tool_call>", "bad_markup", "expected"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>", "bad_arguments_type", "twice"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1", "unclosed_tag", "</arg_value>"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>", "unclosed_tag", "</tool_call>"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "kind", "needle"), MALFORMED)
def test_malformed_calls_become_precise_errors(fmt: str, text: str, kind: str, needle: str) -> None:
    check_malformed(get_parser(fmt, tools=STRING_TOOLS), text, render(fmt, [("ok", {"v": "1"})]), kind, needle)


@pytest.mark.parametrize("fmt", ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm45"])
def test_a_bad_call_never_costs_the_next_one(fmt: str) -> None:
    good = render(fmt, [("g", {"b": "2"})])
    bad = {
        "deepseek_v3": lambda s: s.replace('{"b": "2"}', '{"b": '),
        "deepseek_v31": lambda s: s.replace('{"b": "2"}', '{"b": '),
        "kimi_k2": lambda s: s.replace('{"b": "2"}', '{"b": '),
        "glm45": lambda s: s.replace("</arg_value>", ""),
    }[fmt](render(fmt, [("f", {"b": "2"})]))
    turn = get_parser(fmt, tools=STRING_TOOLS).parse(bad + good)
    assert names_and_args(turn.calls) == [("g", {"b": "2"})]
    assert len(turn.errors) == 1
    check_invariants(bad + good, turn)


@pytest.mark.parametrize("inside", ["</think>", "<think>", "<think>a</think>"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_think_tags_inside_a_calls_arguments_are_the_arguments(fmt: str, inside: str) -> None:
    args = {"content": f"before {inside} after"}
    text = render(fmt, [("write_file", args)])
    parser = get_parser(fmt, tools=STRING_TOOLS)
    for reasoning in ("think", "none"):
        _, visible = split_reasoning(get_reasoning_parser(reasoning), parser, text)
        assert names_and_args(parser.parse(visible).calls) == [("write_file", args)], (reasoning, visible)


# -- properties -----------------------------------------------------------------------------------

PIECES = [
    "[", "]", "(", ")", "f(", "a=", "'", '"', '"""', "#", "\n", " ", ",", "<|python_start|>", "<|python_end|>",
    ds("tool calls begin"), ds("tool calls end"), ds("tool call begin"), ds("tool call end"), ds("tool sep"),
    "function", "```json\n", "\n```", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>", "functions.f:0", "<|start|>",
    "assistant", "<|channel|>", "analysis", "commentary", "final", " to=functions.f", "<|constrain|>json",
    "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<think>", "</think>", "{", "}", ":", "1", "NaN", "1e999", "é", "🌦", "x",
]  # fmt: skip
TEXTS = st.one_of(st.text(max_size=200), st.lists(st.sampled_from(PIECES), max_size=60).map("".join))
# a Python keyword cannot name a function or an argument in the pythonic format (`[in()]` is not Python: the
# parser refuses it, as it should); JSON's literals are left out for every format
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True).filter(
    lambda s: s not in ("true", "false", "null") and not keyword.iskeyword(s) and not keyword.issoftkeyword(s)
)
JSON_CALLS = st.lists(st.tuples(NAMES, st.dictionaries(NAMES, JSON_VALUES, max_size=4)), min_size=1, max_size=4)
GLM_TEXT = st.text(max_size=30).filter(lambda s: not any(m in s for m in ("</arg_value>", "<arg_key>", "<tool_call>")))
GLM_CALLS = st.lists(st.tuples(NAMES, st.dictionaries(NAMES, GLM_TEXT, max_size=4)), min_size=1, max_size=4)
PROSE = st.text(max_size=40).filter(lambda s: not any(p in s for p in PIECES[:20] + PIECES[21:]))


@pytest.mark.parametrize("fmt", FORMATS)
@FAST
@given(text=TEXTS)
def test_any_text_never_raises_and_every_call_is_sound(fmt: str, text: str) -> None:
    check_invariants(text, get_parser(fmt).parse(text))
    reasoning, content = HarmonyReasoningParser().split(text)
    assert reasoning is None or isinstance(reasoning, str)
    assert isinstance(content, str)


@pytest.mark.parametrize("fmt", ["pythonic", "deepseek_v3", "deepseek_v31", "kimi_k2", "gpt_oss"])
@FAST
@given(calls=JSON_CALLS, prose=PROSE)
def test_json_calls_round_trip(fmt: str, calls: list[tuple[str, dict[str, Any]]], prose: str) -> None:
    check_calls(with_prose(fmt, prose, calls), calls, get_parser(fmt), model_ids=True)


@FAST
@given(calls=GLM_CALLS, prose=PROSE)
def test_glm_calls_round_trip(calls: list[tuple[str, dict[str, str]]], prose: str) -> None:
    # one definition per tool name (a request's tools have unique names), declaring every argument it is
    # called with as a string: the values stay the strings written
    props: dict[str, dict[str, Any]] = {}
    for n, a in calls:
        props.setdefault(n, {}).update({k: {"type": "string"} for k in a})
    tools = [{"type": "function", "function": {"name": n, "parameters": {"properties": p}}} for n, p in props.items()]
    text = with_prose("glm45", prose, calls)
    turn = get_parser("glm45", tools=tools).parse(text)
    assert turn.errors == []
    assert names_and_args(turn.calls) == calls
    check_invariants(text, turn)


# -- linear time: counted work, not wall-clock ----------------------------------------------------

ADVERSARIAL = {
    # each: a unit repeated n times (plus a tail): the shapes that make naive parsers rescan
    "list starts never closed": ("\n[f(a=", ""),
    "brackets never closed": ("[", ""),
    "strings never closed": ("\n[f(a='", ""),
    "triple quotes never closed": ('\n[f(a="""', ""),
    "python tags": ("<|python_start|>", ""),
    "many small lists": ("\n[f(a=1)]", ""),
    "sections never closed": (ds("tool calls begin") + ds("tool call begin") + "f" + ds("tool sep") + "{", ""),
    "calls without sep": (ds("tool call begin") + "f", ds("tool sep")),
    "kimi calls never closed": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": \"", ""),
    "kimi heads": ("<|tool_call_begin|>functions.f:0", "<|tool_call_end|>"),
    "messages without end": ("<|channel|>commentary to=functions.f<|message|>{\"a\": \"", ""),
    "headers without message": ("<|start|>assistant<|channel|>analysis", "<|message|>"),
    "glm blocks never closed": ("<tool_call>f\n<arg_key>a</arg_key><arg_value>", ""),
    "glm keys never closed": ("<tool_call>f<arg_key>", "</arg_key>"),
    "deep nesting": ("{\"a\": [", ""),
}  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", sorted(ADVERSARIAL))
def test_parsing_is_linear_on_adversarial_input(fmt: str, shape: str) -> None:
    unit, tail = ADVERSARIAL[shape]
    check_linear(get_parser(fmt), unit, tail, 500)


# -- the rendering side: DeepSeek's templates write arguments as they are ---------------------------

# the shape of DeepSeek V3's chat template (string concatenation of the arguments), cut to what matters
DEEPSEEK_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<A>{{ m['content'] }}"
    + ds("tool calls begin")
    + "{% for tool in m['tool_calls'] %}{{ '"
    + ds("tool call begin")
    + "' + tool['type'] + '"
    + ds("tool sep")
    + "' + tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + '\\n```"
    + ds("tool call end")
    + "' }}{% endfor %}"
    + ds("tool calls end")
    + "{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<A>{% endif %}"
)


@pytest.fixture
def tok(tiny_model: Any) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def test_a_template_that_writes_arguments_as_they_are_gets_json_text(tok: Any) -> None:
    import copy

    from rollout_sdk.agents import ChatTemplate

    assert not ChatTemplate(tok).arguments_as_text  # Qwen's template: tojson, objects
    deepseek = copy.deepcopy(tok)
    deepseek.chat_template = DEEPSEEK_LIKE
    template = ChatTemplate(deepseek)
    assert template.arguments_as_text
    model_text = render("deepseek_v3", [("get_weather", {"city": "Paris", "days": 3})])
    [call] = get_parser("deepseek_v3").parse(model_text).calls
    for arguments in (call.arguments, json.dumps(call.arguments)):  # the agent loop's objects, a client's text
        message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": call.name, "arguments": arguments}}
            ],
        }
        text = template.render([{"role": "user", "content": "weather?"}, message], add_generation_prompt=False)
        assert model_text in text  # the replayed conversation holds what the model wrote, byte for byte
