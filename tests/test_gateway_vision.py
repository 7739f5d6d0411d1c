"""The gateway's OpenAI ``image_url`` content parts (data URLs) on the tiny VL model: the images reach the
engine with the prompt's marks, the recorded trajectory holds the exact expanded ids and the images, and a
remote URL is a 400 (nothing is fetched)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import openai
import pytest

from rollout_sdk import CpuEngineConfig
from rollout_sdk.gateway import Gateway
from rollout_sdk.models.tiny_vl import noise_png
from rollout_sdk.models.vision import IMAGE_PAD_ID
from test_gateway import RecordingClient


def part(png: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


@pytest.fixture(scope="module")
def vl_model(sdk_home: Path) -> Path:
    from rollout_sdk.models import ensure_tiny_vl_model

    return ensure_tiny_vl_model(sdk_home)


async def test_image_url_parts_reach_the_model_and_are_recorded_exactly(vl_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_model))
    one, two = noise_png(56, 56, 1), noise_png(28, 56, 2)
    client = RecordingClient(engine=CpuEngineConfig(model_path=str(vl_model)))
    async with client, Gateway(client, tokenizer=tok) as gw:
        s = gw.session()
        oa = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": [part(one), {"type": "text", "text": "What is this?"}]}]
        r1 = await oa.chat.completions.create(model=gw.model_name, messages=msgs, max_tokens=4, seed=1)
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": [{"type": "text", "text": "And this?"}, part(two)]},
        ]
        await oa.chat.completions.create(model=gw.model_name, messages=msgs, max_tokens=4, seed=2)
        # nothing is fetched: a remote URL is refused with a clear 400
        remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]
        with pytest.raises(openai.BadRequestError) as info:
            await oa.chat.completions.create(model=gw.model_name, messages=remote, max_tokens=4)
        assert "data URL" in str(info.value) and "nothing is fetched" in str(info.value)
        broken = [{"role": "user", "content": [part(b"not an image")]}]
        with pytest.raises(openai.BadRequestError) as info:
            await oa.chat.completions.create(model=gw.model_name, messages=broken, max_tokens=4)
        assert "images[0]" in str(info.value)
        await oa.close()
        gw.finish(s.id, reward=1.0)
        async for traj in gw.trajectories():
            break
    (req1, res1), (req2, res2) = [c for c in client.calls if c[0].session_id == s.id]
    assert req1.images == [one] and req2.images == [one, two]
    assert res1.image_grid_thw == [(1, 4, 4)] and res2.image_grid_thw == [(1, 4, 4), (1, 4, 2)]
    # the second prompt continues the first turn's expanded ids exactly
    assert res1.input_ids is not None and res2.input_ids is not None
    assert res2.input_ids[: len(res1.input_ids) + len(res1.output_ids)] == res1.input_ids + res1.output_ids
    assert traj.images == [one, two]
    assert traj.ids == res2.input_ids + res2.output_ids
    assert traj.image_spans == res2.image_spans
    assert [traj.ids[a : a + n] for a, n in traj.image_spans] == [[IMAGE_PAD_ID] * 4, [IMAGE_PAD_ID] * 2]
    model = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    assert model == res1.output_ids + res2.output_ids


def test_tool_results_may_hold_images_and_keys_compare_image_digests() -> None:
    from rollout_sdk.gateway.errors import GatewayError
    from rollout_sdk.gateway.tools import canonical, template_messages

    png = noise_png(28, 28, 3)
    msgs = [
        {"role": "user", "content": "take a screenshot"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "function": {"name": "shot", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": [part(png), {"type": "text", "text": "done"}]},
    ]
    out = template_messages(msgs, max_messages=8)
    assert out[2]["content"] == [{"type": "image", "image": png}, {"type": "text", "text": "done"}]
    again = template_messages(msgs, max_messages=8)
    other = template_messages([*msgs[:2], {**msgs[2], "content": [part(noise_png(28, 28, 4))]}], max_messages=8)
    assert canonical(out[2]) == canonical(again[2]) != canonical(other[2])
    assert "sha256:" in canonical(out[2])
    # an assistant message's image part is not accepted (the model writes text)
    bad = [msgs[0], {"role": "assistant", "content": [part(png)]}]
    with pytest.raises(GatewayError) as info:
        template_messages(bad, max_messages=8)
    assert info.value.status == 400
    for url in ("data:image/png;base64,@@@", "file:///etc/passwd", "data:text/plain;base64,aGk="):
        msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(GatewayError) as info:
            template_messages(msg, max_messages=8)
        assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"
