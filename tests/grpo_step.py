"""One GRPO step on trajectories from any adapter (tests only): the trainer's own forward of the exact ids,
checked against the engine's logprobs on the loss mask, a policy-gradient step with group-relative
advantages, and the new weights pushed into the engine as ``version``."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_sdk.rollouts.trajectory import Trajectory


def _step(policy: Any, opt: Any, groups: list[list[Trajectory]]) -> tuple[float, float]:
    import torch

    loss = torch.zeros(())
    gap = 0.0
    n = 0
    for g in groups:
        rewards = [t.reward or 0.0 for t in g]
        mean = sum(rewards) / len(rewards)
        for t, r in zip(g, rewards, strict=True):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logits = policy(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)[len(t.prompt_ids) - 1 :]
            mask = torch.tensor(t.loss_mask, dtype=torch.float)
            engine = torch.tensor(t.logprobs)
            gap = max(gap, float(((lp.detach() - engine).abs() * mask).max()))
            loss = loss - (r - mean) * (lp * mask).sum() / mask.sum().clamp(min=1.0)
            n += 1
    loss = loss / max(n, 1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach()), gap


async def grpo_step(client: Any, model_dir: Any, groups: list[list[Trajectory]], *, version: int) -> float:
    """Run the step; return the largest |trainer - engine| logprob gap on model tokens (before the step)."""
    import torch
    from transformers import AutoModelForCausalLM

    policy = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=torch.float32)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-3)
    _, gap = await asyncio.to_thread(_step, policy, opt, groups)
    await client.update_weights([(k, v.detach()) for k, v in policy.named_parameters()], version=version)
    return gap
