"""A minimal GRPO-style trainer on a vision-language model: images in, exact ids out, trainer logprobs on the
same ids and pixels, an optimizer step, the new weights pushed to the engine.

Runs on CPU with the tiny Qwen2.5-VL-shaped model (``rollout-sdk make-model tiny-vl``, built on first use).
Every prompt is a chat message with an image (random noise, seeded) and a question; the reward of a sample
is the fraction of its tokens with an even id (a deliberately trivial task, as in custom_trainer.py).

    python examples/vl_trainer.py --steps 2

Each step prints the mean reward and the largest gap between the engine's logprobs and the trainer's own
(computed by transformers from the result's ``input_ids`` + ``output_ids``, the same images processed by
the SDK's processor, and the result's ``image_spans``: the same numbers on the same weights).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from rollout_sdk.demos.progress import blocking_phase, phase  # light: no torch

# torch loads here (seconds; 14-20 s on a machine at a load of 7): the phase says so every few seconds
with blocking_phase("vl_trainer: loading torch and the SDK", enabled=__name__ == "__main__"):
    import msgspec
    import torch

    # the loop's other parts are custom_trainer.py's (the same toy reward, GRPO step and weight push)
    from custom_trainer import parse_args, train_step

    from rollout_sdk import CpuEngineConfig, GenerateRequest, GenerateResult, RolloutClient, SamplingParams
    from rollout_sdk.models import ensure_tiny_vl_model
    from rollout_sdk.models.tiny_vl import noise_png
    from rollout_sdk.models.vision import ImageProcessor, load_image_processor


def response_logprobs(
    policy: torch.nn.Module, proc: ImageProcessor, r: GenerateResult, images: list[bytes]
) -> torch.Tensor:
    """The trainer's logprobs of ``r.output_ids``: one forward over the result's expanded ids and the pixels."""
    assert r.input_ids is not None
    inputs = proc.model_inputs(r.input_ids + r.output_ids, images, r.image_spans)
    n = len(r.input_ids)
    logits = policy(**inputs).logits[0, n - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(r.output_ids)[:, None]).squeeze(1)


async def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    async with phase("building the tiny vision-language model (once) and its processor"):
        model_dir = str(await asyncio.to_thread(ensure_tiny_vl_model))
        tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_dir)
        proc = await asyncio.to_thread(load_image_processor, model_dir)
    assert proc is not None
    async with contextlib.AsyncExitStack() as stack:  # closes the client on the way out, whatever happened
        async with phase("starting the engine"):
            client = await stack.enter_async_context(RolloutClient(engine=CpuEngineConfig(model_path=model_dir)))
        async with phase("loading the trainer's copy"):
            policy = await asyncio.to_thread(
                AutoModelForImageTextToText.from_pretrained, model_dir, dtype=torch.float32
            )
        optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)

        def logprobs(g: Any, r: GenerateResult) -> torch.Tensor:
            return response_logprobs(policy, proc, r, list(g.request.images))

        async with phase("joining the engines' weight-sync group (gloo)"):
            await client.init_weight_sync(backend="gloo")
        images = [[noise_png(56, 56, i)] for i in range(args.prompts)]
        question = [{"type": "image"}, {"type": "text", "text": "What do you see?"}]
        messages = [{"role": "user", "content": question}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, top_k=8, ignore_eos=True)
        for step in range(args.steps):
            requests = [
                GenerateRequest(
                    input_ids=prompt, images=imgs, sampling=msgspec.structs.replace(sampling, seed=1000 * step + i)
                )
                for i, imgs in enumerate(images)
            ]
            done = await train_step(
                client, policy, optimizer, requests, step=step, group_size=args.group_size, logprobs=logprobs
            )
            r0 = done.groups[0].results[0]
            print(
                f"{done.line(step)}  prompt {len(prompt)} -> {r0.prompt_tokens} tokens "
                f"(image grid {r0.image_grid_thw})",
                flush=True,
            )


def main() -> int:
    asyncio.run(train(parse_args(steps=2, prompts=2, max_new_tokens=8)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
