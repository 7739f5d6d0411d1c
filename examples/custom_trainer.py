"""A minimal GRPO-style trainer embedding rollout-sdk: generate -> loss -> optimizer step -> update_weights.

Runs on CPU with the embedded tiny model.  The "task" is deliberately trivial so that a few steps show
learning: samples are drawn with top_k=8 and the reward of a sample is the fraction of its tokens with an
even id, so the policy has to move probability towards even ids among its top candidates.

    python examples/custom_trainer.py --steps 4                      # embedded CPU engine in this process
    torchrun --standalone --nproc-per-node 3 examples/custom_trainer.py --steps 4 # rank 0 trains, every rank serves

Each step prints the mean reward, the largest gap between the engine's logprobs and the trainer's own
(on-policy check: the same weights must give the same numbers), the loss and the weight-sync time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_sdk.demos.progress import blocking_phase, phase  # light: no torch

# torch loads here (seconds; 14-20 s on a machine at a load of 7): the phase says so every few seconds
with blocking_phase("custom_trainer: loading torch and the SDK", enabled=__name__ == "__main__"):
    import msgspec
    import torch

    from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
    from rollout_sdk.models import quiet_weight_loading


def parse_args(
    argv: list[str] | None = None, *, steps: int = 4, prompts: int = 4, max_new_tokens: int = 16
) -> argparse.Namespace:
    """The trainer's options (examples/vl_trainer.py has the same, with its own defaults)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--group-size", "--group", type=int, default=4, dest="group_size")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--lr", type=float, default=1e-2)
    args, _ = p.parse_known_args(argv)
    return args


def reward(ids: list[int]) -> float:
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


def response_logprobs(policy: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def policy_step(
    optimizer: torch.optim.Optimizer, groups: list[Any], logprobs: Callable[[Any, Any], torch.Tensor]
) -> tuple[float, list[float], list[float]]:
    """One GRPO step on the groups' samples; returns (loss, rewards, engine/trainer logprob gaps).
    ``logprobs(group, result)``: the trainer's logprobs of ``result.output_ids`` (the one part a model with
    images does differently: examples/vl_trainer.py)."""
    loss_terms, rewards, gaps = [], [], []
    for g in groups:
        rs = torch.tensor([reward(r.output_ids) for r in g.results])
        adv = (rs - rs.mean()) / (rs.std() + 1e-6)  # GRPO: group-relative advantage
        rewards.extend(rs.tolist())
        for a, r in zip(adv, g.results, strict=True):
            lp = logprobs(g, r)
            gaps.append(float((lp.detach() - torch.tensor(r.logprobs)).abs().max()))
            loss_terms.append(-(a * lp).mean())
    loss = torch.stack(loss_terms).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item()), rewards, gaps


@dataclass
class Step:
    """What one step of the loop did: the groups it generated and trained on, and what that cost."""

    groups: list[Any]
    loss: float
    rewards: list[float]
    gaps: list[float]
    generate_s: float
    sync: dict[str, Any]

    def line(self, step: int) -> str:
        """The start of the step's line: reward, on-policy gap, loss, generation and weight-sync time."""
        return (
            f"step {step}: reward {sum(self.rewards) / len(self.rewards):.3f}  engine/trainer logprob gap "
            f"{max(self.gaps):.1e}  loss {self.loss:+.4f}  generate {self.generate_s:.2f}s  weight sync "
            f"{self.sync['seconds']:.2f}s"
        )


async def train_step(
    client: RolloutClient,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    requests: list[GenerateRequest],
    *,
    step: int,
    group_size: int,
    logprobs: Callable[[Any, Any], torch.Tensor],
) -> Step:
    """Generate the groups, take the policy step, push the new weights (version ``step + 1``)."""
    t0 = time.perf_counter()
    async with phase(f"step {step}: generating"):
        groups = await client.generate_many(requests, group_size=group_size).collect()
    generate_s = time.perf_counter() - t0
    # in a worker thread: the event loop (and an embedded engine's server on it) keeps running
    async with phase(f"step {step}: policy step"):
        loss, rewards, gaps = await asyncio.to_thread(policy_step, optimizer, groups, logprobs)
    named = [(n, p.detach()) for n, p in policy.named_parameters()]
    sync = await client.update_weights(named, version=step + 1)  # every later result says v(step+1)
    return Step(groups, loss, rewards, gaps, generate_s, sync)


async def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    # each phase says it starts, and every few seconds that it still runs (rollout_sdk.demos.progress.phase):
    # on a loaded 2-core machine each takes seconds
    async with contextlib.AsyncExitStack() as stack:  # closes the client on the way out, whatever happened
        async with phase("starting the engine"):
            client = await stack.enter_async_context(RolloutClient())
        with quiet_weight_loading():  # no "Loading weights" bar in the example's output
            async with phase(f"loading the trainer's copy of {client.model_path}"):
                policy = await asyncio.to_thread(
                    AutoModelForCausalLM.from_pretrained, client.model_path, dtype=torch.float32
                )
        optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)

        def logprobs(g: Any, r: Any) -> torch.Tensor:
            return response_logprobs(policy, g.request.input_ids, r.output_ids)

        async with phase("joining the engines' weight-sync group (gloo)"):
            await client.init_weight_sync(backend="gloo")  # trainer = rank 0 of a group with every engine
        prompts = [[151644, 872, 198, 1000 + 17 * i] for i in range(args.prompts)]
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, top_k=8, ignore_eos=True)
        print(f"training: {args.steps} steps of {args.prompts} prompts x {args.group_size} samples", flush=True)
        for step in range(args.steps):
            # seeded per step and prompt (each of a group's samples gets seed+k): a reproducible run
            requests = [
                GenerateRequest(input_ids=p, sampling=msgspec.structs.replace(sampling, seed=10_000 * step + 100 * i))
                for i, p in enumerate(prompts)
            ]
            done = await train_step(
                client, policy, optimizer, requests, step=step, group_size=args.group_size, logprobs=logprobs
            )
            print(
                f"{done.line(step)} ({done.sync['bytes'] / 2**20:.0f} MiB)  served by "
                f"{sorted({r.server_id for g in done.groups for r in g.results})}",
                flush=True,
            )
        last = await client.generate(prompts[0], sampling=sampling)
        print(f"weight version of a new result: {last.weight_version}")


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:  # under torchrun: every rank serves, rank 0 also trains
        from rollout_sdk.launch import run

        return run(lambda: train(args))
    asyncio.run(train(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
