"""Wire messages: recorded payloads keep decoding, validation names the field and the value."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rollout_sdk.errors import InvalidRequestError, ProtocolError
from rollout_sdk.protocol import (
    Abort,
    EngineLimits,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    Ping,
    SamplingParams,
    check_against_limits,
    decode_client_message,
    decode_server_message,
    encode,
    error_reply,
)

RECORDED = json.loads((Path(__file__).parent / "data" / "protocol_v1.json").read_text())
SERVER_SIDE = {"result", "error", "pong", "control_reply"}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_payloads_still_decode(name: str) -> None:
    """Payloads recorded with protocol v1 decode to the same values (schema evolution guard)."""
    data = bytes.fromhex(RECORDED[name]["hex"])
    decode = decode_server_message if name in SERVER_SIDE else decode_client_message
    msg = decode(data)
    got, want = json.loads(msgspec.json.encode(msg)), RECORDED[name]["json"]
    assert {k: got.get(k) for k in want} == want
    # fields added since (each with a default) decode to their defaults from an old payload
    added = {k: v for k, v in got.items() if k not in want}
    fresh = json.loads(msgspec.json.encode(type(msg)(**{f: getattr(msg, f) for f in want if f != "type"})))
    assert added == {k: fresh[k] for k in added}


def test_round_trip_keeps_every_field() -> None:
    req = GenerateRequest(
        input_ids=[1, 2, 3],
        rid="x",
        session_id="s",
        sampling=SamplingParams(temperature=0.5, top_k=3, stop_token_ids=[9], seed=11),
    )
    assert decode_client_message(encode(req)) == req
    res = GenerateResult(rid="x", output_ids=[4], finish_reason="length", prompt_tokens=3, logprobs=[-1.0])
    assert decode_server_message(encode(res)) == res


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"max_new_tokens": 0}, "sampling.max_new_tokens", 0),
        ({"max_new_tokens": -5}, "sampling.max_new_tokens", -5),
        ({"temperature": -0.1}, "sampling.temperature", -0.1),
        ({"top_p": 0.0}, "sampling.top_p", 0.0),
        ({"top_p": 1.5}, "sampling.top_p", 1.5),
        ({"top_k": -2}, "sampling.top_k", -2),
        ({"min_p": 2.0}, "sampling.min_p", 2.0),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty", 0.0),
        ({"frequency_penalty": 3.0}, "sampling.frequency_penalty", 3.0),
        ({"stop_token_ids": [1, -3]}, "sampling.stop_token_ids[1]", -3),
        ({"seed": -1}, "sampling.seed", -1),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "sampling.min_new_tokens", 9),
    ],
)
def test_sampling_validation_names_field_and_value(kwargs: dict, field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert info.value.value == value
    assert field in str(info.value)
    assert repr(value) in str(info.value)


def test_nan_temperature_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=float("nan"))


def test_request_validation() -> None:
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest(input_ids=[])
    assert info.value.field == "input_ids"
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest(input_ids=[3, -1])
    assert (info.value.field, info.value.value) == ("input_ids[1]", -1)
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest(input_ids=[3, "x"])  # type: ignore[list-item]
    assert (info.value.field, info.value.value) == ("input_ids[1]", "x")


def _raw(obj: dict) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_decoding_bad_fields_gives_field_value_and_rid() -> None:
    bad = _raw({"type": "generate", "rid": "r7", "input_ids": [1], "sampling": {"temperature": -2.0}})
    with pytest.raises(InvalidRequestError) as info:
        decode_client_message(bad)
    assert info.value.field == "sampling.temperature"
    assert info.value.value == -2.0
    assert info.value.rid == "r7"  # type: ignore[attr-defined]


def test_decoding_wrong_types_names_path_and_value() -> None:
    bad = _raw({"type": "generate", "rid": "r8", "input_ids": [1, "two"]})
    with pytest.raises(InvalidRequestError) as info:
        decode_client_message(bad)
    assert info.value.field == "input_ids[1]"
    assert info.value.value == "two"
    missing = _raw({"type": "generate", "rid": "r9"})
    with pytest.raises(InvalidRequestError) as info:
        decode_client_message(missing)
    assert info.value.field == "input_ids"


def test_unknown_type_and_garbage_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 'teleport'"):
        decode_client_message(_raw({"type": "teleport", "rid": "z"}))
    with pytest.raises(ProtocolError):
        decode_client_message(b"\xc1\xff garbage")
    with pytest.raises(ProtocolError):
        decode_server_message(encode(Ping(1)))  # a client message is not a server reply


def test_limits_checks() -> None:
    limits = EngineLimits(vocab_size=100, max_context=16)
    with pytest.raises(InvalidRequestError) as info:
        check_against_limits(GenerateRequest(input_ids=[1, 100]), limits)
    assert (info.value.field, info.value.value) == ("input_ids[1]", 100)
    with pytest.raises(InvalidRequestError, match="longer than the context"):
        check_against_limits(GenerateRequest(input_ids=list(range(16))), limits)
    with pytest.raises(InvalidRequestError) as info:
        check_against_limits(GenerateRequest(input_ids=[1] * 8, sampling=SamplingParams(max_new_tokens=9)), limits)
    assert info.value.field == "sampling.max_new_tokens"
    with pytest.raises(InvalidRequestError) as info:
        check_against_limits(
            GenerateRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=2, stop_token_ids=[5, 300])), limits
        )
    assert info.value.field == "sampling.stop_token_ids[1]"
    check_against_limits(GenerateRequest(input_ids=[1] * 8, sampling=SamplingParams(max_new_tokens=8)), limits)


def test_error_reply_round_trip() -> None:
    err = InvalidRequestError("sampling.top_p", 7.0, "must be in (0, 1]")
    reply = error_reply(err, rid="q")
    back = decode_server_message(encode(reply))
    assert isinstance(back, ErrorReply)
    assert (back.code, back.field, back.value, back.rid) == ("invalid_request", "sampling.top_p", 7.0, "q")
    long = error_reply(InvalidRequestError("input_ids", list(range(1000)), "x"))
    assert len(long.value) == 17  # clipped, so a bad request cannot make a huge reply


def test_abort_defaults() -> None:
    assert decode_client_message(encode(Abort())) == Abort("")
