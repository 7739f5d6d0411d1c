"""Gateway bugs found from outside (issue 42 item 4), each against the real client package.

* the tool-call parser is built with the request's tools, so ``qwen3_coder`` values come back typed;
* fields current clients send that change nothing the model sees are accepted (and still checked), parts
  that would change the output are refused by name;
* the Messages stream's last usage carries the input tokens (langchain-anthropic reads it from there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from test_gateway import Script, gateway_on


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def _root(gw: Any, session: Any) -> str:
    return session.base_url.removesuffix("/v1")


CODER_CALL = (
    "<tool_call>\n<function=scale>\n<parameter=n>\n3\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n"
    "<parameter=label>\n7\n</parameter>\n</function>\n</tool_call>"
)
SCALE = {
    "type": "function",
    "function": {
        "name": "scale",
        "description": "Scale by n.",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "exact": {"type": "boolean"}, "label": {"type": "string"}},
        },
    },
}


async def test_qwen3_coder_arguments_come_back_typed_by_the_requests_tools(fake_servers, tok) -> None:
    script = Script(tok, [CODER_CALL])
    async with gateway_on(fake_servers, tok, script, parser="qwen3_coder") as (gw, _):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        chat = await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "scale"}], tools=[SCALE]
        )
        bare = {"type": "function", "function": {"name": "scale", "parameters": {"type": "object"}}}
        untyped = await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "x"}], tools=[bare]
        )
        await oa.close()
    [tc] = chat.choices[0].message.tool_calls  # type: ignore[misc]
    assert json.loads(tc.function.arguments) == {"n": 3, "exact": True, "label": "7"}  # type: ignore[union-attr]
    # a tool whose schema gives no types: strings, as the format writes them
    [raw] = untyped.choices[0].message.tool_calls  # type: ignore[misc]
    assert json.loads(raw.function.arguments) == {"n": "3", "exact": "true", "label": "7"}  # type: ignore[union-attr]


async def test_fields_current_clients_send_are_accepted_and_still_checked(fake_servers, tok) -> None:
    script = Script(tok, ["Fine."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        chat = await oa.chat.completions.create(
            model=gw.model_name, messages=[{"role": "user", "content": "a"}], reasoning_effort="low", verbosity="low"
        )
        assert chat.choices[0].message.content == "Fine."
        with pytest.raises(openai.BadRequestError) as bad:
            await oa.chat.completions.create(
                model=gw.model_name,
                messages=[{"role": "user", "content": "a"}],
                reasoning_effort="enormous",  # type: ignore[arg-type]
            )
        assert bad.value.body["param"] == "reasoning_effort"  # type: ignore[index]
        await oa.close()
        ac = anthropic.AsyncAnthropic(base_url=_root(gw, s), api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": gw.model_name, "max_tokens": 16, "messages": [{"role": "user", "content": "b"}]}
        m = await ac.messages.create(**kw, cache_control={"type": "ephemeral"}, output_config={"effort": "low"})
        assert m.content[0].text == "Fine."  # type: ignore[union-attr]
        await ac.close()
        calls = len(client.calls)
        async with aiohttp.ClientSession() as http:
            for extra, param in [
                ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
                ({"output_config": {"effort": "enormous"}}, "output_config.effort"),
                ({"output_config": "low"}, "output_config"),
                ({"cache_control": {"type": "forever"}}, "cache_control"),
            ]:
                async with http.post(f"{_root(gw, s)}/v1/messages", json={**kw, **extra}) as r:
                    body = await r.json()
                    assert r.status == 400, (extra, body)
                    assert param in json.dumps(body), (extra, body)
        assert len(client.calls) == calls  # refused before any generation


async def test_the_messages_streams_last_usage_carries_the_input_tokens(fake_servers, tok) -> None:
    script = Script(tok, ["Streamed."])
    async with gateway_on(fake_servers, tok, script) as (gw, client):
        s = gw.session()
        msgs = [{"role": "user", "content": "c"}]
        body = {"model": gw.model_name, "max_tokens": 16, "stream": True, "messages": msgs}
        events = []
        async with aiohttp.ClientSession() as http, http.post(f"{_root(gw, s)}/v1/messages", json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
        prompt = len(client.calls[0][0].input_ids)
        [delta] = [e for e in events if e["type"] == "message_delta"]
        assert delta["usage"]["input_tokens"] == prompt > 0
        assert delta["usage"]["output_tokens"] == len(client.calls[0][1].output_ids)
        ac = anthropic.AsyncAnthropic(base_url=_root(gw, s), api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "d"}]
        async with ac.messages.stream(model=gw.model_name, max_tokens=16, messages=msgs) as st:  # type: ignore[arg-type]
            final = await st.get_final_message()
        await ac.close()
        assert final.usage.input_tokens == len(client.calls[1][0].input_ids)


async def test_gateway_turns_ask_the_engine_to_keep_their_sessions_kv(fake_servers, tok) -> None:
    """Issue 40: the gateway sees a session's turns; each asks the engine to keep its KV while the agent
    runs its tools (``GatewayConfig.keep_kv_s``), under the session's id."""
    script = Script(tok, ["Kept."])
    async with gateway_on(fake_servers, tok, script, keep_kv_s=45.0) as (gw, client):
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        await oa.chat.completions.create(model=gw.model_name, messages=[{"role": "user", "content": "a"}])
        await oa.close()
    [(req, _)] = client.calls
    assert req.keep_kv_s == 45.0 and req.session_id == s.id
    from rollout_sdk.errors import ConfigError
    from rollout_sdk.gateway import GatewayConfig

    with pytest.raises(ConfigError, match="keep_kv_s"):
        GatewayConfig(keep_kv_s=0)
