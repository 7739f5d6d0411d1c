"""The gateway's per-request tool parser (issue 42 item 4: ``qwen3_coder`` values typed by the request's
tools) and its sessions' KV kept through tool waits (issue 40), against the real openai client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
