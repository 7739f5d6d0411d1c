"""Typed request fields (issue 42, item 5): msgspec's conversion does the field-by-field checks, and its
errors become the gateway's 400s with the field named as the rest of the gateway names it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk.gateway import requests as rq
from rollout_sdk.gateway.errors import GatewayError

CASES: list[tuple[type, Any, str, str | None, str]] = [
    # (type, value, where, param, code)
    (rq.ChatRequest, {"frobnicate": 1}, "", "frobnicate", "unsupported_parameter"),
    (rq.ChatRequest, {"n": "two"}, "", "n", "invalid_type"),
    (rq.ChatRequest, {"n": True}, "", "n", "invalid_type"),  # a bool is not an int
    (rq.ChatRequest, {"max_tokens": 0}, "", "max_tokens", "invalid_value"),
    (rq.ChatRequest, {"stop": [""]}, "", "stop[0]", "invalid_value"),
    (rq.ChatRequest, {"stop": ["a"] * 17}, "", "stop", "invalid_value"),
    (rq.ChatRequest, {"stop": 5}, "", "stop", "invalid_type"),
    (rq.ChatRequest, {"stream_options": []}, "", "stream_options", "invalid_type"),
    (rq.SessionSamplingFields, {"logit_bias": 1}, "sampling", "sampling.logit_bias", "unsupported_parameter"),
    (rq.SessionSamplingFields, {"seed": 1.5}, "sampling", "sampling.seed", "invalid_type"),
    (rq.SessionSamplingFields, 3, "sampling", "sampling", "invalid_type"),
    (list[rq.TurnReward], [{"turn": 0}], "turn_rewards", "turn_rewards[0].reward", "missing_required_parameter"),
    (list[rq.TurnReward], [{"reward": 1, "turn": "x"}], "turn_rewards", "turn_rewards[0].turn", "invalid_type"),
    (rq.AckRequest, {}, "", "ids", "missing_required_parameter"),
    (rq.AckRequest, {"ids": [1]}, "", "ids[0]", "invalid_type"),
    (list[rq.ChatMessage], [{"role": "wizard"}], "messages", "messages[0].role", "invalid_value"),
    (
        list[rq.ChatMessage],
        [{"role": "user", "content": [{"type": "input_audio"}]}],
        "messages",
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    (rq.ChatTools, [{"type": "retrieval"}], "tools", "tools[0].type", "unsupported_parameter"),
    (
        rq.ChatTools,
        [{"type": "function", "function": {"name": ""}}],
        "tools",
        "tools[0].function.name",
        "invalid_value",
    ),
    (rq.MessagesRequest, {"system": [{"type": "image"}]}, "", "system[0]", "unsupported_parameter"),
    (
        rq.MessagesRequest,
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "",
        "messages[0].content[0].tool_use_id",
        "missing_required_parameter",
    ),
    (rq.MessagesRequest, {"tools": [{"type": "bash_20250124"}]}, "", "tools[0].type", "unsupported_parameter"),
    (list[rq.InputItem], [{"type": "input_image"}], "input", "input[0].type", "unsupported_parameter"),
    (
        list[rq.InputItem],
        [{"type": "message", "role": "user", "content": [{"type": "input_file"}]}],
        "input",
        "input[0].content[0]",
        "unsupported_parameter",
    ),
    (rq.ResponsesRequest, {"metadata": {"a": 1, 2: 3}}, "", "metadata", "invalid_type"),
]


@pytest.mark.parametrize(("kind", "value", "where", "param", "code"), CASES)
def test_validation_errors_name_the_field_with_its_code(
    kind: Any, value: Any, where: str, param: str, code: str
) -> None:
    with pytest.raises(GatewayError) as info:
        rq.convert(value, kind, where=where)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, code), err.body()
    assert err.message


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
TYPES = [
    rq.ChatRequest,
    rq.CompletionRequest,
    rq.ResponsesRequest,
    rq.MessagesRequest,
    rq.SessionSamplingFields,
    rq.RewardRequest,
    rq.AckRequest,
    list[rq.ChatMessage],
    list[rq.InputItem],
    rq.ChatTools,
]
FIELDS = ["messages", "content", "role", "type", "text", "tools", "input", "system", "stop", "n", "ids", "reward"]


@settings(max_examples=400, deadline=None, database=None)
@given(st.sampled_from(TYPES), st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4) | JSON)
def test_any_json_converts_or_is_a_400_naming_a_field(kind: Any, value: Any) -> None:
    refused: GatewayError | None = None
    try:
        rq.convert(value, kind, where="body")
    except GatewayError as exc:
        refused = exc
    if refused is not None:  # anything but a GatewayError fails the test: it would be a 500
        err = refused
        assert err.status == 400 and err.param and err.param.startswith("body") and err.code and err.message
