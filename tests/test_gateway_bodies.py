"""A body is weighed from its bytes before it is decoded (issue 36, item 2): a text no prompt can hold is
refused without decoding it (memory: the read buffer and views into it), and a body whose Python objects
would outweigh it is refused without building them; on every API that takes a body."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk import RolloutClient
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.gateway import Gateway, bodies
from rollout_sdk.gateway.bodies import (
    SHAPE_FLOOR_BYTES,
    CharCaps,
    PromptLimits,
    check_body,
    min_chars,
    min_kept_chars,
    min_tokens,
    object_cost,
)
from rollout_sdk.gateway.errors import GatewayError
from test_gateway import IM_END, RecordingClient, Script

MiB = 1 << 20
LIMITS = PromptLimits(tokens=4095, chars=4095 * 128)  # the tiny Qwen2 at a 4,096 context


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def big_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """One call per API whose counted text is ``text`` (in each API's own place for it)."""
    parts = [{"type": "text", "text": text[: len(text) // 2]}, {"type": "text", "text": text[len(text) // 2 :]}]
    return [
        ("chat", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": text}]}),
        ("chat", {"messages": [{"role": "user", "content": parts}]}),
        ("chat", {"messages": [{"role": "tool", "tool_call_id": "c", "content": text}]}),
        ("completions", {"prompt": text}),
        ("completions", {"prompt": [text]}),
        ("responses", {"input": text}),
        ("responses", {"instructions": text, "input": "hi"}),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": text}]}),
        ("messages", {"max_tokens": 8, "messages": [{"role": "user", "content": text}]}),
        ("messages", {"max_tokens": 8, "system": [{"type": "text", "text": text}], "messages": []}),
        (
            "messages",
            {
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": parts}]}
                ],
            },
        ),
    ]


def traced_peak(fn: Any) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        fn()
    except GatewayError as exc:
        return tracemalloc.get_traced_memory()[1], exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, None


def test_a_text_no_prompt_can_hold_is_refused_from_views_into_the_buffer() -> None:
    text = "word " * (3 * MiB // 5)  # 3 MiB: over 4,095 x 128 characters
    for api, body in big_calls(text):
        raw = bytearray(json.dumps({"model": "m", **body}).encode())
        peak, err = traced_peak(lambda raw=raw, api=api: check_body(raw, api, LIMITS))  # type: ignore[misc]
        assert isinstance(err, GatewayError) and err.code == "context_length_exceeded", (api, body.keys())
        assert err.param == {"completions": "prompt", "responses": "input"}.get(api, "messages")
        assert peak < 2 * MiB + len(raw) // 8, (api, peak)  # not the 3 MiB of text again
    # the same bodies within the limits pass (the exact check later decides), and so do assistant texts
    for api, body in big_calls("word " * 1000):
        check_body(bytearray(json.dumps(body).encode() + b" " * MiB), api, LIMITS)
    # an assistant's text counts from its last "think" on (templates drop earlier reasoning), and not at
    # all beside tool calls (a template may render a call without its message's content)
    for content in (text + "</think>ok", [{"type": "text", "text": text}, {"type": "text", "text": "</think>"}]):
        reasoning = {"messages": [{"role": "assistant", "content": content}, {"role": "user", "content": "hi"}]}
        check_body(json.dumps(reasoning).encode(), "chat", LIMITS)
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with_calls = {"messages": [{"role": "assistant", "content": text, "tool_calls": calls}]}
    check_body(json.dumps(with_calls).encode(), "chat", LIMITS)
    # a body of another shape than its API's is left to the full checks (which name the field)
    check_body(json.dumps({"messages": text}).encode(), "chat", LIMITS)


def test_a_prompt_of_more_ids_than_the_context_is_refused_unread() -> None:
    raw = b'{"model": "m", "prompt": [' + b",".join([b"1"] * 200_000) + b"]}"
    peak, err = traced_peak(lambda: check_body(raw, "completions", LIMITS))
    assert isinstance(err, GatewayError) and (err.code, err.param) == ("context_length_exceeded", "prompt")
    assert peak < MiB


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(), st.booleans())
def test_min_chars_is_a_lower_bound_of_the_decoded_characters(text: str, ascii_only: bool) -> None:
    raw = msgspec.Raw(json.dumps(text, ensure_ascii=ascii_only).encode())
    assert min_chars(raw) <= len(text)


SHAPES = {
    "empty objects": b"{}",
    "empty arrays": b"[]",
    "small ints": b"1",
    "ints": b"123456",
    "floats": b"1.5",
    "short strings": b'"ab"',
    "objects": b'{"a":1}',
    "nested": b'{"a":[1,{"b":null}],"c":"d"}',
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_object_cost_bounds_what_decoding_takes(name: str) -> None:
    value = SHAPES[name]
    raw = b'{"x": [' + b",".join([value] * (2 * MiB // (len(value) + 1))) + b"]}"
    tracemalloc.start()
    decoded = msgspec.json.decode(raw)
    taken = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del decoded
    # what the decode takes beyond its strings' characters (at most the body's size) is within the bound
    assert object_cost(raw) >= taken - len(raw), (name, object_cost(raw), taken)
    # with a limit: stops once over it, but never says less than the limit for what is more
    limit = max(len(raw), SHAPE_FLOOR_BYTES)
    assert (object_cost(raw, limit) > limit) == (object_cost(raw) > limit), name


def test_many_tiny_values_are_refused_before_they_are_built_and_text_is_not() -> None:
    raw = b'{"messages": [' + b",".join([b"{}"] * (5 * MiB)) + b"]}"  # 15 MiB: ~360 MB as dicts
    peak, err = traced_peak(lambda: check_body(raw, "other", None))
    assert isinstance(err, GatewayError) and (err.status, err.code, err.param) == (400, "too_many_items", "messages")
    assert peak <= MiB  # nothing copied, no object built  # at most one copy of the structure, never its objects
    prose = json.dumps({"messages": [{"role": "user", "content": 'a, [b]: {"c"}, ' * MiB}]}).encode()
    check_body(prose, "other", None)  # punctuation inside a text is not structure


@contextlib.asynccontextmanager
async def gateway_at(fake_servers: Any, tok: Any, context: int, **options: Any) -> AsyncIterator[tuple[Gateway, Any]]:
    config = FakeEngineConfig(eos_token_ids=(IM_END,), max_context=context)
    servers = await fake_servers(1, config, responder=Script(tok, ["ok"]))
    client = RecordingClient(servers=[s.address for s in servers])
    async with client, Gateway(client, tokenizer=tok, **options) as gw:
        yield gw, client


async def test_every_body_taking_route_refuses_both_before_decoding(fake_servers, tok) -> None:
    """Over HTTP, on every route that reads a body: a 400 with its code, no session opened, and the
    gateway keeps serving.  The context here is 4,096 and the tiny Qwen2's longest token 128 characters."""
    text = "word " * (1 * MiB)  # 5 MiB of text: over 4,095 x 128 characters
    tiny = b'{"model": "m", "x": [' + b",".join([b"[]"] * (2 * MiB)) + b"]}"
    model_routes = {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "responses": "/v1/responses",
        "messages": "/v1/messages",
    }
    other_routes = ["/v1/sessions", "/v1/sessions/s1/reward", "/v1/sessions/s1/finish", "/v1/trajectories/ack"]
    async with gateway_at(fake_servers, tok, 4096, max_body_bytes=32 * MiB) as (gw, client):
        root = gw.url.removesuffix("/v1")
        headers = {"Content-Type": "application/json", "x-api-key": "big"}
        async with aiohttp.ClientSession() as http:
            for api, body in big_calls(text):
                raw = json.dumps({"model": gw.model_name, **body}).encode()
                async with http.post(root + model_routes[api], data=raw, headers=headers) as r:
                    err = (await r.json())["error"]
                    assert r.status == 400 and err["code"] == "context_length_exceeded", (api, err)
            for path in [*model_routes.values(), *other_routes]:
                async with http.post(root + path, data=tiny, headers=headers) as r:
                    err = (await r.json())["error"]
                    assert r.status == 400 and err["code"] == "too_many_items", (path, err)
            good = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(root + "/v1/chat/completions", json=good, headers=headers) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "ok"
        assert gw.store.sessions.keys() == {"big"}  # only the call that was served opened one
        assert len(client.calls) == 1


# -- a text the character bound lets through: only its first characters are decoded and tokenized -------


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(), st.integers(0, 64), st.booleans())
def test_a_heads_cut_decodes_to_a_prefix_of_the_text(text: str, size: int, ascii_only: bool) -> None:
    from rollout_sdk.gateway.bodies import _head

    head = _head(msgspec.Raw(json.dumps(text, ensure_ascii=ascii_only).encode()), size)
    assert head is None or text.startswith(head)
    if head is not None and len(text.encode()) > size + 12 and ascii_only:
        assert len(head) >= (size - 12) // 12  # a cut near the size asked for (escapes are <= 12 bytes)


def test_a_long_text_within_the_character_bound_is_probed_from_a_decoded_prefix_only() -> None:
    limits = PromptLimits(tokens=16383, chars=16383 * 128, probe_chars=16383 * 8)
    text = "word " * 300_000  # 1.5M characters: within 16,383 x 128
    for api, body in big_calls(text):
        raw = bytearray(json.dumps(body).encode())
        tracemalloc.start()
        probe = check_body(raw, api, limits)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert probe is not None and probe.param == {"completions": "prompt", "responses": "input"}.get(api, "messages")
        assert limits.probe_chars <= sum(len(t) for t in probe.texts) <= 2 * limits.probe_chars + 2, api
        assert all(t in text or t in ("s", "hi") for t in probe.texts), api  # pieces of the counted texts
        assert peak < 2 * MiB, (api, peak)  # the prefix and 256 KiB pieces of the count, never the whole text


async def _counted(fake_servers: Any, tok: Any, *, max_context: int) -> tuple[Any, Any, list[int], Any]:
    """A tokenizer that counts its calls, one fake server of ``max_context``, and a spy for the routes'
    ``msgspec.json.decode`` that records the size of every untyped (whole-body) decode in ``decoded``."""
    from test_gateway_hardening import CountingTokenizer

    config = FakeEngineConfig(eos_token_ids=(IM_END,), max_context=max_context)
    servers = await fake_servers(1, config, responder=Script(tok, ["ok"]))
    decoded: list[int] = []
    real = msgspec.json.decode

    def spy(buf: Any, *args: Any, **kw: Any) -> Any:
        if kw.get("type") is None and not args:
            decoded.append(len(buf))
        return real(buf, *args, **kw)

    return CountingTokenizer(tok), servers, decoded, spy


async def _refused(http: Any, url: str, body: dict[str, Any], spy: Any) -> dict[str, Any]:
    """POST ``body`` with the routes' decode spied on; the error of its 400."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("rollout_sdk.gateway.routes.msgspec.json.decode", spy)
        async with http.post(url, data=json.dumps(body).encode(), headers={"x-api-key": "k"}) as r:
            err: dict[str, Any] = (await r.json())["error"]
    assert r.status == 400, err
    return err


async def test_a_long_text_is_refused_by_its_prefix_before_the_body_is_decoded(fake_servers, tok) -> None:
    """Context 16,384: 1.5M characters are within 16,383 x 128, so the prefix probe decides; the tokenizer
    sees pieces of at most 8 characters per token of room, and the body is never decoded whole."""
    counting, servers, decoded, spy = await _counted(fake_servers, tok, max_context=16384)

    text = "WORD " * 300_000  # no lowercase letter or digit: the counted characters cannot decide (see below)
    async with RolloutClient(servers=[s.address for s in servers]) as client, Gateway(client, tokenizer=counting) as gw:
        root = gw.url.removesuffix("/v1")
        routes = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
        routes |= {"responses": "/v1/responses", "messages": "/v1/messages"}
        async with aiohttp.ClientSession() as http:
            for api, body in big_calls(text):
                counting.encoded.clear()
                decoded.clear()
                err = await _refused(http, root + routes[api], {"model": gw.model_name, **body}, spy)
                assert err["code"] == "context_length_exceeded", (api, err)
                assert decoded == [], api  # refused before the body was decoded
                assert counting.encoded and max(counting.encoded) <= 8 * 16384, (api, counting.encoded)
        assert not gw.store.sessions


# -- assistant text, and a bound from counted characters that needs no tokenizer ---------------------------


@pytest.fixture(scope="module")
def caps(tok: Any) -> CharCaps:
    return CharCaps(tok.get_vocab())


def assistant_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """One call per API whose assistant message holds ``text`` (no reasoning tag, no tool call)."""
    user = {"role": "user", "content": "hi"}
    half = [{"type": "text", "text": text[: len(text) // 2]}, {"type": "text", "text": text[len(text) // 2 :]}]
    return [
        ("chat", {"messages": [{"role": "assistant", "content": text}, user]}),
        ("chat", {"messages": [{"role": "assistant", "content": half, "tool_calls": []}, user]}),
        ("responses", {"input": [{"role": "assistant", "content": text}, user]}),
        (
            "responses",
            {
                "input": [
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
                    {"type": "reasoning"},
                    {"type": "function_call_output", "call_id": "c", "output": "x"},
                ]
            },
        ),
        ("messages", {"max_tokens": 8, "messages": [user, {"role": "assistant", "content": text}, user]}),
        ("messages", {"max_tokens": 8, "messages": [user, {"role": "assistant", "content": half}, user]}),
    ]


def test_assistant_text_no_prompt_can_hold_is_refused_from_views_into_the_buffer() -> None:
    """The residue of the first round (peak 5x the body): an assistant's text is counted too, from its last
    ``think`` on and only characters no strip removes; not beside tool calls."""
    text = "word " * (3 * MiB // 5)
    for api, body in assistant_calls(text):
        raw = bytearray(json.dumps({"model": "m", **body}).encode())
        peak, err = traced_peak(lambda raw=raw, api=api: check_body(raw, api, LIMITS))  # type: ignore[misc]
        assert isinstance(err, GatewayError) and err.code == "context_length_exceeded", (api, body)
        assert peak < 2 * MiB, (api, peak)
    # what a template may drop is not counted: a message a function call joins (Responses), one with a
    # tool_use block (Messages), one with tool calls (chat), reasoning before </think>
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    dropped = [
        ("responses", {"input": [{"role": "assistant", "content": text}, {"type": "reasoning"}, call]}),
        (
            "messages",
            {
                "max_tokens": 8,
                "messages": [
                    {"role": "assistant", "content": [{"type": "text", "text": text}, {"type": "tool_use"}]},
                ],
            },
        ),
        ("chat", {"messages": [{"role": "assistant", "content": text, "tool_calls": [{"function": {}}]}]}),
        ("chat", {"messages": [{"role": "assistant", "content": text + "</think>\n\n  \u3000 ok  "}]}),
    ]
    for api, body in dropped:
        assert check_body(json.dumps(body).encode(), api, LIMITS) is None, (api, body)
    # a gateway whose template was seen to render content beside tool calls counts it (reasoning never)
    seen = dataclasses.replace(LIMITS, call_content=True)
    for api, body in dropped[:3]:
        with pytest.raises(GatewayError, match="context"):
            check_body(json.dumps(body).encode(), api, seen)
    assert check_body(json.dumps(dropped[3][1]).encode(), "chat", seen) is None
    # one whose template keeps reasoning counts an assistant's whole text
    with pytest.raises(GatewayError, match="context"):
        check_body(json.dumps(dropped[3][1]).encode(), "chat", dataclasses.replace(LIMITS, reasoning=True))


class JinjaTokenizer:
    """A tokenizer whose chat template is ``source`` (only what ChatTemplate renders with)."""

    def __init__(self, source: str) -> None:
        import jinja2

        self.chat_template = source
        self._template = jinja2.Environment().from_string(source)

    def apply_chat_template(self, messages: Any, tools: Any = None, **kw: Any) -> str:
        return self._template.render(messages=messages, tools=tools, **kw)


def test_a_template_is_probed_for_what_it_renders_of_an_assistant(tok: Any) -> None:
    from rollout_sdk.gateway.service import keeps_call_content, keeps_reasoning

    assert keeps_call_content(tok)  # Qwen2.5's template renders it
    # Llama 3.1's way: a message with tool calls is rendered as its calls only
    llama_like = (
        "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}"
        "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert not keeps_call_content(JinjaTokenizer(llama_like))
    # content kept only in the latest turn: not kept everywhere, so not counted
    latest_only = (
        "{% for m in messages %}{% if m.tool_calls and not loop.last and loop.index < 4 %}{{ m.role }}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert not keeps_call_content(JinjaTokenizer(latest_only))
    assert keeps_call_content(JinjaTokenizer("{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert not keeps_call_content(JinjaTokenizer("{{ raise_here() }}"))  # a template that fails: not known
    # reasoning: Qwen2.5's template renders an assistant's text whole; Qwen3's way drops earlier reasoning
    assert keeps_reasoning(tok)
    qwen3_like = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert not keeps_reasoning(JinjaTokenizer(qwen3_like))


_PIECES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["</think>", "</seed:think>", "\u25c1/think\u25b7", "think", " ", "\n", "\u3000", "\xa0", "\\", '"']
    ),
)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.lists(_PIECES, max_size=8).map("".join), min_size=1, max_size=4), st.booleans())
def test_min_kept_chars_is_a_lower_bound_of_what_templates_keep(parts: list[str], ascii_only: bool) -> None:
    raws = [msgspec.Raw(json.dumps(p, ensure_ascii=ascii_only).encode()) for p in parts]
    joined = "".join(parts)
    for tag in ("</think>", "</seed:think>", "\u25c1/think\u25b7"):
        kept = joined.split(tag)[-1]
        assert min_kept_chars(raws) <= len(kept.strip()), (tag, kept)


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["word", " ", "www", "1234567", "e" * 20, "\n", "é", "\\u0077"]), st.text(max_size=12)
        ),
        max_size=60,
    ).map("".join),
    st.booleans(),
)
def test_min_tokens_is_a_lower_bound_of_the_tokens(tok: Any, caps: CharCaps, text: str, ascii_only: bool) -> None:
    raw = msgspec.Raw(json.dumps(text, ensure_ascii=ascii_only).encode())
    n, _ = min_tokens([(raw, 0)], caps, 1 << 30)
    assert n <= len(tok.encode(text, add_special_tokens=False)), text


def test_char_caps_are_the_most_copies_one_token_holds(tok: Any, caps: CharCaps) -> None:
    vocab = list(tok.get_vocab())
    for c in "abcdefghijklmnopqrstuvwxyz0123456789":
        assert caps.cap(c) == max(t.count(c) for t in vocab), c
    assert caps.cap("0") == 1 and caps.cap("w") == 3  # Qwen2 splits digits; "www" is its most w's
    # a token holding a newline is still one token; a character in no token has no cap
    odd = CharCaps(["a\naa", "b", "\n", "zz"])
    assert (odd.cap("a"), odd.cap("b"), odd.cap("z"), odd.cap("q")) == (3, 1, 2, 0)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.sampled_from(["assistant", "user", "think"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "type", "content", "text", "output", "tool_calls", "messages", "input", "x"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)
_BODY = st.dictionaries(st.sampled_from(["messages", "input", "prompt", "system", "instructions", "model"]), _JSON)


@settings(max_examples=300, deadline=None, database=None)
@given(_BODY, st.sampled_from(["chat", "completions", "responses", "messages", "other"]), st.integers(1, 64))
def test_weighing_any_body_refuses_with_a_typed_400_or_passes(body: dict[str, Any], api: Any, tokens: int) -> None:
    """The weighing code on every shape a body can take (bounds low enough that every path runs): it
    passes the body on or refuses it with a typed 400, never anything else."""
    limits = PromptLimits(tokens=tokens, chars=tokens * 2, probe_chars=tokens, char_caps=CharCaps(["a", "www", "ss"]))
    raw = json.dumps(body).encode()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bodies, "SHAPE_CHECK_BYTES", 0)
        probe, err = _outcome(lambda: check_body(raw, api, limits))
    assert err is None or (err.status == 400 and err.code in ("context_length_exceeded", "too_many_items")), err
    assert probe is None or all(isinstance(t, str) for t in probe.texts)


def _outcome(fn: Any) -> tuple[Any, GatewayError | None]:
    try:
        return fn(), None
    except GatewayError as exc:
        return None, exc


async def test_a_long_text_is_refused_by_counted_characters_without_tokenizing(fake_servers, tok) -> None:
    """Context 131,072 (the character bound lets 16.7M characters through): 2.5M characters of "word "
    hold 500k 'w', and no token of Qwen2 holds more than 3, so the call is refused before the body is
    decoded and without a single call of the tokenizer; user and assistant text alike (beside tool calls
    too: this template renders that content)."""
    counting, servers, decoded, spy = await _counted(fake_servers, tok, max_context=131072)

    text = "word " * 500_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    beside_calls = [{"role": "assistant", "content": text, "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    reasoning = [{"role": "assistant", "content": text + "</think>ok"}, {"role": "user", "content": "hi"}]
    # Qwen2.5's template renders an assistant's content beside its tool calls, and its reasoning: counted too
    calls = [*big_calls(text), *assistant_calls(text), ("chat", {"messages": beside_calls})]
    calls.append(("chat", {"messages": reasoning}))
    routes = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    routes |= {"responses": "/v1/responses", "messages": "/v1/messages"}
    async with RolloutClient(servers=[s.address for s in servers]) as client, Gateway(client, tokenizer=counting) as gw:
        root = gw.url.removesuffix("/v1")
        async with aiohttp.ClientSession() as http:
            for api, body in calls:
                err = await _refused(http, root + routes[api], {"model": gw.model_name, **body}, spy)
                assert err["code"] == "context_length_exceeded", (api, err)
                assert "at least" in err["message"] and "'w'" in err["message"], err
                assert decoded == [], api
        assert counting.encoded == []  # the tokenizer never ran
        assert not gw.store.sessions
