"""GRPO on the tool model, on CPU: rollouts through RolloutClient + ToolAgent, weights pushed every step.

``rollout-sdk demo --rl`` and ``examples/grpo_tools.py`` run :func:`run_grpo`.  It starts from the
under-trained tool model (``ensure_tool_model(stage="undertrained")``: it calls the calculator only part
of the time) and, every step::

    groups  = G trajectories of each of P training instances   (ToolAgent, sampled, real tool calls)
    reward  = 1 if solved (tool called, right number in the answer) else 0
    adv     = reward - mean of its group                       (GRPO; groups all-0 or all-1 carry no signal)
    loss    = -sum(adv * logprob(model tokens)) / model tokens  (the trainer's own logprobs, loss mask 1)
    update_weights(trainable params, version=step + 1)         (gloo, into the engine: the next step
                                                                samples from the new weights)

The trainer computes logprobs with :class:`~rollout_sdk.tasks.tool_model.TaskHead` (exact full-vocabulary
log-softmax from the task's rows; the embedding stays frozen so it stays exact) and prints, every step,
the largest gap to the engine's logprobs of the same tokens: ~1e-6, the same weights.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..client import RolloutClient
from ..errors import ConfigError
from ..protocol.checks import check_config_types
from ..protocol.engine_config import CpuEngineConfig
from ..rollouts.group import deprecated_group_field, rollout_group
from .progress import phase, rollout_progress

__all__ = ["GrpoConfig", "run_grpo"]


@dataclass(frozen=True, kw_only=True)
class GrpoConfig:
    #: GRPO steps
    steps: int = 12
    #: training instances per step
    prompts: int = 8
    #: trajectories per instance (the group)
    group_size: int = 8
    #: the trainer's learning rate (Adam)
    lr: float = 3e-4
    #: held-back instances solved greedily before and after training (0: skip)
    eval_instances: int = 50
    #: seed of the training instances and the sampling
    seed: int = 0
    #: deprecated: the old name of ``group_size``
    group: int | None = None
    #: what the policy trains on: "calculator" (the tool task), or "reasoning_gym:<dataset>" (a
    #: reasoning-gym dataset, scored by its own score_answer; the calculator tool stays available)
    task: str = "calculator"
    #: reasoning-gym only: the dataset's config fields as JSON (e.g. '{"min_digits": 2, "max_digits": 2}')
    task_config: str = "{}"

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        deprecated_group_field(self, "group")
        # a group of one has no relative advantage: GRPO compares a group's trajectories
        for name, least in (("steps", 1), ("prompts", 1), ("group_size", 2), ("eval_instances", 0)):
            if getattr(self, name) < least:
                raise ConfigError(name, getattr(self, name), f"must be >= {least}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr", self.lr, "must be finite and > 0")
        if self.task != "calculator" and not self.task.startswith("reasoning_gym:"):
            raise ConfigError("task", self.task, "must be 'calculator' or 'reasoning_gym:<dataset>'")
        try:
            parsed = json.loads(self.task_config)
        except ValueError as exc:
            raise ConfigError("task_config", self.task_config, f"must be a JSON object ({exc})") from None
        if not isinstance(parsed, dict):
            raise ConfigError("task_config", self.task_config, "must be a JSON object")


def _import_training_libraries() -> None:
    """torch, transformers and the tool model's module, imported (in a worker thread: see run_grpo)."""
    import torch  # noqa: F401  # lazy: cli-start
    import transformers  # noqa: F401  # lazy: cli-start

    from ..tasks import tool_model  # noqa: F401  # lazy: cli-start


async def run_grpo(
    config: GrpoConfig, *, say: Callable[[str], None] = print, progress: bool = True
) -> list[dict[str, float]]:
    """Run GRPO; print a row per step; return the rows (success, reward, ... per step).  ``progress``: a
    bar on stderr while a step's rollouts run (seconds each on CPU), gone when its row is printed."""
    say(
        f"GRPO on CPU: {config.steps} steps of {config.prompts} questions x {config.group_size} trajectories; "
        "loading the policy and starting the engine..."
    )
    # torch and transformers take seconds to import on a loaded machine: in a thread, inside a phase that
    # says every few seconds that it still runs (issue 37: no silence over ~5 s)
    async with phase("loading torch and transformers"):
        await asyncio.to_thread(_import_training_libraries)
    import torch  # lazy: cli-start
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: cli-start

    from ..models import quiet_weight_loading  # lazy: cli-start
    from ..tasks import calculator as task  # lazy: cli-start
    from ..tasks.tool_model import TaskHead, ensure_tool_model_async, shared_prefix_hidden  # lazy: cli-start

    source = _task_source(config)  # reasoning-gym's generator (or the calculator's): before any engine starts
    model_dir = await ensure_tool_model_async(stage="undertrained")
    async with phase("loading the policy"):
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_dir))
        with quiet_weight_loading():
            policy: Any = await asyncio.to_thread(
                AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=torch.float32
            )
    say("policy loaded; starting the engine and the weight-sync group (gloo)...")
    head = TaskHead.of(model_dir)
    body = policy.model
    emb = body.embed_tokens.weight
    emb.requires_grad_(False)  # keeps every non-task row equal, so TaskHead stays exact
    trainable = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    opt = torch.optim.Adam([p for _, p in trainable], lr=config.lr)
    rows: list[dict[str, float]] = []
    engine = CpuEngineConfig(model_path=str(model_dir), seed=config.seed)
    async with RolloutClient(engine=engine) as client:
        await client.init_weight_sync(backend="gloo")
        say(f"GRPO on the tool model (under-trained start): {model_dir}")
        if config.eval_instances:
            async with phase(f"greedy evaluation on {config.eval_instances} held-back instances"):
                before = await _greedy(client, tokenizer, config.eval_instances, source)
            say(f"greedy success on {config.eval_instances} held-back instances before: {before:.0%}")
        say(
            f"{'step':>4} {'success':>8} {'reward':>7} {'tool calls':>10} {'lp gap':>8} {'loss':>8}"
            f" {'rollout':>8} {'train':>6} {'sync':>6}"
        )
        for step in range(config.steps):
            t0 = time.perf_counter()
            agent = task.make_agent(tokenizer, temperature=1.0, seed=config.seed * 1_000_003 + 7919 * step)
            total = config.prompts * config.group_size
            async with rollout_progress(client, total, progress, desc=f"step {step} rollouts", leave=False):
                if source is None:
                    instances = task.samples(config.prompts, seed=config.seed * 1000 + step, split="train")
                    groups = await task.run_groups(client, agent, instances, group_size=config.group_size)
                else:
                    groups = await _run_source(
                        client,
                        agent,
                        source.samples(config.prompts, start=step * config.prompts),
                        source,
                        config.group_size,
                    )
            t1 = time.perf_counter()
            trajs = [t for g in groups for t in g]
            rewards = [t.reward or 0.0 for t in trajs]
            calls = sum(1 for t in trajs if any(c.name == "calculator" for u in t.turns for c in u.tool_calls))
            advantages = []
            for g in groups:
                mean = sum(t.reward or 0.0 for t in g) / len(g)
                advantages += [(t.reward or 0.0) - mean for t in g]
            loss_value, gap = await asyncio.to_thread(
                _policy_step, policy, body, emb, head, shared_prefix_hidden, opt, trajs, advantages
            )
            t2 = time.perf_counter()
            sync = await client.update_weights([(n, p.detach()) for n, p in trainable], version=step + 1)
            row = {
                "step": float(step),
                "success": sum(r > 0 for r in rewards) / len(rewards),
                "reward": sum(rewards) / len(rewards),
                "tool_call_rate": calls / len(trajs),
                "logprob_gap": gap,
                "loss": loss_value,
                "rollout_s": t1 - t0,
                "train_s": t2 - t1,
                "sync_s": float(sync["seconds"]),
            }
            rows.append(row)
            say(
                f"{step:>4} {row['success']:>8.0%} {row['reward']:>7.3f} {row['tool_call_rate']:>10.0%}"
                f" {gap:>8.1e} {loss_value:>+8.4f} {row['rollout_s']:>7.1f}s {row['train_s']:>5.1f}s"
                f" {row['sync_s']:>5.2f}s"
            )
        if config.eval_instances:
            async with phase(f"greedy evaluation on {config.eval_instances} held-back instances"):
                after = await _greedy(client, tokenizer, config.eval_instances, source)
            say(f"greedy success on {config.eval_instances} held-back instances after: {after:.0%}")
    return rows


def _task_source(config: GrpoConfig) -> Any:
    """None for the calculator task, else the reasoning-gym task: training entries first, then
    ``eval_instances`` entries never trained on."""
    if config.task == "calculator":
        return None
    from ..tasks.reasoning_gym import ReasoningGymTask  # lazy: cli-start

    size = config.steps * config.prompts + max(config.eval_instances, 1)
    return ReasoningGymTask.from_name(config.task, size=size, seed=config.seed, config=json.loads(config.task_config))


async def _run_source(client: RolloutClient, agent: Any, samples: list[Any], source: Any, group_size: int) -> list[Any]:
    return list(
        await asyncio.gather(
            *(
                rollout_group(client, agent, s, group_size=group_size, reward=source.reward, sample_index=i)
                for i, s in enumerate(samples)
            )
        )
    )


async def _greedy(client: RolloutClient, tokenizer: Any, n: int, source: Any = None) -> float:
    from ..tasks import calculator as task  # lazy: cli-start

    if source is None:
        groups = await task.run_groups(client, task.make_agent(tokenizer), task.samples(n, split="test"))
    else:
        held = source.samples(n, start=source.size - n)
        groups = await _run_source(client, task.make_agent(tokenizer), held, source, 1)
    return sum(t.reward or 0.0 for g in groups for t in g) / n


def _policy_step(
    policy: Any,
    body: Any,
    emb: Any,
    head: Any,
    hidden_of: Any,
    opt: Any,
    trajs: list[Any],
    advantages: list[float],
) -> tuple[float, float]:
    """One policy-gradient step on the trajectories (in a worker thread); returns (loss, max logprob gap)."""
    import torch  # lazy: cli-start

    from ..tasks.tool_model import common_prefix  # lazy: cli-start

    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    first = seqs[0]
    shared = min(common_prefix(seqs), min(len(s) for s in seqs) - 1, min(len(t.prompt_ids) for t in trajs))
    p = shared - 1  # predict from the prompt's last token on
    width = max(len(s) for s in seqs) - p
    ids = torch.full((len(seqs), width), head.rest_token, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    engine_lp = torch.zeros(len(seqs), width)
    for k, t in enumerate(trajs):
        s = seqs[k]
        ids[k, : len(s) - p] = torch.tensor(s[p:])
        start = len(t.prompt_ids) - p
        mask[k, start : start + len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float)
        engine_lp[k, start : start + len(t.logprobs)] = torch.tensor(t.logprobs)
    hidden = hidden_of(body, torch.tensor(first[:p]), ids)[:, :-1]
    logp_all = head.log_softmax(hidden, emb)
    logp = logp_all.gather(-1, head.compact(ids[:, 1:])[..., None]).squeeze(-1)
    m = mask[:, 1:]
    adv = torch.tensor(advantages)[:, None]
    loss = -(adv * logp * m).sum() / m.sum().clamp(min=1.0)
    gap = float(((logp.detach() - engine_lp[:, 1:]).abs() * m).max())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item()), gap
