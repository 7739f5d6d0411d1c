"""GPU tier, vision-language: the tiny Qwen2.5-VL-shaped model (``rollout-sdk make-model tiny-vl``, real
safetensors weights) on SGLang behind a real server.  Needs a GPU and sglang; skipped elsewhere.  Run on the
device machine: ``pytest tests/gpu/test_sglang_vision.py -m gpu -s`` (it prints the parity figures for
docs/benchmarks.md).

What it shows (issue 28):

* the SDK's ids are SGLang's: SGLang takes the SDK's expanded ids as they are (``processor_output``
  images), and its own expansion of the same prompt (raw image bytes, SGLang's processor) has as many image
  tokens per image;
* the logprob gap between SGLang (bf16) and a transformers forward of the same weights on the same ids and
  pixels (fp32) is within bf16 noise, and two images give different logprobs.

``ROLLOUT_SDK_GPU_VL_MODEL`` points it at another Qwen2.5-VL model directory instead of the tiny one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rollout_sdk import EngineServer, RolloutClient, SamplingParams, ServerConfig
from rollout_sdk.models.tiny_vl import noise_png
from rollout_sdk.models.vision import IMAGE_PAD_ID, load_image_processor
from rollout_sdk.protocol import GenerateRequest, GenerateResult

ASYNC = pytest.mark.asyncio(loop_scope="module")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]

MARK = [151652, IMAGE_PAD_ID, 151653]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("ROLLOUT_SDK_GPU_VL_MODEL")
    if given:
        return Path(given)
    from rollout_sdk.models import ensure_tiny_vl_model

    home = os.environ.get("ROLLOUT_SDK_TEST_HOME") or str(tmp_path_factory.mktemp("sdk_home"))
    return ensure_tiny_vl_model(home)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def vl_client(vl_dir: Path) -> AsyncIterator[RolloutClient]:
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig

    cfg = SglangEngineConfig(
        model_path=str(vl_dir),
        attention_backend="triton",
        sampling_backend="pytorch",
        mem_fraction_static=0.5,
        cuda_graph_max_bs=16,
        random_seed=0,
        dtype="bfloat16",
        extra={"mm_attention_backend": "sdpa"},  # the tiny vision tower's 16-wide heads: the plainest kernel
    )
    async with (
        EngineServer(SglangEngine(cfg), ServerConfig()) as server,
        RolloutClient(servers=[server.address]) as client,
    ):
        yield client


def _prompt(vl_dir: Path, n_images: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_dir))
    parts: list[dict[str, Any]] = [{"type": "image"}] * n_images + [{"type": "text", "text": "Describe it."}]
    out = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _reference(vl_dir: Path, result: GenerateResult, images: list[bytes]) -> list[float]:
    """transformers, fp32 on the GPU: logprobs of the result's output tokens given its ids and pixels."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(vl_dir), dtype=torch.float32).cuda().eval()
    proc = load_image_processor(vl_dir)
    assert proc is not None and result.input_ids is not None
    pixels, grids = proc.process(images)
    full = torch.tensor([result.input_ids + result.output_ids]).cuda()
    types = torch.zeros_like(full, dtype=torch.int)
    for start, n in result.image_spans:
        types[0, start : start + n] = 1
    with torch.no_grad():
        logits = model(
            input_ids=full,
            pixel_values=pixels.cuda(),
            image_grid_thw=torch.tensor(grids).cuda(),
            mm_token_type_ids=types,
        ).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    n = len(result.input_ids)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(result.output_ids)]


@ASYNC
async def test_sdk_ids_and_sglang_parity(vl_client: RolloutClient, vl_dir: Path) -> None:
    ids = _prompt(vl_dir, 2)
    images = [noise_png(56, 56, 1), noise_png(56, 28, 2)]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    r = await vl_client.generate(GenerateRequest(input_ids=ids, images=images, sampling=sp))
    proc = load_image_processor(vl_dir)
    assert proc is not None
    assert r.input_ids == proc.expand(ids, images).input_ids
    assert [r.input_ids[s : s + n] for s, n in r.image_spans] == [[IMAGE_PAD_ID] * n for _, n in r.image_spans]
    ref = await asyncio.to_thread(_reference, vl_dir, r, images)
    assert r.logprobs is not None
    diffs = [abs(a - b) for a, b in zip(r.logprobs, ref, strict=True)]
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"\nVL parity (SGLang bf16 vs transformers fp32, {len(diffs)} tokens): mean |d| {mean:.4f}, max {worst:.4f}")
    assert mean <= 0.05  # bf16 noise on a random-weight model's near-uniform logprobs


@ASYNC
async def test_two_images_differ_on_sglang(vl_client: RolloutClient, vl_dir: Path) -> None:
    ids = _prompt(vl_dir, 1)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    a = await vl_client.generate(GenerateRequest(input_ids=ids, images=[noise_png(56, 56, 3)], sampling=sp))
    b = await vl_client.generate(GenerateRequest(input_ids=ids, images=[noise_png(56, 56, 4)], sampling=sp))
    assert a.logprobs is not None and b.logprobs is not None
    print(f"\nVL image sensitivity: max |d logprob| {max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)):.4f}")
    assert a.logprobs != b.logprobs


@ASYNC
async def test_score_with_images_on_sglang(vl_client: RolloutClient, vl_dir: Path) -> None:
    """score_only with images: the generated sequence scored again (its marks already expanded) gives back
    its own sampling logprobs at the output positions, with the same image spans."""
    ids = _prompt(vl_dir, 1)
    images = [noise_png(56, 56, 5)]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    r = await vl_client.generate(GenerateRequest(input_ids=ids, images=images, sampling=sp))
    assert r.input_ids is not None and r.logprobs is not None
    s = await vl_client.generate(GenerateRequest(input_ids=r.input_ids + r.output_ids, images=images, score_only=True))
    assert s.image_spans == r.image_spans and s.prompt_logprobs is not None
    assert len(s.prompt_logprobs) == len(r.input_ids) + len(r.output_ids) - 1
    diffs = [abs(a - b) for a, b in zip(s.prompt_logprobs[-len(r.output_ids) :], r.logprobs, strict=True)]
    print(f"\nVL score vs sampling logprobs on SGLang: max |d| {max(diffs):.4f}")
    assert max(diffs) <= 0.1  # the same bf16 engine: prefill vs decode kernels


def test_sglang_own_expansion_has_the_same_image_tokens(vl_dir: Path) -> None:
    """SGLang's own processor on the raw bytes (its decode/tokenize path, off our server) expands each image
    into as many tokens as the SDK does: the same prompt length, the same ids outside the images (SGLang
    reports image positions under its own pad values)."""
    import sglang as sgl

    ids = _prompt(vl_dir, 2)
    images = [noise_png(56, 56, 5), noise_png(28, 56, 6)]
    proc = load_image_processor(vl_dir)
    assert proc is not None
    ours = proc.expand(ids, images)
    engine = sgl.Engine(
        model_path=str(vl_dir),
        attention_backend="triton",
        mm_attention_backend="sdpa",
        mem_fraction_static=0.3,
        random_seed=0,
    )
    try:
        out = engine.generate(
            input_ids=ids, image_data=images, sampling_params={"max_new_tokens": 1}, return_logprob=True,
            logprob_start_len=0,
        )  # fmt: skip
    finally:
        engine.shutdown()
    got = [t for _, t, _ in out["meta_info"]["input_token_logprobs"]]
    print(f"\nSGLang's own expansion: {len(got)} prompt tokens, the SDK's: {len(ours.input_ids)}")
    assert len(got) == len(ours.input_ids)
    inside = {i for s, n in ours.spans for i in range(s, s + n)}
    assert [t for i, t in enumerate(got) if i not in inside] == [
        t for i, t in enumerate(ours.input_ids) if i not in inside
    ]
