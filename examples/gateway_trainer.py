"""Train through the OpenAI-compatible gateway: a black-box agent, exact tokens, a GRPO step, fresh weights.

The agent (``agent`` below) knows nothing about rollout-sdk: it speaks the OpenAI chat-completions API
over plain HTTP (aiohttp, in the default install; the ``openai`` client, ``pip install openai``, sends the
same request) and keeps its own conversation, re-sending it every turn.  The trainer gives each rollout
its own session (its own base URL), rewards it when the agent is done, and takes the finished sessions
as ``Trajectory`` objects: the exact token ids the model saw and produced, a loss mask (1 on model
tokens), the engine's logprobs and weight versions.  One step: group-relative advantages, the
policy-gradient loss on the masked tokens, an optimizer step, and the new weights pushed to the engines.

    python examples/gateway_trainer.py --steps 2        # embedded CPU engine, everything in this process
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

from rollout_sdk.demos.progress import blocking_phase, phase  # light: no torch

# torch loads here (seconds; 14-20 s on a machine at a load of 7): the phase says so every few seconds
with blocking_phase("gateway_trainer: loading torch and the SDK", enabled=__name__ == "__main__"):
    import aiohttp
    import torch

    from rollout_sdk import RolloutClient
    from rollout_sdk.agents import Trajectory
    from rollout_sdk.gateway import Gateway, SessionHandle
    from rollout_sdk.models import quiet_weight_loading


async def agent(base_url: str, model: str, question: str, *, seed: int, turns: int = 2) -> str:
    """Any OpenAI-API agent: here, ask, then ask a follow-up, then return the last answer.

    With the ``openai`` client (``pip install openai``) the call is
    ``AsyncOpenAI(base_url=base_url, api_key="unused").chat.completions.create(model=..., messages=...)``:
    the same POST to ``{base_url}/chat/completions``."""
    messages = [{"role": "user", "content": question}]
    answer = ""
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer unused"}) as http:
        for turn in range(turns):
            body = {"model": model, "messages": messages, "max_tokens": 12, "seed": seed + turn}
            async with http.post(f"{base_url}/chat/completions", json=body) as r:
                r.raise_for_status()
                answer = (await r.json())["choices"][0]["message"]["content"] or ""
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say it shorter."}]
    return answer


def reward(answer: str) -> float:
    """A toy reward: shorter answers are better."""
    return 1.0 / (1.0 + len(answer))


def masked_logprobs(policy: torch.nn.Module, traj: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logprobs of the trajectory's response tokens, and its loss mask."""
    ids = torch.tensor([traj.ids])
    logits = policy(input_ids=ids).logits[0, len(traj.prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(traj.response_ids)[:, None]).squeeze(1)
    return lp, torch.tensor(traj.loss_mask, dtype=torch.float32)


def policy_step(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[list[Trajectory]]
) -> tuple[float, list[float]]:
    """GRPO: advantages relative to the other rollouts of the same question; one optimizer step.  Returns
    (loss, the largest engine/trainer logprob gap of each trajectory)."""
    loss_terms, gaps = [], []
    for group in groups:
        rs = torch.tensor([float(t.reward or 0.0) for t in group])
        adv = (rs - rs.mean()) / (rs.std() + 1e-6)
        for a, t in zip(adv, group, strict=True):
            lp, mask = masked_logprobs(policy, t)
            engine_lp = torch.tensor(t.logprobs)
            gaps.append(float(((lp.detach() - engine_lp).abs() * mask).max()))
            loss_terms.append(-(a * lp * mask).sum() / mask.sum())
    loss = torch.stack(loss_terms).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item()), gaps


def load_policy(path: str) -> torch.nn.Module:
    """The trainer's copy of the engine's model (transformers loads here: call it off the event loop)."""
    from transformers import AutoModelForCausalLM

    with quiet_weight_loading():  # no "Loading weights" bar in the example's output
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


async def train(args: argparse.Namespace) -> dict[str, float]:
    questions = [f"What is {i} + {i}?" for i in range(args.prompts)]
    summary: dict[str, float] = {}
    # each phase says it starts, and every few seconds that it still runs (rollout_sdk.demos.progress.phase)
    async with contextlib.AsyncExitStack() as stack:
        async with phase("starting the engine and the gateway"):
            client = await stack.enter_async_context(RolloutClient())
            gw = await stack.enter_async_context(Gateway(client))
        print(f"gateway at {gw.url} serving {gw.model_name!r}", flush=True)
        async with phase(f"loading the trainer's copy of {client.model_path}"):
            policy = await asyncio.to_thread(load_policy, client.model_path)
        optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
        async with phase("joining the engine's weight-sync group (gloo)"):
            await client.init_weight_sync(backend="gloo")
        for step in range(args.steps):
            t0 = time.perf_counter()
            # one session per rollout: the agent only gets a base URL
            sessions = [(q, gw.session(metadata={"question": q})) for q in questions for _ in range(args.group)]

            async def rollout(k: int, q: str, s: SessionHandle, step: int = step) -> None:
                answer = await agent(s.base_url, gw.model_name, q, seed=1000 * step + k)
                gw.reward(s.id, reward(answer))  # sets the session's reward and finishes it

            by_session: dict[str, Trajectory] = {}
            async with phase(f"step {step}: {len(sessions)} agents through the gateway"):
                await asyncio.gather(*(rollout(k, q, s) for k, (q, s) in enumerate(sessions)))
                async for traj in gw.trajectories():
                    by_session[traj.id] = traj
                    if len(by_session) == len(sessions):
                        break
            t_rollout = time.perf_counter() - t0
            # a group per question: its `group` rollouts
            groups = [
                [by_session[s.id] for _, s in sessions[i * args.group : (i + 1) * args.group]]
                for i in range(len(questions))
            ]
            # in a worker thread: the event loop (the gateway, the embedded engine's server) keeps running
            async with phase(f"step {step}: policy step and weight sync"):
                loss, gaps = await asyncio.to_thread(policy_step, policy, optimizer, groups)
                sync = await client.update_weights(
                    [(n, p.detach()) for n, p in policy.named_parameters()], version=step + 1
                )
            trajs = list(by_session.values())
            summary = {
                "step": float(step),
                "trajectories": float(len(trajs)),
                "turns": sum(len(t.turns) for t in trajs) / len(trajs),
                "model_tokens": float(sum(sum(t.loss_mask) for t in trajs)),
                "logprob_gap": max(gaps),
                "loss": loss,
                "weight_version": float(min(v for t in trajs for v, _ in t.weight_versions)),
            }
            print(
                f"step {step}: {len(trajs)} trajectories, {summary['turns']:.1f} turns each, "
                f"{int(summary['model_tokens'])} model tokens, engine/trainer logprob gap {max(gaps):.1e}, "
                f"loss {loss:+.4f}, rollout {t_rollout:.1f}s, weight sync {sync['seconds']:.2f}s",
                flush=True,
            )
    print("SUMMARY " + json.dumps(summary))
    return summary


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    asyncio.run(train(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
