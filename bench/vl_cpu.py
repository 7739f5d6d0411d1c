"""Vision-language on CPU: what the SDK's image expansion costs, and trainer parity on the tiny VL model.

What is measured
    * expansion: ``ImageProcessor.expand`` (Pillow decode with the decompression-bomb bound, Qwen2VLImageProcessor
      resize/normalise/patchify, mark expansion) per image, for noise PNGs of three sizes, mean of 10 runs after
      one warm-up (the tiny model's processor: 28x28..112x112 pixels after resizing);
    * parity: 8 requests with two images each (56x56 and 56x28), 32 sampled tokens each, on ``CpuEngine``
      (fp32): the engine's logprobs against one transformers forward of the same model over the result's ids and
      the same pixels (``ImageProcessor.model_inputs``).

    python bench/vl_cpu.py
"""

from __future__ import annotations

import time

import harness
import torch


async def main() -> None:
    from transformers import AutoTokenizer

    from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
    from rollout_sdk.models import ensure_tiny_vl_model
    from rollout_sdk.models.tiny_vl import noise_png
    from rollout_sdk.models.vision import load_image_processor
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    path = str(ensure_tiny_vl_model())
    proc = load_image_processor(path)
    assert proc is not None
    mark = [151652, 151655, 151653]
    rows = []
    for w, h in ((56, 56), (448, 448), (1920, 1080)):
        data = noise_png(w, h, 0)
        proc.expand(mark, [data])
        t0 = time.perf_counter()
        for _ in range(10):
            v = proc.expand(mark, [data])
        ms = (time.perf_counter() - t0) / 10 * 1e3
        rows.append([f"{w}x{h}", len(data), v.grid_thw[0], v.num_image_tokens, f"{ms:.1f}"])
    print(harness.markdown(["image (noise PNG)", "file bytes", "grid (t, h, w)", "image tokens", "expand ms"], rows))
    tok = AutoTokenizer.from_pretrained(path)
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]
    messages = [{"role": "user", "content": parts}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    engine = CpuEngine(CpuEngineConfig(model_path=path))
    await engine.start()
    diffs: list[float] = []
    try:
        for s in range(8):
            images = [noise_png(56, 56, 2 * s), noise_png(56, 28, 2 * s + 1)]
            sp = SamplingParams(max_new_tokens=32, seed=s, ignore_eos=True)
            r = await engine.generate(GenerateRequest(input_ids=ids, images=images, rid=f"r{s}", sampling=sp))
            assert r.input_ids is not None and r.logprobs is not None
            inputs = proc.model_inputs(r.input_ids + r.output_ids, images, r.image_spans)
            with torch.no_grad():
                lp = torch.log_softmax(engine.model(**inputs).logits[0].float(), dim=-1)
            n = len(r.input_ids)
            diffs += [abs(lp[n - 1 + i, t].item() - r.logprobs[i]) for i, t in enumerate(r.output_ids)]
    finally:
        await engine.close()
    print()
    row = ["CpuEngine vs transformers forward", len(diffs), f"{sum(diffs) / len(diffs):.2e}", f"{max(diffs):.2e}"]
    print(harness.markdown(["parity (CPU fp32)", "tokens", "mean abs diff", "max abs diff"], [row]))


if __name__ == "__main__":
    harness.parser(__doc__).parse_args()
    harness.run(main(), uvloop=False)
