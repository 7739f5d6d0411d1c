"""What the framework tests on the CPU tool model share (LangGraph, litellm): a gateway on the tool model,
and the check that a two-turn tool loop was recorded as exact tokens with its rewards.

A helper module, not a test module: a test imports the fixture (``from tool_model_gateway import env``)
and the check."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio

from rollout_sdk import CpuEngineConfig, RolloutClient
from rollout_sdk.agents import ChatTemplate
from rollout_sdk.gateway import Gateway, SessionHandle
from rollout_sdk.tasks import calculator as calc

TOOLS = calc.make_registry().schemas()  # the tool exactly as the model was trained on it


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tool_model: Path) -> AsyncIterator[tuple[Gateway, Any]]:
    from rollout_sdk.models import load_tokenizer

    async with RolloutClient(engine=CpuEngineConfig(model_path=str(tool_model), seed=0)) as client:
        async with Gateway(client, model_name="tool-model") as gw:
            yield gw, load_tokenizer(str(tool_model))


def check_tool_loop_recorded(gw: Gateway, s: SessionHandle, tok: Any, *, sampled_logprobs: bool = False) -> None:
    """Reward turn 0 and the session, then check its one trajectory: a fresh rendering of its messages
    gives its tokens (no drift), the mask and logprobs line up over two turns, the rewards land where
    they were given; ``sampled_logprobs``: some model token also has a logprob below 0."""
    gw.turn_reward(s.id, 0.25, turn=0)
    gw.reward(s.id, 1.0)
    [t] = gw.session_record(s.id).trajectories
    report = ChatTemplate(tok, tools=TOOLS).check_drift(
        t.messages, t.ids, loss_mask=t.loss_mask, prompt_len=len(t.prompt_ids)
    )
    assert report.ok, str(report)
    assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs) and len(t.turns) == 2
    assert sum(t.loss_mask) == sum(u.model_tokens for u in t.turns)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 0)
    if sampled_logprobs:
        assert any(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m == 1)
    assert t.reward == 1.0 and [u.reward for u in t.turns] == [0.25, None]
