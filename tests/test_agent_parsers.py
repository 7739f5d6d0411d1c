"""Tool-call parsing: malformed policy output becomes precise errors, never a crash, never a lost valid call."""

from __future__ import annotations

import json
import random

import pytest

from rollout_sdk.agents import parsers
from rollout_sdk.agents.parsers import (
    PARSE_ERROR_KINDS,
    HermesParser,
    ParsedTurn,
    ParseError,
    ToolCall,
    ToolCallParser,
    format_tool_error,
    get_parser,
    parser_names,
    register_parser,
)
from rollout_sdk.errors import ConfigError


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def call_json(name: str = "f", **arguments: object) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


@pytest.fixture
def parser() -> HermesParser:
    return HermesParser()


# -- well-formed ----------------------------------------------------------------------------------


def test_single_call_with_surrounding_text(parser: HermesParser) -> None:
    raw = block('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}')
    turn = parser.parse(f"Let me check.\n{raw}\n")
    assert turn.content == "Let me check."
    assert turn.errors == []
    assert turn.calls == [ToolCall(name="get_weather", arguments={"city": "Paris", "days": 3}, id="call_0", raw=raw)]
    assert turn.has_tool_activity


def test_multiple_calls_get_deterministic_ids_in_text_order(parser: HermesParser) -> None:
    text = f"a {block(call_json('f', x=1))} b {block(call_json('g'))} c {block(call_json('h', y=[1, 2]))}"
    turn = parser.parse(text)
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [
        ("call_0", "f", {"x": 1}),
        ("call_1", "g", {}),
        ("call_2", "h", {"y": [1, 2]}),
    ]
    assert turn.content == "a  b  c"
    assert parser.parse(text) == turn  # same text, same ids


def test_plain_text_has_no_calls(parser: HermesParser) -> None:
    turn = parser.parse("  The answer is 4.\n\n")
    assert turn == ParsedTurn(content="The answer is 4.", calls=[], errors=[])
    assert not turn.has_tool_activity
    assert parser.parse("") == ParsedTurn(content="")


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>   {"name": "f", "arguments": {"x": 1}}   </tool_call>',
        '<tool_call>\n\n\t{"name": "f",\n  "arguments": {\n    "x": 1\n  }\n}\n\n</tool_call>',
        '<tool_call>\r\n{"name": "f", "arguments": {"x": 1}}\r\n</tool_call>\r\n',
        '\n\n<tool_call>\n{ "name" : "f" , "arguments" : { "x" : 1 } }\n</tool_call>',
    ],
)
def test_whitespace_variations(parser: HermesParser, text: str) -> None:
    turn = parser.parse(text)
    assert turn.errors == []
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {"x": 1})]
    assert turn.content == ""


def test_unicode_in_arguments_and_content(parser: HermesParser) -> None:
    text = f"Je cherche « café » ☕ {block(call_json('search', q='北京 天气 🌦', lang='zh'))}"
    turn = parser.parse(text)
    assert turn.content == "Je cherche « café » ☕"
    assert turn.calls[0].arguments == {"q": "北京 天气 🌦", "lang": "zh"}
    escaped = parser.parse(block('{"name": "search", "arguments": {"q": "caf\\u00e9"}}'))
    assert escaped.calls[0].arguments == {"q": "café"}


def test_arguments_as_json_string_are_accepted(parser: HermesParser) -> None:
    body = json.dumps({"name": "f", "arguments": json.dumps({"x": 1, "s": 'a"b'})})
    turn = parser.parse(block(body))
    assert turn.errors == []
    assert turn.calls[0].arguments == {"x": 1, "s": 'a"b'}


def test_missing_arguments_mean_no_arguments(parser: HermesParser) -> None:
    turn = parser.parse(block('{"name": "now"}'))
    assert turn.calls == [ToolCall(name="now", arguments={}, id="call_0", raw=block('{"name": "now"}'))]


def test_extra_keys_in_the_call_object_are_ignored(parser: HermesParser) -> None:
    turn = parser.parse(block('{"name": "f", "arguments": {}, "id": "abc", "type": "function"}'))
    assert [(c.name, c.id) for c in turn.calls] == [("f", "call_0")]


def test_several_objects_in_one_tag_are_separate_calls(parser: HermesParser) -> None:
    first, second = call_json("f", x=1), call_json("g", y=2)
    turn = parser.parse(block(f"{first}\n{second}"))
    assert turn.errors == []
    assert [(c.id, c.name, c.arguments, c.raw) for c in turn.calls] == [
        ("call_0", "f", {"x": 1}, first),
        ("call_1", "g", {"y": 2}, second),
    ]


# -- malformed ------------------------------------------------------------------------------------


def test_bad_json_names_the_error_and_position_and_keeps_other_calls(parser: HermesParser) -> None:
    bad = block('{"name": "f", "arguments": {"x": 1}')
    turn = parser.parse(f"{block(call_json('ok'))} {bad} {block(call_json('ok2'))}")
    assert [c.name for c in turn.calls] == ["ok", "ok2"]
    assert [c.id for c in turn.calls] == ["call_0", "call_1"]
    assert turn.errors == [
        ParseError(
            kind="bad_json",
            message="invalid JSON in tool call: Expecting ',' delimiter: line 1 column 36 (char 35)",
            raw=bad,
        )
    ]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "{'name': 'f', 'arguments': {}}",
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        ('{"name": "f",\n "arguments": {"x": }}', "Expecting value: line 2 column 21 (char 34)"),
        ("get_weather(city='Paris')", "Expecting value: line 1 column 1 (char 0)"),
    ],
)
def test_bad_json_messages(parser: HermesParser, body: str, expected: str) -> None:
    turn = parser.parse(block(body))
    assert turn.calls == []
    assert [(e.kind, e.message) for e in turn.errors] == [("bad_json", f"invalid JSON in tool call: {expected}")]


def test_empty_tag_is_bad_json(parser: HermesParser) -> None:
    turn = parser.parse("<tool_call>  \n </tool_call>")
    assert [e.kind for e in turn.errors] == ["bad_json"]
    assert turn.errors[0].message.startswith("empty tool call: expected a JSON object")


@pytest.mark.parametrize(
    ("trailing", "where"),
    [(" trailing words", "line 1 column 38 (char 37)"), ("}", "line 1 column 37 (char 36)")],
)
def test_anything_after_the_object_makes_the_block_an_error_and_runs_nothing(
    parser: HermesParser, trailing: str, where: str
) -> None:
    raw = block(call_json("f", x=1) + trailing)
    turn = parser.parse(raw)
    assert turn.calls == []  # the extra text may mean the value was cut short: never run it
    assert [(e.kind, e.message, e.raw) for e in turn.errors] == [
        ("bad_json", f"invalid JSON in tool call: Extra data: {where}", raw)
    ]


@pytest.mark.parametrize(
    ("body", "got"),
    [
        ('[{"name": "f", "arguments": {}}]', 'an array [{"name": "f", "arguments": {}}]'),
        ('"f"', 'a string "f"'),
        ("42", "a number 42"),
        ("null", "null null"),
    ],
)
def test_not_an_object(parser: HermesParser, body: str, got: str) -> None:
    turn = parser.parse(block(body))
    assert turn.calls == []
    [error] = turn.errors
    assert error.kind == "not_object"
    assert error.message.startswith("a tool call must be a JSON object")
    assert error.message.endswith(f"got {got}")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"arguments": {"x": 1}}', 'tool call has no "name" field: {"arguments": {"x": 1}}'),
        ('{"name": 3, "arguments": {}}', 'tool call "name" must be a non-empty string, got 3'),
        ('{"name": null}', 'tool call "name" must be a non-empty string, got null'),
        ('{"name": "  "}', 'tool call "name" must be a non-empty string, got "  "'),
        ('{"function": "f"}', 'tool call has no "name" field: {"function": "f"}'),
    ],
)
def test_missing_name(parser: HermesParser, body: str, message: str) -> None:
    turn = parser.parse(block(body))
    assert turn.calls == []
    assert [(e.kind, e.message, e.raw) for e in turn.errors] == [("missing_name", message, block(body))]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("[1, 2]", "\"arguments\" of tool call 'f' must be a JSON object, got an array [1, 2]"),
        ("7", "\"arguments\" of tool call 'f' must be a JSON object, got a number 7"),
        ("null", "\"arguments\" of tool call 'f' must be a JSON object, got null null"),
        ("true", "\"arguments\" of tool call 'f' must be a JSON object, got a boolean true"),
        ('"[1]"', '"arguments" of tool call \'f\' must be a JSON object, got a string holding an array: "[1]"'),
        (
            '"x=1"',
            "\"arguments\" of tool call 'f' must be a JSON object, got a string that is not valid JSON "
            '(Expecting value: line 1 column 1 (char 0)): "x=1"',
        ),
    ],
)
def test_bad_arguments_type(parser: HermesParser, arguments: str, message: str) -> None:
    turn = parser.parse(block(f'{{"name": "f", "arguments": {arguments}}}'))
    assert turn.calls == []
    assert [(e.kind, e.message) for e in turn.errors] == [("bad_arguments_type", message)]


def test_unclosed_tag_at_the_end_is_not_parsed_as_a_call(parser: HermesParser) -> None:
    valid = block(call_json("f"))
    text = f"Thinking. {valid} then <tool_call>\n" + call_json("g", x=1)
    turn = parser.parse(text)
    assert [c.name for c in turn.calls] == ["f"]
    [error] = turn.errors
    start = text.index('<tool_call>\n{"name": "g"')
    assert error == ParseError(
        kind="unclosed_tag",
        message=f"<tool_call> at character {start} has no matching </tool_call> before the end of the text; "
        "the call was not run. Close every call with </tool_call>.",
        raw=text[start:],
    )
    assert turn.content == "Thinking.  then"


def test_unclosed_tag_followed_by_another_call(parser: HermesParser) -> None:
    second = block(call_json("g"))
    text = f"<tool_call>{call_json('f')}\n{second}"
    turn = parser.parse(text)
    assert [(c.name, c.id, c.raw) for c in turn.calls] == [("g", "call_0", second)]
    [error] = turn.errors
    assert error.kind == "unclosed_tag"
    assert "before the next <tool_call>" in error.message
    assert error.raw == f"<tool_call>{call_json('f')}\n"


def test_stray_close_tag(parser: HermesParser) -> None:
    valid = block(call_json("f"))
    text = f'{{"name": "g"}}</tool_call> and {valid} </tool_call>'
    turn = parser.parse(text)
    assert [c.name for c in turn.calls] == ["f"]
    assert [(e.kind, e.raw) for e in turn.errors] == [
        ("stray_close_tag", "</tool_call>"),
        ("stray_close_tag", "</tool_call>"),
    ]
    assert turn.errors[0].message == (
        "</tool_call> at character 13 has no matching <tool_call> before it. Open every call with <tool_call>."
    )
    assert turn.content == '{"name": "g"} and'


def test_every_malformed_kind_in_one_turn_keeps_the_valid_calls(parser: HermesParser) -> None:
    text = "".join(
        [
            "</tool_call>",
            block(call_json("a")),
            block("{bad"),
            block("[]"),
            block('{"arguments": {}}'),
            block('{"name": "x", "arguments": 5}'),
            block(call_json("b", k="v")),
            "<tool_call>{",
        ]
    )
    turn = parser.parse(text)
    assert [(c.id, c.name) for c in turn.calls] == [("call_0", "a"), ("call_1", "b")]
    assert [e.kind for e in turn.errors] == [
        "stray_close_tag",
        "bad_json",
        "not_object",
        "missing_name",
        "bad_arguments_type",
        "unclosed_tag",
    ]
    assert set(PARSE_ERROR_KINDS) - {"bad_markup"} == {e.kind for e in turn.errors}  # bad_markup: XML formats


def test_parser_never_raises_on_random_input(parser: HermesParser) -> None:
    pieces = ["<tool_call>", "</tool_call>", '"name"', '"f"', '"arguments"', " ", "\n", "é", *"{}[]:,"]
    rng = random.Random(1234)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        turn = parser.parse(text)
        assert all(e.kind in PARSE_ERROR_KINDS and e.message for e in turn.errors)
        assert all(isinstance(c.arguments, dict) and c.name for c in turn.calls)


# -- feedback and lookup --------------------------------------------------------------------------


def test_format_tool_error_tells_the_model_what_and_how() -> None:
    error = ParseError(
        kind="missing_name", message='tool call has no "name" field: {}', raw="<tool_call>{}</tool_call>"
    )
    text = format_tool_error(error)
    assert text.startswith(
        'Error: your tool call could not be parsed (missing_name): tool call has no "name" field: {}'
    )
    assert '<tool_call>\n{"name": <tool name>, "arguments": {<argument name>: <value>, ...}}\n</tool_call>' in text


def test_get_parser_by_name() -> None:
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("HERMES"), HermesParser)
    assert isinstance(get_parser("qwen25"), HermesParser)
    assert get_parser("hermes") is not get_parser("hermes")
    assert isinstance(get_parser("hermes"), ToolCallParser)
    known = ", ".join(parser_names())
    with pytest.raises(ConfigError, match=rf"parser='nope': unknown tool-call parser; known: {known}"):
        get_parser("nope")


def test_register_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parsers, "_PARSERS", dict(parsers._PARSERS))

    class Upper:
        def parse(self, text: str) -> ParsedTurn:
            return ParsedTurn(content=text.upper())

    register_parser("Upper", Upper)
    assert "upper" in parser_names()
    assert get_parser("upper").parse("hi") == ParsedTurn(content="HI")
    with pytest.raises(ConfigError):
        register_parser("", Upper)


# -- JSON-aware block ends, non-JSON constants, aliases, thinking, text order ----------------------


@pytest.mark.parametrize(
    "value",
    [
        "print('</tool_call>')",
        "<tool_call>",
        'an example: <tool_call>{"name": "g"}</tool_call> in a string',
        "</tool_call></tool_call>",
    ],
)
def test_tags_inside_json_strings_are_content(parser: HermesParser, value: str) -> None:
    raw = block(call_json("run", code=value))
    turn = parser.parse(f"Running it.\n{raw}\nDone.")
    assert turn.errors == []
    assert [(c.name, c.arguments, c.raw) for c in turn.calls] == [("run", {"code": value}, raw)]
    assert turn.content == "Running it.\n\nDone."


def test_tag_inside_a_string_of_string_arguments(parser: HermesParser) -> None:
    args = json.dumps({"html": "<tool_call></tool_call>"})
    turn = parser.parse(block(json.dumps({"name": "f", "arguments": args})))
    assert turn.errors == []
    assert [c.arguments for c in turn.calls] == [{"html": "<tool_call></tool_call>"}]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_not_json(parser: HermesParser, constant: str) -> None:
    for body in (
        f'{{"name": "f", "arguments": {{"x": {constant}}}}}',
        json.dumps({"name": "f", "arguments": f'{{"x": {constant}}}'}),
    ):
        turn = parser.parse(block(body))
        assert turn.calls == [], body
        [error] = turn.errors
        assert error.kind in ("bad_json", "bad_arguments_type")
        assert "not valid JSON" in error.message or "invalid JSON" in error.message
        assert constant.lstrip("-") in error.message or "finite" in error.message


def test_parameters_is_an_alias_of_arguments(parser: HermesParser) -> None:
    turn = parser.parse(block('{"name": "f", "parameters": {"x": 1}}'))
    assert turn.errors == []
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {"x": 1})]
    turn = parser.parse(block('{"name": "f", "parameters": "{\\"x\\": 2}"}'))
    assert [c.arguments for c in turn.calls] == [{"x": 2}]
    turn = parser.parse(block('{"name": "f", "arguments": {"x": 1}, "parameters": {"x": 2}}'))
    assert turn.calls == []
    assert [e.kind for e in turn.errors] == ["bad_arguments_type"]
    assert "not both" in turn.errors[0].message


def test_calls_inside_think_are_drafts_not_calls(parser: HermesParser) -> None:
    draft = block(call_json("delete_everything"))
    real = block(call_json("f", x=1))
    text = f"<think>Maybe {draft}? No.</think>\nI will call f.\n{real}"
    turn = parser.parse(text)
    assert [(c.id, c.name) for c in turn.calls] == [("call_0", "f")]
    assert turn.errors == []
    assert "delete_everything" in turn.content  # the draft stays in the text, as thinking
    unclosed = parser.parse(f"<think>I could {draft}")  # cut off while thinking
    assert (unclosed.calls, unclosed.errors) == ([], [])


def test_think_opened_by_the_prompt() -> None:
    text = f"still thinking {block(call_json('draft'))}</think>{block(call_json('f'))}"
    assert [c.name for c in HermesParser().parse(text).calls] == ["draft", "f"]
    assert [c.name for c in HermesParser(thinking_open=True).parse(text).calls] == ["f"]


def test_a_second_object_and_junk_in_one_tag(parser: HermesParser) -> None:
    turn = parser.parse(block(call_json("f") + " " + call_json("g") + " oops"))
    assert turn.calls == []  # the whole block is malformed: none of its calls run
    assert [e.kind for e in turn.errors] == ["bad_json"]
    assert "Extra data" in turn.errors[0].message


def test_calls_and_errors_in_text_order(parser: HermesParser) -> None:
    text = block("{bad") + block(call_json("a")) + block("[]") + block(call_json("b"))
    turn = parser.parse(text)
    order = turn.in_text_order()
    assert [type(x).__name__ for x in order] == ["ParseError", "ToolCall", "ParseError", "ToolCall"]
    assert [x.name for x in order if isinstance(x, ToolCall)] == ["a", "b"]
