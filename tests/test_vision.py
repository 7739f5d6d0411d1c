"""Vision-language requests on CPU: the tiny Qwen2.5-VL-shaped model, image marks expanded by the SDK,
exact ids and spans, multimodal RoPE across decode steps, and parity with a transformers forward."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from rollout_sdk.agents import AgentConfig, RolloutContext, ToolAgent, ToolImage, ToolRegistry
from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.errors import InvalidRequestError
from rollout_sdk.models.tiny_vl import noise_png
from rollout_sdk.models.vision import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, load_image_processor
from rollout_sdk.protocol import (
    MAX_IMAGES,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    decode_client_message,
    decode_server_message,
    encode,
)

ASYNC = pytest.mark.asyncio(loop_scope="module")

MARK = [VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def reference_logprobs(model: object, result: GenerateResult, images: list[bytes], model_dir: Path) -> list[float]:
    """What a trainer computes: one transformers forward of the same model over the result's ids and the
    images' pixels (the SDK's processor: ImageProcessor.model_inputs), fp32, transformers' multimodal path."""
    proc = load_image_processor(model_dir)
    assert proc is not None and result.input_ids is not None
    inputs = proc.model_inputs(result.input_ids + result.output_ids, images, result.image_spans)
    with torch.no_grad():
        logits = model(**inputs).logits[0]  # type: ignore[operator]
    lp = torch.log_softmax(logits.float(), dim=-1)
    n = len(result.input_ids)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(result.output_ids)]


@pytest.fixture(scope="module")
def vl_model(sdk_home: Path) -> Path:
    from rollout_sdk.models import ensure_tiny_vl_model

    return ensure_tiny_vl_model(sdk_home)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(vl_model: Path) -> AsyncIterator[CpuEngine]:
    e = CpuEngine(CpuEngineConfig(model_path=str(vl_model), max_running=16))
    await e.start()
    yield e
    await e.close()


# -- the model and the expansion ---------------------------------------------------------------------


def test_make_model_tiny_vl(vl_model: Path, sdk_home: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollout_sdk", "make-model", "tiny-vl", "--home", str(sdk_home)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert Path(out.stdout.strip()) == vl_model
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        assert (vl_model / name).exists()
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(vl_model))
    assert cfg.model_type == "qwen2_5_vl" and cfg.image_token_id == IMAGE_PAD_ID
    assert cfg.vision_config.depth == 2 and cfg.vision_config.spatial_merge_size == 2
    tok = AutoTokenizer.from_pretrained(str(vl_model))
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]) == MARK


def test_tiny_vl_weights_use_the_released_checkpoint_names(vl_model: Path) -> None:
    """SGLang's Qwen2.5-VL loader knows only the released checkpoints' weight names (it raised KeyError on
    transformers 5's ``model.language_model.*`` on the H200); transformers loads them into its modules."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    with safe_open(str(vl_model / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    assert {k.split(".")[0] for k in stored} == {"model", "visual"}
    assert not [k for k in stored if k.startswith(("model.language_model.", "model.visual."))]
    assert {"model.embed_tokens.weight", "visual.patch_embed.proj.weight", "visual.merger.mlp.0.weight"} <= set(stored)
    model = AutoModelForImageTextToText.from_pretrained(str(vl_model), dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in stored.items():
        module = "model.language_model." + name[6:] if name.startswith("model.") else "model." + name
        assert torch.equal(state[module], tensor), name


def test_expansion_ids_and_spans_are_exact(vl_model: Path) -> None:
    proc = load_image_processor(vl_model)
    assert proc is not None
    big, small, wide = noise_png(56, 56, 1), noise_png(28, 28, 2), noise_png(56, 28, 3)
    ids = [10, 11, *MARK, 12, *MARK, *MARK, 13]
    v = proc.expand(ids, [big, small, wide])
    # 56x56 -> 4x4 patches of 14 -> 4 tokens after the 2x2 merge; 28x28 -> 1; 56x28 (w x h) -> 2x4 -> 2
    assert v.grid_thw == [(1, 4, 4), (1, 2, 2), (1, 2, 4)]
    pad = IMAGE_PAD_ID
    s, e = VISION_START_ID, VISION_END_ID
    assert v.input_ids == [10, 11, s, pad, pad, pad, pad, e, 12, s, pad, e, s, pad, pad, e, 13]
    assert v.spans == [(3, 4), (10, 1), (13, 2)]
    assert v.pixel_values.shape == (16 + 4 + 8, 3 * 2 * 14 * 14)
    # a multi-turn request resends expanded marks with their images: kept as they are
    again = proc.expand([*v.input_ids, *MARK], [big, small, wide, small])
    assert again.input_ids == [*v.input_ids, s, pad, e]
    assert again.spans == [*v.spans, (len(v.input_ids) + 1, 1)]


@pytest.mark.parametrize(
    ("ids", "images", "field", "words"),
    [
        ([1, *MARK, *MARK], [b"png?", None], "images[0]", "not a readable image"),
        ([1, *MARK], [None, None], "images", "marks 1 image"),
        ([1, IMAGE_PAD_ID, 2], [], "input_ids[1]", "outside"),
        ([1, VISION_START_ID, IMAGE_PAD_ID, IMAGE_PAD_ID, VISION_END_ID], [None], "images[0]", "must be 1"),
    ],
)
def test_bad_images_are_typed_errors_naming_the_field(
    vl_model: Path, ids: list[int], images: list[bytes | None], field: str, words: str
) -> None:
    proc = load_image_processor(vl_model)
    assert proc is not None
    good = noise_png(56, 56, 0)
    with pytest.raises(InvalidRequestError) as info:
        proc.expand(ids, [good if b is None else b for b in images])
    assert info.value.field == field
    assert words in info.value.reason


def test_truncated_and_oversized_images_are_refused(vl_model: Path) -> None:
    from rollout_sdk.models.vision import decode_image

    good = noise_png(56, 56, 0)
    with pytest.raises(InvalidRequestError) as info:
        decode_image(good[: len(good) // 2], "images[3]")
    assert info.value.field == "images[3]"
    # a decompression bomb: a tiny file whose header claims 5000 x 5000 pixels (under Pillow's own bound, over ours)
    buf = io.BytesIO()
    Image.new("1", (5000, 5000)).save(buf, "PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(InvalidRequestError, match="more than") as info:
        decode_image(buf.getvalue(), "images[0]")
    assert info.value.field == "images[0]"


def test_images_on_the_wire_are_bounded_and_round_trip() -> None:
    img = noise_png(28, 28, 0)
    req = GenerateRequest(input_ids=[1, *MARK], images=[img])
    back = decode_client_message(encode(req))
    assert isinstance(back, GenerateRequest) and back.images == [img]
    res = GenerateResult(
        rid="r", output_ids=[1], finish_reason="stop", prompt_tokens=4, input_ids=[1, *MARK],
        image_spans=[(2, 1)], image_grid_thw=[(1, 2, 2)],
    )  # fmt: skip
    assert decode_server_message(encode(res)) == res
    # too many images: a typed error naming the field, from user code and from the wire
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest(input_ids=[1], images=[img] * (MAX_IMAGES + 1))
    assert info.value.field == "images"
    raw = msgspec.msgpack.encode({"type": "generate", "input_ids": [1], "images": [img] * (MAX_IMAGES + 1)})
    with pytest.raises(InvalidRequestError) as info:
        decode_client_message(raw)
    assert info.value.field == "images"
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest(input_ids=[1], images=[img, b""])
    assert info.value.field == "images[1]"


# -- the CPU engine ----------------------------------------------------------------------------------


def _prompt(vl_model: Path, n_images: int = 1) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_model))
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    out = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


@ASYNC
async def test_rollout_logprobs_match_a_transformers_forward(engine: CpuEngine, vl_model: Path) -> None:
    """Trainer parity (fp32): the engine's logprobs (prefill with images, then decode steps with the rope
    delta carried) against one transformers forward over the same ids and pixels."""
    ids = _prompt(vl_model, 2)
    images = [noise_png(56, 56, 11), noise_png(56, 28, 12)]
    sampling = SamplingParams(max_new_tokens=8, seed=3, ignore_eos=True)
    r = await engine.generate(GenerateRequest(input_ids=ids, images=images, rid="parity", sampling=sampling))
    assert r.input_ids is not None and r.prompt_tokens == len(r.input_ids) == len(ids) - 2 + 4 + 2
    assert [r.input_ids[s : s + n] for s, n in r.image_spans] == [[IMAGE_PAD_ID] * 4, [IMAGE_PAD_ID] * 2]
    assert r.image_grid_thw == [(1, 4, 4), (1, 2, 4)]
    ref = reference_logprobs(engine.model, r, images, vl_model)
    assert r.logprobs is not None
    diffs = [abs(a - b) for a, b in zip(r.logprobs, ref, strict=True)]
    assert sum(diffs) / len(diffs) <= 1e-5, diffs
    # scoring the same sequence gives the same logprobs for the output tokens
    full = [*r.input_ids, *r.output_ids]
    scored = await engine.generate(GenerateRequest(input_ids=full, images=images, rid="score", score_only=True))
    assert scored.prompt_logprobs is not None and scored.input_ids == full
    tail = scored.prompt_logprobs[len(r.input_ids) - 1 :]
    assert max(abs(a - b) for a, b in zip(tail, ref, strict=True)) <= 1e-4


@ASYNC
async def test_two_images_give_different_logprobs(engine: CpuEngine, vl_model: Path) -> None:
    """The model sees the image: the same text, two images, other logprobs (far beyond float noise)."""
    ids = _prompt(vl_model)
    a = await engine.generate(GenerateRequest(input_ids=ids, images=[noise_png(56, 56, 1)], rid="i1", sampling=GREEDY))
    b = await engine.generate(GenerateRequest(input_ids=ids, images=[noise_png(56, 56, 2)], rid="i2", sampling=GREEDY))
    same = await engine.generate(
        GenerateRequest(input_ids=ids, images=[noise_png(56, 56, 1)], rid="i3", sampling=GREEDY)
    )
    assert a.logprobs is not None and b.logprobs is not None
    assert same.logprobs == a.logprobs
    assert a.input_ids == b.input_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=False)) > 1e-4


@ASYNC
async def test_image_and_text_rows_batched_equal_alone(engine: CpuEngine, vl_model: Path) -> None:
    """Image rows and text rows share one batch (left-padded prefill, 3D and 1D positions side by side)
    and decode exactly as alone."""
    ids = _prompt(vl_model)
    reqs = [
        GenerateRequest(input_ids=ids, images=[noise_png(56, 56, 5)], rid="v0", sampling=GREEDY),
        GenerateRequest(input_ids=[5, 6, 7, 8], rid="t0", sampling=GREEDY),
        GenerateRequest(input_ids=[*ids, 9, 9], images=[noise_png(28, 56, 6)], rid="v1", sampling=GREEDY),
    ]
    alone = [await engine.generate(msgspec.structs.replace(q, rid=q.rid + "a")) for q in reqs]
    together = await asyncio.gather(*(engine.generate(q) for q in reqs))
    for x, y in zip(alone, together, strict=True):
        assert x.output_ids == y.output_ids
        assert x.logprobs is not None and y.logprobs is not None
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-5


@ASYNC
async def test_a_retracted_image_row_continues_exactly(engine: CpuEngine, vl_model: Path) -> None:
    """pause('retract') drops the row's KV; it re-prefills prompt + tokens so far with its images (positions
    recomputed: the rope delta is the same) and continues token for token as if never interrupted."""
    ids = _prompt(vl_model)
    sp = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, presence_penalty=2.0)
    img = [noise_png(56, 28, 41)]
    want = await engine.generate(GenerateRequest(input_ids=ids, images=img, rid="w", sampling=sp))
    task = asyncio.create_task(engine.generate(GenerateRequest(input_ids=ids, images=img, rid="x", sampling=sp)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while not (engine._scheduler.seqs.get("x") and len(engine._scheduler.seqs["x"].out) >= 3):
        assert loop.time() < deadline and not task.done()
        await asyncio.sleep(0.001)
    await engine.pause("retract")
    held = len(engine._scheduler.seqs["x"].out)
    await engine.resume()
    got = await task
    assert 3 <= held < sp.max_new_tokens
    assert got.output_ids == want.output_ids and got.input_ids == want.input_ids
    assert got.logprobs is not None and want.logprobs is not None
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= 1e-5


@ASYNC
async def test_bad_image_fails_alone(engine: CpuEngine, vl_model: Path) -> None:
    ids = _prompt(vl_model, 2)
    bad = GenerateRequest(input_ids=ids, images=[noise_png(28, 28, 0), b"\x89PNG broken"], rid="bad")
    good = GenerateRequest(input_ids=ids[:-3] + ids[-3:], images=[noise_png(28, 28, 0)] * 2, rid="ok", sampling=GREEDY)
    results = await asyncio.gather(engine.generate(bad), engine.generate(good), return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and results[0].field == "images[1]"
    assert isinstance(results[1], GenerateResult) and len(results[1].output_ids) == GREEDY.max_new_tokens


# -- agents: a tool that returns a screenshot ----------------------------------------------------------


class ScriptedFirstTurn:
    """A Generator over the real engine whose first turn is scripted text (a tool call) scored by the
    engine on the request's images (the engine expands them: real ids, spans and logprobs); later turns are
    the engine's own generations."""

    def __init__(self, engine: CpuEngine, first: list[int]) -> None:
        self.engine = engine
        self.first = first
        self.requests: list[GenerateRequest] = []
        self.weight_version = 0

    async def generate(self, request: GenerateRequest, /, *, timeout: object = None) -> GenerateResult:
        self.requests.append(request)
        if len(self.requests) > 1:
            return await self.engine.generate(request)
        full = [*request.input_ids, *self.first]
        scored = await self.engine.generate(
            msgspec.structs.replace(request, input_ids=full, score_only=True, rid=request.rid + ".s")
        )
        assert scored.input_ids is not None and scored.prompt_logprobs is not None
        n = len(scored.input_ids) - len(self.first)
        return GenerateResult(
            rid=request.rid, output_ids=list(self.first), finish_reason="stop", prompt_tokens=n,
            logprobs=scored.prompt_logprobs[n - 1 :], input_ids=scored.input_ids[:n],
            image_spans=scored.image_spans, image_grid_thw=scored.image_grid_thw,
        )  # fmt: skip

    def abort(self, rid: str) -> bool:
        return False

    def server_info(self) -> list[object]:
        return []


@ASYNC
async def test_agent_with_a_screenshot_tool(engine: CpuEngine, vl_model: Path) -> None:
    """Multi-turn: the prompt holds an image, the model calls a screenshot tool, the PNG it returns reaches
    the model as image tokens inside the tool result (mask off), and the model's next turn is computed on
    it: its logprobs equal a transformers forward over the trajectory's ids and both images."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_model))
    photo, shot = noise_png(56, 56, 21), noise_png(56, 28, 22)
    registry = ToolRegistry()

    @registry.register
    async def screenshot(region: str) -> ToolImage:
        "Take a screenshot of a region of the screen."
        return ToolImage(shot, text=f"screenshot of {region}")

    call = '<tool_call>\n{"name": "screenshot", "arguments": {"region": "top"}}\n</tool_call>'
    first = [*tok.encode(call, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    gen = ScriptedFirstTurn(engine, first)
    cfg = AgentConfig(max_turns=2, max_new_tokens=5, max_context_tokens=4096, sampling=SamplingParams(seed=9))
    agent = ToolAgent(tok, registry, cfg)
    content = [{"type": "image", "image": photo}, {"type": "text", "text": "Hi"}]
    sample = {"messages": [{"role": "user", "content": content}]}
    traj = await agent.run(RolloutContext(gen), sample)  # type: ignore[arg-type]

    assert [t.tool_calls[0].ok for t in traj.turns[:1]] == [True]
    assert traj.images == [photo, shot]
    assert gen.requests[1].images == [photo, shot]  # the second turn sends both images
    ids = traj.ids
    assert traj.image_grid_thw == [(1, 4, 4), (1, 2, 4)]
    (p0, n0), (p1, n1) = traj.image_spans
    assert (n0, n1) == (4, 2)
    assert ids[p0 - 1 : p0 + n0 + 1] == [VISION_START_ID, *[IMAGE_PAD_ID] * 4, VISION_END_ID]
    assert ids[p1 - 1 : p1 + n1 + 1] == [VISION_START_ID, *[IMAGE_PAD_ID] * 2, VISION_END_ID]
    assert p0 + n0 < len(traj.prompt_ids) <= p1  # the photo in the prompt, the screenshot in the response
    # the screenshot sits inside the tool result block, with the loss mask off
    text = tok.decode(ids)
    assert "<tool_response>\n<|vision_start|><|image_pad|><|image_pad|><|vision_end|>screenshot of top" in text
    off = len(traj.prompt_ids)
    assert len(traj.loss_mask) == len(traj.response_ids) == len(traj.logprobs)
    assert traj.loss_mask[: len(first)] == [1] * len(first)
    assert all(traj.loss_mask[i - off] == 0 for i in range(p1 - 1, p1 + n1 + 1))
    # the model's second turn saw the screenshot: its logprobs are those of a forward over ids + both images
    second = [i for i, m in enumerate(traj.loss_mask) if m][len(first) :]
    assert second and second[0] > p1 - off
    result = GenerateResult(
        rid="t", output_ids=ids[off + second[0] :], finish_reason="stop", prompt_tokens=off + second[0],
        input_ids=ids[: off + second[0]], image_spans=traj.image_spans,
    )  # fmt: skip
    ref = reference_logprobs(engine.model, result, traj.images, vl_model)
    got = [traj.logprobs[i] for i in second]
    assert max(abs(a - b) for a, b in zip(got, ref[: len(got)], strict=True)) <= 1e-5


# -- the SGLang engine's translation (on CPU, against a stand-in for SGLang's tokenizer manager) --------


class RecordingTokenizerManager:
    """Keeps every GenerateReqInput; answers with ``n`` tokens."""

    def __init__(self) -> None:
        self.submitted: list[Any] = []

    async def generate_request(self, obj: Any, _request: Any) -> Any:
        self.submitted.append(obj)
        n = obj.sampling_params["max_new_tokens"]
        yield {
            "output_ids": list(range(100, 100 + n)),
            "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 0, None)] * n},
        }


@ASYNC
async def test_sglang_request_carries_the_sdks_expansion(
    vl_model: Path, engine: CpuEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SGLang engine sends the SDK's expanded ids and the processor's outputs as one ``processor_output``
    image item (sglang 0.5.16's preprocessed path: ids taken as they are); the result reports the same ids,
    spans and grids as the CPU engine's."""
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
    from rollout_sdk.protocol import EngineLimits

    sgl = SglangEngine(SglangEngineConfig(model_path=str(vl_model)))
    tm = RecordingTokenizerManager()
    sgl._tm = tm
    sgl._limits = EngineLimits(vocab_size=151936, max_context=4096, eos_token_ids=[151645])
    ids = _prompt(vl_model, 2)
    images = [noise_png(56, 56, 31), noise_png(28, 28, 32)]
    req = GenerateRequest(input_ids=ids, images=images, rid="g", sampling=SamplingParams(max_new_tokens=3))
    got = await sgl.generate(req)
    cpu = await engine.generate(msgspec.structs.replace(req, rid="c"))
    [obj] = tm.submitted
    assert obj.input_ids == cpu.input_ids == got.input_ids
    [item] = obj.image_data
    assert item["format"] == "processor_output" and item["modality"] == "IMAGE"
    assert item["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]
    proc = load_image_processor(vl_model)
    assert proc is not None
    assert torch.equal(item["pixel_values"], proc.process(images)[0])
    assert (got.image_spans, got.image_grid_thw) == (cpu.image_spans, cpu.image_grid_thw)
    assert got.prompt_tokens == len(cpu.input_ids or [])
    # a text request sends no image_data
    await sgl.generate(GenerateRequest(input_ids=[1, 2], rid="t", sampling=SamplingParams(max_new_tokens=1)))
    assert not hasattr(tm.submitted[-1], "image_data")


def test_the_vl_trainer_example_runs_a_step_on_policy(sdk_home: Path, vl_model: Path) -> None:
    """examples/vl_trainer.py: generate with images, trainer logprobs on the same ids and pixels (gap at
    float noise), a step, the weights pushed, a second step on the new weights still on policy."""
    import os
    import re

    example = Path(__file__).parent.parent / "examples" / "vl_trainer.py"
    env = {**os.environ, "ROLLOUT_SDK_HOME": str(sdk_home)}
    out = subprocess.run(
        [sys.executable, str(example), "--steps", "2", "--prompts", "1", "--group", "2", "--max-new-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=280, check=True,
    )  # fmt: skip
    gaps = [float(g) for g in re.findall(r"logprob gap (\S+)", out.stdout)]
    assert len(gaps) == 2 and max(gaps) <= 1e-4, out.stdout
    assert "image grid [(1, 4, 4)]" in out.stdout


@given(
    st.lists(st.tuples(st.sampled_from(["text", "mark"]), st.integers(1, 5)), min_size=1, max_size=8),
    st.integers(1, 4),
)
@settings(max_examples=60, deadline=None)
def test_builder_adopts_an_expansion_keeping_mask_and_logprobs_aligned(
    layout: list[tuple[str, int]], model_len: int
) -> None:
    """A trajectory with image marks in its prompt and in added context adopts the engine's expansion: the
    model's tokens and logprobs stay where they were, every added token is context (mask 0)."""
    from rollout_sdk.rollouts.trajectory import TrajectoryBuilder

    def render(parts: list[tuple[str, int]], expanded: bool) -> list[int]:
        out: list[int] = []
        for kind, n in parts:
            out += (
                [7] * n
                if kind == "text"
                else [VISION_START_ID, *[IMAGE_PAD_ID] * (n if expanded else 1), VISION_END_ID]
            )
        return out

    half = len(layout) // 2
    prompt, context = layout[:half] or [("text", 1)], layout[half:]
    b = TrajectoryBuilder(render(prompt, False), "t")
    model = list(range(100, 100 + model_len))
    first = GenerateResult(
        rid="a", output_ids=model, finish_reason="stop", prompt_tokens=0, logprobs=[-1.0] * model_len
    )
    b.add_model(first)  # a text-only result: nothing adopted
    b.add_context(render(context, False))
    exp = render(prompt, True) + model + render(context, True)
    spans, pos = [], 0
    for kind, n in [*prompt, ("model", model_len), *context]:
        if kind == "mark":
            spans.append((pos + 1, n))
            pos += n + 2
        else:
            pos += n
    second = GenerateResult(
        rid="b", output_ids=[5], finish_reason="stop", prompt_tokens=len(exp), logprobs=[-2.0],
        input_ids=exp, image_spans=spans, image_grid_thw=[(1, 2, 2 * n) for _, n in spans],
    )  # fmt: skip
    b.add_model(second)
    assert b.ids == [*exp, 5]
    assert b.prompt_ids == render(prompt, True)
    assert len(b.response_ids) == len(b.loss_mask) == len(b.logprobs)
    kept = [(t, lp) for t, m, lp in zip(b.response_ids, b.loss_mask, b.logprobs, strict=True) if m]
    assert kept == [*((t, -1.0) for t in model), (5, -2.0)]
    assert b.image_spans == spans
