"""Every tool-call format and the reasoning parser, tested from the outside: well-formed calls of each
format round-trip, malformed and adversarial text becomes precise errors (never an exception, never a
silently dropped call), and parsing stays linear in the size of the text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rollout_sdk.agents as agents
from rollout_sdk.agents import parsers
from rollout_sdk.agents.parsers import (
    PARSE_ERROR_KINDS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParseError,
    Qwen3CoderParser,
    ReasoningParser,
    ThinkReasoningParser,
    ToolCall,
    ToolCallParser,
    format_tool_error,
    get_parser,
    get_reasoning_parser,
    parser_names,
    reasoning_parser_names,
    register_reasoning_parser,
    split_reasoning,
)
from rollout_sdk.errors import ConfigError

FORMATS = ["hermes", "qwen3_coder", "llama3_json", "mistral"]

# -- how each format writes a call (written from the formats' documentation, not from our parser) ---


def hermes(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def qwen3_coder(name: str, args: dict[str, Any]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def llama(name: str, args: dict[str, Any]) -> str:
    return "<|python_tag|>" + json.dumps({"name": name, "parameters": args}, ensure_ascii=False)


def mistral(calls: list[tuple[str, dict[str, Any]]], ids: bool = False) -> str:
    items = [{"name": n, "arguments": a, **({"id": f"abc{i:06d}"} if ids else {})} for i, (n, a) in enumerate(calls)]
    return "[TOOL_CALLS] " + json.dumps(items, ensure_ascii=False)


def render(fmt: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    if fmt == "hermes":
        return "\n".join(hermes(n, a) for n, a in calls)
    if fmt == "qwen3_coder":
        return "\n".join(qwen3_coder(n, a) for n, a in calls)
    if fmt == "llama3_json":
        return "; ".join(
            llama(n, a) if i == 0 else llama(n, a).removeprefix("<|python_tag|>") for i, (n, a) in enumerate(calls)
        )
    return mistral(calls)


def names_and_args(calls: list[ToolCall]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in calls]


OPENERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "{")


def check_invariants(text: str, turn: Any, parser: ToolCallParser | None = None, *, model_ids: bool = False) -> None:
    """What every parse of every text must satisfy; with ``parser``, a call parsed again from its own
    text (when that text is a whole call of the format) is the same call; ``model_ids``: ids the model
    wrote itself (``functions.NAME:N``, Kimi-K2) may repeat."""
    assert isinstance(turn.content, str)
    assert len(turn.order) == len(turn.calls) + len(turn.errors)
    small = len(text) < 100_000  # (a substring search per item would make this check quadratic)
    for error in turn.errors:
        assert isinstance(error, ParseError)
        assert error.kind in PARSE_ERROR_KINDS and error.message
        assert not small or error.raw in text
    for call in turn.calls:
        assert isinstance(call.name, str) and call.name.strip()
        assert isinstance(call.arguments, dict)
        assert json.loads(json.dumps(call.arguments, allow_nan=False)) == call.arguments  # finite, JSON
        assert call.raw and (not small or call.raw in text)
        if parser is not None and call.raw.startswith(OPENERS):
            assert (call.name, call.arguments) in names_and_args(parser.parse(call.raw).calls), call.raw
    assert len({c.id for c in turn.calls}) == len(turn.calls) or (
        model_ids and any(c.id.startswith("functions.") for c in turn.calls)
    )


def check_calls(text: str, calls: list[tuple[str, dict[str, Any]]], by: ToolCallParser, /, **invariants: Any) -> Any:
    """``text`` parsed ``by`` a parser is exactly ``calls``, no error, and every invariant holds; the turn."""
    turn = by.parse(text)
    assert turn.errors == []
    assert names_and_args(turn.calls) == calls
    check_invariants(text, turn, **invariants)
    return turn


def check_malformed(parser: ToolCallParser, bad: str, good: str | None, kind: str, needle: str) -> None:
    """``bad`` is one error of ``kind`` whose message holds ``needle``, no call; after ``good`` (a call
    ``ok(v="1")``) it costs that call nothing; the error's feedback names the format."""
    for full in (bad,) if good is None else (bad, f"{good}\n{bad}"):
        turn = parser.parse(full)
        assert [e.kind for e in turn.errors] == [kind], (full, turn.errors)
        assert needle in turn.errors[0].message, turn.errors[0].message
        assert names_and_args(turn.calls) == ([] if full == bad else [("ok", {"v": "1"})])
        check_invariants(full, turn)
    assert format_tool_error(turn.errors[0], parser.call_format).endswith(parser.call_format)  # type: ignore[attr-defined]


def check_linear(parser: ToolCallParser, unit: str, tail: str, repeats: int) -> None:
    """Parsing ``unit`` repeated then ``tail`` costs work linear in the text (counted, not timed)."""
    small, large = unit * repeats + tail, unit * 16 * repeats + tail
    work_small, work_large = parsers._scan_work(parser, small), parsers._scan_work(parser, large)
    assert work_large <= 40 * len(large)  # a bounded number of passes over the text
    assert work_large / max(work_small, 1) <= 2 * len(large) / len(small)  # 16x the text, not 256x the work
    check_invariants(large, parser.parse(large))


# -- the registry ---------------------------------------------------------------------------------


def test_every_format_is_registered_and_exported() -> None:
    assert set(FORMATS) <= set(parser_names())
    for fmt in FORMATS:
        parser = get_parser(fmt)
        assert isinstance(parser, ToolCallParser)
        assert get_parser(fmt.upper()).__class__ is parser.__class__
        assert parser.call_format  # what the model is shown after an error
    for name in ("Qwen3CoderParser", "Llama3JsonParser", "MistralParser", "ReasoningParser", "get_reasoning_parser"):
        assert getattr(agents, name) is getattr(parsers, name)


def test_a_factory_gets_the_tool_schemas_only_when_it_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parsers, "_PARSERS", dict(parsers._PARSERS))
    parsers.register_parser("plain", HermesParser)
    parsers.register_parser("no_kwargs", lambda: HermesParser())
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    assert isinstance(get_parser("no_kwargs", tools=tools), HermesParser)
    coder = get_parser("qwen3_coder", tools=tools)
    assert coder.parse(qwen3_coder("f", {"n": 7})).calls[0].arguments == {"n": 7}


# -- well-formed, per format ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_in_text_order_with_prose_before(fmt: str) -> None:
    calls = [("get_weather", {"city": "Paris"}), ("search", {"q": "北京 天气 🌦"})]
    text = "Let me look that up. " + render(fmt, calls)
    turn = check_calls(text, calls, get_parser(fmt))
    assert turn.content == "Let me look that up."
    assert get_parser(fmt).parse(text) == turn  # deterministic, ids included


@pytest.mark.parametrize("fmt", FORMATS)
def test_plain_text_is_content(fmt: str) -> None:
    turn = get_parser(fmt).parse("The answer is 4.")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is 4.", [], [])


def test_qwen3_coder_values_keep_their_text_and_xml_like_content() -> None:
    code = 'if a < b:\n    print("<b>bold</b> </tool_call> <function=x>")\n'
    text = qwen3_coder("write_file", {"path": "a.py", "content": code})
    [call] = Qwen3CoderParser().parse(text).calls
    assert call.arguments == {"path": "a.py", "content": code}
    assert call.raw == text


def test_qwen3_coder_types_values_from_the_schema() -> None:
    props = {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array"},
        "opt": {"type": ["string", "null"]},
        "s": {"type": "string"},
        "bad": {"type": "integer"},
        "whole": {"type": "integer"},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]
    args = {"n": "42", "x": "2.5", "ok": "True", "tags": '["a", 1]', "opt": "null", "s": "007", "bad": "4x"}
    [call] = Qwen3CoderParser(tools=tools).parse(qwen3_coder("f", {**args, "whole": " 3.0 "})).calls
    expected = {"n": 42, "x": 2.5, "ok": True, "tags": ["a", 1], "opt": None, "s": "007", "bad": "4x", "whole": 3}
    assert call.arguments == expected
    assert type(call.arguments["whole"]) is int
    # no schema for the tool (an unknown name: the registry reports it): every value is its text
    [call] = Qwen3CoderParser(tools=tools).parse(qwen3_coder("g", {"n": "42"})).calls
    assert call.arguments == {"n": "42"}


def test_qwen3_coder_several_functions_in_one_tag_are_several_calls() -> None:
    inner = "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n<function=g>\n</function>"
    turn = Qwen3CoderParser().parse(f"<tool_call>\n{inner}\n</tool_call>")
    assert turn.errors == []
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [("call_0", "f", {"a": "1"}), ("call_1", "g", {})]


def test_llama_bare_object_semicolons_and_repeated_tags() -> None:
    parser = Llama3JsonParser()
    bare = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": 2}}'
    assert names_and_args(parser.parse(bare).calls) == [("f", {"a": 1}), ("g", {"b": 2})]
    tags = '<|python_tag|>{"name": "f", "parameters": {}}<|python_tag|>{"name": "g", "parameters": "{\\"x\\": 1}"}'
    assert names_and_args(parser.parse(tags).calls) == [("f", {}), ("g", {"x": 1})]
    # a JSON object in the middle of prose without the tag is prose
    assert parser.parse('I would send {"name": "f"} next.').calls == []


def test_mistral_ids_and_compact_forms() -> None:
    parser = MistralParser()
    with_ids = parser.parse(mistral([("f", {"a": 1}), ("g", {})], ids=True))
    assert [(c.id, c.name) for c in with_ids.calls] == [("abc000000", "f"), ("abc000001", "g")]
    without = parser.parse(mistral([("f", {"a": 1}), ("g", {})]))
    ids = [c.id for c in without.calls]
    assert len(set(ids)) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)  # what Mistral templates need
    compact = parser.parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]x9y8z7w6v[ARGS]{}')
    assert [(c.id, c.name, c.arguments) for c in compact.calls] == [(ids[0], "f", {"a": 1}), ("x9y8z7w6v", "g", {})]
    assert compact.errors == []


# -- the rule of issue 29: anything after a call's value makes that call an error, nothing runs -----

EXTRA_AFTER_VALUE = {
    "hermes": '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "x"}}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "write_file", "parameters": {"path": "a", "content": "x"}}}',
    "mistral": '[TOOL_CALLS] [{"name": "write_file", "arguments": {"path": "a", "content": "x"}}]]',
    "mistral_compact": '[TOOL_CALLS]write_file[ARGS]{"path": "a", "content": "x"}}',
}


@pytest.mark.parametrize("case", sorted(EXTRA_AFTER_VALUE))
@pytest.mark.parametrize("extra", ["", " and then some words"])
def test_text_after_the_json_value_is_an_error_and_runs_nothing(case: str, extra: str) -> None:
    text = EXTRA_AFTER_VALUE[case] + extra
    if case == "hermes" and extra:  # the words go inside the block
        text = EXTRA_AFTER_VALUE[case].replace("}}}", "}} " + extra)
    turn = get_parser(case.removesuffix("_compact")).parse(text)
    assert turn.calls == []
    [error] = turn.errors
    assert error.kind == "bad_json" and "Extra data" in error.message
    check_invariants(text, turn)


def test_qwen3_coder_text_outside_the_markup_is_an_error_and_runs_nothing() -> None:
    good = qwen3_coder("write_file", {"path": "a", "content": "x"})
    for bad in (
        good.replace("</function>", "</function>}"),  # after the function
        good.replace("<parameter=content>", "oops <parameter=content>"),  # between parameters
        good.replace("</parameter>\n<parameter=content>", "<parameter=content>"),  # a missing </parameter>
    ):
        turn = Qwen3CoderParser().parse(bad + "\n" + good)
        assert names_and_args(turn.calls) == [("write_file", {"path": "a", "content": "x"})], bad  # only the good one
        [error] = turn.errors
        assert error.kind == "bad_markup" and "not run" in error.message
        assert error.raw == bad


# -- malformed, per format ------------------------------------------------------------------------

MALFORMED: list[tuple[str, str, str, str]] = [
    # (format, text, kind, a word the message must hold)
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', "bad_json", "Expecting"),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "bad_arguments_type", "object"),
    ("hermes", "<tool_call>" + "[" * 50_000 + "</tool_call>", "bad_json", "nested too deeply"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "bad_json", "finite"),
    ("qwen3_coder", "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>", "missing_name", "<function="),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>", "missing_name", "non-empty"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1", "unclosed_tag", "</parameter>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>", "unclosed_tag", "</function>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>", "unclosed_tag", "</tool_call>"),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",
        "bad_arguments_type",
        "twice",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f\n<parameter=a>1</parameter></function></tool_call>",
        "missing_name",
        "<function=",
    ),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": }}', "bad_json", "Expecting value"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": 7}', "bad_arguments_type", "parameters"),
    ("llama3_json", '{"parameters": {"a": 1}}', "missing_name", "name"),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', "bad_json", "Expecting value"),
    ("llama3_json", "<|python_tag|>", "bad_json", "empty"),
    ("llama3_json", '<|python_tag|>["f", {}]', "not_object", "object"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}', "bad_json", "Expecting"),
    ("mistral", "[TOOL_CALLS] [1]", "not_object", "object"),
    ("mistral", "[TOOL_CALLS] []", "not_object", "empty"),
    ("mistral", "[TOOL_CALLS]", "bad_json", "empty"),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', "missing_name", "name"),
    ("mistral", '[TOOL_CALLS]f[ARGS]"x"', "bad_arguments_type", "object"),
    ("mistral", '[TOOL_CALLS]two words[ARGS]{"a": 1}', "missing_name", "word"),
    ("mistral", "[TOOL_CALLS]get_weather Paris", "bad_json", "[ARGS]"),
]


@pytest.mark.parametrize(("fmt", "text", "kind", "needle"), MALFORMED)
def test_malformed_calls_become_precise_errors(fmt: str, text: str, kind: str, needle: str) -> None:
    good = render(fmt, [("ok", {"v": "1"})]) if fmt != "llama3_json" else None  # (llama: a whole-text format)
    check_malformed(get_parser(fmt), text, good, kind, needle)


def test_qwen3_coder_unclosed_and_stray_tags_never_swallow_the_next_call() -> None:
    good = qwen3_coder("g", {"b": "2"})
    text = "</tool_call> <tool_call>\n<function=f>\n<parameter=a>\n1\n" + good + " </tool_call>"
    turn = Qwen3CoderParser().parse(text)
    assert names_and_args(turn.calls) == [("g", {"b": "2"})]
    assert [e.kind for e in turn.errors] == ["stray_close_tag", "unclosed_tag", "stray_close_tag"]
    assert [type(x).__name__ for x in turn.in_text_order()] == ["ParseError", "ParseError", "ToolCall", "ParseError"]


def test_nested_tool_call_tags() -> None:
    text = '<tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call></tool_call>'
    turn = HermesParser().parse(text)
    assert names_and_args(turn.calls) == [("f", {})]
    assert [e.kind for e in turn.errors] == ["unclosed_tag", "stray_close_tag"]
    coder = Qwen3CoderParser().parse("<tool_call>" + qwen3_coder("f", {}) + "</tool_call>")
    assert names_and_args(coder.calls) == [("f", {})]
    assert [e.kind for e in coder.errors] == ["missing_name", "stray_close_tag"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_huge_argument_and_a_huge_prose(fmt: str) -> None:
    big = "é" * 1_000_000
    text = (
        "x" * 500_000 + " " + render(fmt, [("write_file", {"content": big})])
        if fmt != "llama3_json"
        else render(fmt, [("write_file", {"content": big})])
    )
    turn = get_parser(fmt).parse(text)
    assert names_and_args(turn.calls) == [("write_file", {"content": big})]


# -- properties -----------------------------------------------------------------------------------

PIECES = [
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<think>",
    "</think>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", '"name"', '"arguments"',
    '"parameters"', '"f"', "NaN", "1e999", ">", "<", "\n", " ", ";", ",", ":", "{", "}", "[", "]", '"', "\\",
    "é", "🌦", "x",
]  # fmt: skip
TEXTS = st.one_of(st.text(max_size=200), st.lists(st.sampled_from(PIECES), max_size=60).map("".join))

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
JSON_CALLS = st.lists(
    st.tuples(NAMES, st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)), min_size=1, max_size=4
)
# Qwen3-Coder values are text; a value cannot hold the markup that ends it
XML_TEXT = st.text(max_size=30).filter(
    lambda s: not any(m in s for m in ("</parameter>", "<parameter=", "</function>", "<tool_call>"))
)
XML_CALLS = st.lists(st.tuples(NAMES, st.dictionaries(NAMES, XML_TEXT, max_size=4)), min_size=1, max_size=4)
PROSE = st.text(max_size=40).filter(lambda s: not any(p in s for p in [*PIECES[:12], "{"]))
FAST = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


@pytest.mark.parametrize("fmt", FORMATS)
@FAST
@given(text=TEXTS)
def test_any_text_never_raises_and_every_call_is_sound(fmt: str, text: str) -> None:
    parser = get_parser(fmt)
    check_invariants(text, parser.parse(text), parser)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@FAST
@given(calls=JSON_CALLS, prose=PROSE)
def test_json_calls_round_trip(fmt: str, calls: list[tuple[str, dict[str, Any]]], prose: str) -> None:
    text = render(fmt, calls) if fmt == "llama3_json" else prose + render(fmt, calls)
    parser = get_parser(fmt)
    check_calls(text, calls, parser, parser=parser)


@FAST
@given(calls=XML_CALLS, prose=PROSE)
def test_xml_calls_round_trip(calls: list[tuple[str, dict[str, str]]], prose: str) -> None:
    text = prose + render("qwen3_coder", calls) + prose
    turn = Qwen3CoderParser().parse(text)
    assert turn.errors == []
    assert names_and_args(turn.calls) == calls
    check_invariants(text, turn, Qwen3CoderParser())


# -- linear time: counted work, not wall-clock ----------------------------------------------------

ADVERSARIAL = {
    # each: a unit repeated n times (plus a tail): the shapes that make naive parsers rescan
    "opens then one close": ('<tool_call>"x"', "</tool_call>"),
    "unclosed opens": ("<tool_call>{", ""),
    "stray closes": ("</tool_call>", ""),
    "think never closed": ("<think><tool_call>", ""),
    "function without >": ("<tool_call><function=", ">"),
    "parameter never closed": ("<tool_call><function=f><parameter=a>x", "</parameter>"),
    "parameter closes not followed by markup": ("</parameter>x", ""),
    "python tags": ('<|python_tag|>{"name": "', '"}'),
    "semicolons": ('{"name": "f"};', ""),
    "tool calls markers": ("[TOOL_CALLS]f", "[ARGS]{}"),
    "args markers": ("[TOOL_CALLS][ARGS]", ""),
    "deep nesting": ("[", ""),
    "long string": ('<tool_call>{"name": "', "x" * 10),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", sorted(ADVERSARIAL))
def test_parsing_is_linear_on_adversarial_input(fmt: str, shape: str) -> None:
    unit, tail = ADVERSARIAL[shape]
    check_linear(get_parser(fmt), unit, tail, 1_000)


# -- reasoning ------------------------------------------------------------------------------------

SPLITS = [
    ("<think>\nplan\n</think>\n\nanswer", ("plan", "answer")),
    ("plan</think>answer", ("plan", "answer")),  # the template put <think> in the prompt
    ("<think>cut by the length lim", ("cut by the length lim", "")),
    ("Hi. <think>plan</think> answer", ("plan", "Hi.  answer")),
    ("no reasoning here", (None, "no reasoning here")),
    ("<think></think>answer", ("", "answer")),
    ("<think>a</think>b</think>c", ("a", "b</think>c")),
    ("a</think>b<think>c", ("a", "b<think>c")),
    ("", (None, "")),
]


@pytest.mark.parametrize(("text", "expected"), SPLITS)
def test_think_splits_reasoning_from_content(text: str, expected: tuple[str | None, str]) -> None:
    assert get_reasoning_parser("think").split(text) == expected


def test_reasoning_parser_registry() -> None:
    assert {"none", "think", "think_open"} <= set(reasoning_parser_names())
    assert get_reasoning_parser("none").split("<think>x</think>y") == (None, "<think>x</think>y")
    assert get_reasoning_parser("think_open").split("still thinking") == ("still thinking", "")
    assert isinstance(get_reasoning_parser("think"), ReasoningParser)
    with pytest.raises(ConfigError, match=r"reasoning_parser='r1'.*known: harmony, none, think, think_open") as info:
        get_reasoning_parser("r1")
    assert info.value.field == "reasoning_parser" and info.value.value == "r1"


def test_register_reasoning_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parsers, "_REASONING_PARSERS", dict(parsers._REASONING_PARSERS))

    class Bracket:
        def split(self, text: str) -> tuple[str | None, str]:
            head, sep, tail = text.partition("]]")
            return (head.lstrip("["), tail) if sep else (None, text)

    register_reasoning_parser("Bracket", Bracket)
    assert get_reasoning_parser("bracket").split("[[r]]c") == ("r", "c")
    with pytest.raises(ConfigError):
        register_reasoning_parser("", Bracket)


@FAST
@given(text=TEXTS)
def test_think_never_raises(text: str) -> None:
    reasoning, content = ThinkReasoningParser().split(text)
    assert reasoning is None or isinstance(reasoning, str)
    assert isinstance(content, str)
    if reasoning is None:
        assert content == text


@FAST
@given(reasoning=st.text(max_size=40), content=st.text(max_size=40))
def test_think_round_trips(reasoning: str, content: str) -> None:
    if "<think>" in reasoning + content or "</think>" in reasoning + content:
        return
    assert ThinkReasoningParser().split(f"<think>{reasoning}</think>{content}") == (reasoning.strip(), content.strip())


# -- issue 42: think tags inside arguments, ids unique per conversation, unknown tools ---------------


@pytest.mark.parametrize("inside", ["</think>", "<think>", "<think>a</think>", "</think><think>"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_think_tags_inside_a_calls_arguments_are_the_arguments(fmt: str, inside: str) -> None:
    args = {"content": f"before {inside} after"}
    text = render(fmt, [("write_file", args)])
    parser = get_parser(fmt)
    for reasoning in ("think", "none"):
        _, visible = split_reasoning(get_reasoning_parser(reasoning), parser, text)
        assert names_and_args(parser.parse(visible).calls) == [("write_file", args)], (reasoning, visible)
    # a block the model opens before its call is still reasoning, and a call drafted in it never runs
    thought = "<think>I could " + render(fmt, [("draft", {})]) + "</think>\n"
    reasoning_text, visible = split_reasoning(get_reasoning_parser("think"), parser, thought + text)
    assert reasoning_text is not None and "draft" in reasoning_text
    assert names_and_args(parser.parse(visible).calls) == [("write_file", args)]
    # a prompt-opened block (bare </think> before the call) too
    reasoning_text, visible = split_reasoning(get_reasoning_parser("think"), parser, "plan</think>" + text)
    assert reasoning_text == "plan" and names_and_args(parser.parse(visible).calls) == [("write_file", args)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ids_count_on_from_the_calls_of_earlier_turns(fmt: str) -> None:
    text = render(fmt, [("f", {}), ("g", {})])
    first, second = get_parser(fmt).parse(text), get_parser(fmt).parse(text, calls_before=2)
    ids = [c.id for c in first.calls + second.calls]
    assert len(set(ids)) == 4  # unique in the conversation, the same on a replay
    assert get_parser(fmt).parse(text, calls_before=2) == second
    if fmt == "mistral":
        assert ids == ["call00000", "call00001", "call00002", "call00003"]
        assert all(len(i) == 9 and i.isalnum() for i in ids)  # what Mistral's templates require


def test_a_call_to_a_tool_not_offered_is_parsed_with_untyped_values() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    turn = get_parser("qwen3_coder", tools=tools).parse(qwen3_coder("f", {"n": 1}) + qwen3_coder("g", {"n": 1}))
    assert names_and_args(turn.calls) == [("f", {"n": 1}), ("g", {"n": "1"})]
