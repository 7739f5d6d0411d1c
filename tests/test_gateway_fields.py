"""The fields current clients send (issue 42, item 4): each one the installed ``openai`` / ``anthropic``
clients can send is in docs/gateway.md's table and does what the table says, sent by the real client;
the Messages stream's final usage carries ``input_tokens`` (the ``anthropic`` client's stream and
langchain-anthropic read it); docs/gateway.md states the gateway's seeds as the code derives them."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from test_gateway import Script, gateway_on

DOCS = Path(__file__).resolve().parents[1] / "docs" / "gateway.md"


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def root(gw: Any) -> str:
    return gw.url.removesuffix("/v1")


def documented(api: str) -> set[str]:
    """The field names in the second column of docs/gateway.md's table rows for ``api``."""
    names: set[str] = set()
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 4 and cells[1] == api:
            names |= set(re.findall(r"`([a-z_]+)`", cells[2]))
    return names


def sdk_fields() -> dict[str, set[str]]:
    from anthropic.types import message_create_params as messages
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    return {
        "chat": set(chat.CompletionCreateParamsStreaming.__annotations__),
        "responses": set(responses.ResponseCreateParamsStreaming.__annotations__),
        "completions": set(completions.CompletionCreateParamsStreaming.__annotations__),
        "messages": set(messages.MessageCreateParamsStreaming.__annotations__),
    }


@pytest.mark.parametrize("api", ["chat", "responses", "completions", "messages"])
def test_the_docs_table_lists_every_field_the_installed_clients_can_send(api: str) -> None:
    missing = sdk_fields()[api] - documented(api)
    assert not missing, f"docs/gateway.md, 'Fields current clients send': no row for {api} {sorted(missing)}"


def split_kwargs(create: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as the client's own keyword arguments where its ``create`` has them, else in extra_body."""
    params = inspect.signature(create).parameters
    kw = {k: v for k, v in fields.items() if k in params}
    extra = {k: v for k, v in fields.items() if k not in params}
    return {**kw, "extra_body": extra} if extra else kw


# what each ignored field is sent as: values the client's types allow
CHAT_IGNORED = {
    "reasoning_effort": "low",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "hello"},
    "prompt_cache_key": "k1",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "metadata": {"run": "r1"},
    "store": False,
    "user": "u1",
    "safety_identifier": "s1",
    "parallel_tool_calls": True,
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "service_tier": "auto",
    "top_logprobs": 0,
    "logit_bias": {},
}
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
}
RESPONSES_IGNORED = {
    "max_tool_calls": 3,
    "reasoning": {"effort": "low"},
    "truncation": "disabled",
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "background": False,
    "background_options": {},
    "prompt_cache_key": "k1",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "store": False,
    "user": "u1",
    "safety_identifier": "s1",
    "stream_options": {"include_obfuscation": False},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "include": ["reasoning.encrypted_content"],
    "metadata": {"run": "r1"},
}
RESPONSES_REFUSED = {
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
    "image": {},
    "moderation": {"model": "omni-moderation-latest"},
    "access_programs": {},
}
MESSAGES_IGNORED = {
    "cache_control": {"type": "ephemeral"},
    "output_config": {"effort": "low"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "metadata": {"user_id": "u1"},
    "service_tier": "auto",
    "speed": "fast",
    "inference_geo": "us",
    "container": "container_1",
    "diagnostics": {"previous_message_id": "msg_1"},
    "user_profile_id": "u1",
    "workspace_id": "wrkspc_1",
}


def test_the_field_lists_here_are_rows_of_the_docs_table() -> None:
    """What this module sends is what the table documents (a row can't drift from its test)."""
    for api, fields in (
        ("chat", {**CHAT_IGNORED, **CHAT_REFUSED}),
        ("responses", {**RESPONSES_IGNORED, **RESPONSES_REFUSED}),
        ("messages", MESSAGES_IGNORED),
    ):
        assert set(fields) <= documented(api), (api, set(fields) - documented(api))


def engine_view(calls: list[Any]) -> list[tuple[list[int], Any]]:
    """What the model saw and how it sampled, per engine call."""
    return [(list(req.input_ids), req.sampling) for req, _ in calls]


async def test_chat_fields_current_clients_send_are_ignored_or_refused_by_name(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"])) as (gw, client):
        base: dict[str, Any] = {"model": gw.model_name, "messages": [{"role": "user", "content": "hi"}], "seed": 3}
        plain = gw.session()
        async with openai.AsyncOpenAI(base_url=plain.base_url, api_key="x", max_retries=0) as oa:
            await oa.chat.completions.create(**base)
        s = gw.session()
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0) as oa:
            create = oa.chat.completions.create
            r = await create(**base, **split_kwargs(create, CHAT_IGNORED))
            assert r.choices[0].message.content == "ok"
            for name, value in CHAT_REFUSED.items():
                with pytest.raises(openai.BadRequestError) as err:
                    await create(**base, **split_kwargs(create, {name: value}))
                assert err.value.body["param"] == name and err.value.body["code"] == "unsupported_parameter"  # type: ignore[index]
        first, second = engine_view(client.calls)
        assert first == second  # the ignored fields changed nothing the model sees or how it samples


async def test_responses_fields_current_clients_send_are_ignored_or_refused_by_name(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"])) as (gw, client):
        base: dict[str, Any] = {"model": gw.model_name, "input": "hi", "max_output_tokens": 16}
        plain = gw.session()
        async with openai.AsyncOpenAI(base_url=plain.base_url, api_key="x", max_retries=0) as oa:
            await oa.responses.create(**base)
        s = gw.session()
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0) as oa:
            create = oa.responses.create
            r = await create(**base, **split_kwargs(create, RESPONSES_IGNORED))
            assert r.output_text == "ok" and r.metadata == {"run": "r1"}
            for name, value in RESPONSES_REFUSED.items():
                with pytest.raises(openai.BadRequestError) as err:
                    await create(**base, **split_kwargs(create, {name: value}))
                assert err.value.body["param"] == name and err.value.body["code"] == "unsupported_parameter"  # type: ignore[index]
        first, second = engine_view(client.calls)
        assert first == second


async def test_messages_fields_current_clients_send_are_ignored_or_refused_by_name(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["ok"])) as (gw, client):
        base: dict[str, Any] = {
            "model": gw.model_name,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        }
        plain = gw.session()
        async with anthropic.AsyncAnthropic(base_url=root(gw), api_key=plain.api_key, max_retries=0) as ac:
            await ac.messages.create(**base)
        s = gw.session()
        async with anthropic.AsyncAnthropic(base_url=root(gw), api_key=s.api_key, max_retries=0) as ac:
            create = ac.messages.create
            m = await create(**base, **split_kwargs(create, MESSAGES_IGNORED))
            assert m.content[0].text == "ok"  # type: ignore[union-attr]
            schema = {"type": "json_schema", "schema": {"type": "object"}}
            with pytest.raises(anthropic.BadRequestError) as err:
                await create(**base, **split_kwargs(create, {"output_config": {"effort": "low", "format": schema}}))
            assert err.value.body["error"]["param"] == "output_config.format"  # type: ignore[index]
            assert err.value.body["error"]["code"] == "unsupported_parameter"  # type: ignore[index]
        first, second = engine_view(client.calls)
        assert first == second


# -- the Messages stream's usage -------------------------------------------------------------------------


async def test_the_messages_stream_ends_with_cumulative_usage_input_tokens_included(fake_servers, tok) -> None:
    async with gateway_on(fake_servers, tok, Script(tok, ["two words"])) as (gw, client):
        s = gw.session()
        kw: dict[str, Any] = {"model": gw.model_name, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
        async with (
            anthropic.AsyncAnthropic(base_url=root(gw), api_key=s.api_key, max_retries=0) as ac,
            ac.messages.stream(**kw) as st,
        ):
            deltas = [e async for e in st if e.type == "message_delta"]
            final = await st.get_final_message()
        (req, result), *_ = client.calls
        prompt, output = len(req.input_ids), len(result.output_ids)
        [delta] = deltas
        assert (delta.usage.input_tokens, delta.usage.output_tokens) == (prompt, output)  # type: ignore[attr-defined]
        assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, output)


async def test_langchain_anthropic_reads_the_streamed_usage(fake_servers, tok) -> None:
    lc_anthropic = pytest.importorskip("langchain_anthropic")
    async with gateway_on(fake_servers, tok, Script(tok, ["two words"])) as (gw, client):
        s = gw.session()
        llm = lc_anthropic.ChatAnthropic(
            model=gw.model_name, base_url=root(gw), api_key=s.api_key, max_tokens=16, max_retries=0
        )
        total = None
        async for chunk in llm.astream("hi"):
            total = chunk if total is None else total + chunk
        # its httpx client is a process-wide cached one per base_url, never closed (conftest): this test's
        await llm._async_client.close()
        assert total is not None and total.content == "two words"
        (req, result), *_ = client.calls
        usage = total.usage_metadata
        assert usage is not None
        assert (usage["input_tokens"], usage["output_tokens"]) == (len(req.input_ids), len(result.output_ids))


# -- seeds, as documented ----------------------------------------------------------------------------------


def test_the_docs_state_the_seeds_the_gateway_derives() -> None:
    """docs/gateway.md says what service.py does: ``sample_seed(seed, member=k, turn=t)``, never ``seed + k``
    (the derivation itself is tested in test_gateway.py and test_gateway_apis.py)."""
    text = DOCS.read_text()
    assert "seed + k" not in text
    assert "sample_seed(seed, member=k, turn=t)" in text
    source = (Path(__file__).resolve().parents[1] / "src/rollout_sdk/gateway/service.py").read_text()
    assert "sample_seed(sampling.seed, member=k, turn=turn)" in source


# -- any value of any field a client can send: a typed 4xx naming a field, never another exception ----------


def test_any_value_of_any_client_field_is_served_or_refused_naming_a_field() -> None:
    """Bodies keyed by the installed clients' own field names, with arbitrary JSON values, through each
    API's checks (Messages and Responses translated, then the chat checks): accepted, or a GatewayError
    with a 4xx status and a named field; anything else would be a 500."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from rollout_sdk.gateway import messages as messages_api
    from rollout_sdk.gateway import responses as responses_api
    from rollout_sdk.gateway.errors import GatewayError
    from rollout_sdk.gateway.sampling import parse_options
    from rollout_sdk.gateway.sessions import Session
    from rollout_sdk.gateway.tools import parse_tool_choice, template_messages, template_tools

    fields = sdk_fields()
    names = sorted(set().union(*fields.values()) | {"top_k", "min_p", "stop_token_ids", "ignore_eos", "x"})
    leaf = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6), st.just("text")
    )
    json_ = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3))
    session = Session("s", max_turns=8)
    accepted: list[str] = []

    def chat_checks(chat: dict[str, Any], *, is_chat: bool = True) -> None:
        parse_options(chat, chat=is_chat, max_n=4, stop_token_ids=lambda stops: [])
        if is_chat:
            tools = template_tools(chat.get("tools"))
            parse_tool_choice(chat.get("tool_choice"), tools)
            template_messages(chat.get("messages"), max_messages=64)

    @settings(max_examples=400, deadline=None, database=None)
    @given(st.dictionaries(st.sampled_from(names), json_, max_size=5), st.sampled_from(["chat", "text", "r", "m"]))
    def prop(extra: dict[str, Any], api: str) -> None:
        base: dict[str, Any] = {"model": "m", ("max_output_tokens" if api == "r" else "max_tokens"): 8}
        base |= {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "text": {"prompt": "hi"}}.get(api, {})
        base |= {"r": {"input": "hi"}, "m": {"messages": [{"role": "user", "content": "hi"}]}}.get(api, {})
        body = {**base, **extra}
        refused: GatewayError
        try:
            if api == "chat":
                chat_checks(body)
            elif api == "text":
                chat_checks(body, is_chat=False)
            elif api == "r":
                chat_checks(responses_api.to_chat(body, session)[0])
            else:
                chat_checks(messages_api.to_chat(body))
        except GatewayError as exc:
            refused = exc
        else:
            accepted.append(api)
            return
        assert 400 <= refused.status < 500 and refused.message and refused.param, (body, refused.body())

    prop()
    assert accepted, "no body was accepted: the property checked refusals only"
