"""The call ids the gateway hands out (issue 42): a format whose template writes ids back gets the ids the
model wrote (Kimi-K2's ``functions.f:IDX``, Mistral's ``"id"``), a format whose template constrains them
gets that form counted over the session (Mistral's nine characters: ``call00000``, ``call00001``, ...,
never starting again at ``call00000`` on the next turn), every other format ``call_<session>_<n>``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk.gateway import Gateway
from test_gateway import Script, call, gateway_on


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from rollout_sdk.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
# Mistral's templates (7B v0.3, Mixtral, Nemo) refuse any other id, in these words
NINE = (
    "{%- for m in messages %}{%- for c in (m.tool_calls or []) %}"
    "{%- if c.id is not defined or c.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{%- endfor %}{%- endfor %}"
)


def mistral(calls: list[tuple[str, dict[str, Any]]], ids: list[str] | None = None) -> str:
    items = [{"name": n, "arguments": a, **({"id": ids[i]} if ids else {})} for i, (n, a) in enumerate(calls)]
    return "[TOOL_CALLS] " + json.dumps(items)


def kimi(calls: list[tuple[str, int]]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{{}}<|tool_call_end|>" for n, i in calls
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


async def conversation(gw: Gateway, turns: int) -> list[list[str]]:
    """Run ``turns`` assistant turns, answering every call; return each turn's call ids as served."""
    s = gw.session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    served: list[list[str]] = []
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0) as oa:
        for _ in range(turns):
            r = await oa.chat.completions.create(model=gw.model_name, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            msg = r.choices[0].message
            calls = msg.tool_calls or []
            served.append([c.id for c in calls])
            messages.append(msg.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
    # every later turn continued the recorded conversation (the re-sent ids matched): one branch
    gw.reward(s.id, 0.0)
    [traj] = gw.session_record(s.id).trajectories
    assert len(traj.turns) == turns
    return served


async def test_mistral_ids_count_over_the_session_and_satisfy_its_template(fake_servers, tok, tiny_model) -> None:
    from rollout_sdk.models import load_tokenizer

    strict = load_tokenizer(str(tiny_model))
    strict.chat_template = NINE + tok.chat_template  # the tiny model's template with Mistral's id check
    turns = [mistral([("f", {}), ("g", {})]), mistral([("f", {"a": 1})]), "done"]
    async with gateway_on(fake_servers, strict, Script(tok, turns), parser="mistral") as (gw, _):
        served = await conversation(gw, 3)
    # before issue 42's fix these were call_<session>_<n>, which this template refuses on the next turn
    assert served == [["call00000", "call00001"], ["call00002"], []]
    assert all(len(i) == 9 and i.isalnum() for ids in served for i in ids)


async def test_ids_the_model_writes_are_kept_as_written(fake_servers, tok) -> None:
    given = mistral([("f", {}), ("g", {})], ids=["abc123XYZ", "def456UVW"])
    compact = "[TOOL_CALLS]f[CALL_ID]zz9zz9zz9[ARGS]{}[TOOL_CALLS]g[ARGS]{}"
    async with gateway_on(fake_servers, tok, Script(tok, [given, compact, "done"]), parser="mistral") as (gw, _):
        served = await conversation(gw, 3)
    # the model's ids as written; the one it left out counts the session's generated ids from 0
    assert served == [["abc123XYZ", "def456UVW"], ["zz9zz9zz9", "call00000"], []]
    turns = [kimi([("f", 0), ("g", 1)]), kimi([("f", 2)]), "done"]
    async with gateway_on(fake_servers, tok, Script(tok, turns), parser="kimi_k2") as (gw, _):
        served = await conversation(gw, 3)
    # Kimi's template writes each id back (<|tool_call_begin|>{{ id }}): the model's own, every turn
    assert served == [["functions.f:0", "functions.g:1"], ["functions.f:2"], []]


async def test_other_formats_keep_session_unique_gateway_ids(fake_servers, tok) -> None:
    turns = [call("f") + "\n" + call("g"), call("f"), "done"]
    async with gateway_on(fake_servers, tok, Script(tok, turns)) as (gw, _):
        s_ids = await conversation(gw, 3)
    flat = [i for ids in s_ids for i in ids]
    assert len(flat) == len(set(flat)) == 3
    assert all(i.startswith("call_") and i.endswith(f"_{n}") for n, i in enumerate(flat))


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(["hermes", "mistral", "kimi_k2", "qwen3_coder", "deepseek_v31"]),
    turns=st.lists(st.lists(st.one_of(st.none(), st.text(min_size=1, max_size=12)), max_size=4), max_size=8),
)
def test_generated_ids_never_repeat_in_a_session_and_written_ones_are_kept(fmt: str, turns: list[Any]) -> None:
    """Any mix of turns, each with calls whose id the model wrote (a string) or not (None)."""
    from rollout_sdk.agents.parsers import ToolCall, get_parser
    from rollout_sdk.gateway.sessions import Session

    parser = get_parser(fmt)
    session = Session("s" * 20, max_turns=100)
    generated: list[str] = []
    for turn in turns:
        calls = [ToolCall("f", {}, id=w or "call_0", id_in_text=w is not None) for w in turn]
        ids = session.new_call_ids(calls, parser)
        assert len(ids) == len(calls)
        for written, cid in zip(turn, ids, strict=True):
            if written is not None:
                assert cid == written
            else:
                generated.append(cid)
                assert len(cid) == 9 and cid.isalnum() if fmt == "mistral" else cid.startswith("call_sssss")
    assert len(generated) == len(set(generated))
