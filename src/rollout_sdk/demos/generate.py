"""``rollout-sdk demo``: the main job, agent rollouts with real tool calls on the CPU engine.

The model is the tool model (``rollout_sdk.tasks.ensure_tool_model``: a tiny Qwen2 trained on this
machine, once, to do arithmetic through a ``calculator`` tool).  N held-back questions x n trajectories
go through ``ToolAgent`` -> ``RolloutClient`` -> ZMQ -> engine server -> CPU engine, with a progress bar;
then the success rate, a few trajectories with their tool calls and answers, throughput and latency,
and one trajectory's token ids, loss mask and logprobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..client import ClientConfig, RolloutClient
from ..errors import ConfigError
from ..export import write_jsonl
from ..protocol.checks import check_config_types
from ..protocol.engine_config import CpuEngineConfig
from ..rollouts.group import Agent, deprecated_group_field
from .progress import phase, rollout_progress

__all__ = ["DemoConfig", "run_demo"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    #: distinct questions (held-back instances of the calculator task)
    prompts: int = 32
    #: trajectories per question (a GRPO-style group)
    group_size: int = 4
    #: per model turn
    max_new_tokens: int = 48
    #: 0 is greedy; 1 samples from the model's distribution (as RL does)
    temperature: float = 1.0
    #: seed of the sampling (each trajectory and turn gets its own)
    seed: int = 1234
    #: trajectories printed in full
    show: int = 4
    #: show a progress bar
    progress: bool = True
    #: also write every trajectory (JSONL, rollout_sdk.export) to this file
    export: str | None = None
    #: deprecated: the old name of ``group_size``
    samples: int | None = None

    def __post_init__(self) -> None:
        check_config_types(self)  # a mistyped value fails here, naming the field, not deep inside
        deprecated_group_field(self, "samples")
        for name, least in (("prompts", 1), ("group_size", 1), ("max_new_tokens", 1), ("show", 0)):
            if getattr(self, name) < least:
                raise ConfigError(name, getattr(self, name), f"must be >= {least}")


def _model_line(path: str) -> str:
    meta_file = Path(path, "task.json")
    if not meta_file.exists():
        return f"model: {path} (not the tool model: expect no tool calls)"
    meta = json.loads(meta_file.read_text())
    cfg = json.loads(Path(path, "config.json").read_text())
    return (
        f"model: a {cfg['num_hidden_layers']}-layer, {cfg['hidden_size']}-wide Qwen2 with Qwen2.5's tokenizer and "
        f"chat template, trained on this machine ({meta['build_seconds']:.0f}s, once) to do arithmetic through a "
        "calculator tool; it can do nothing else"
    )


async def run_demo(
    demo: DemoConfig,
    *,
    servers: list[str] | None = None,
    engine: CpuEngineConfig | None = None,
    client: ClientConfig | None = None,
    out: Any = None,
) -> dict[str, Any]:
    """Run the demo; print a report to ``out`` (stdout by default); return the numbers."""
    out = out or sys.stdout

    def say(*parts: object) -> None:
        print(*parts, file=out, flush=True)

    # the first line before the imports and the model: both take seconds on a loaded machine
    say(f"rollout-sdk demo: {demo.prompts} questions x {demo.group_size} trajectories, through ToolAgent")
    # transformers' import takes seconds on a loaded machine: a phase (a line, then one every few seconds),
    # in a thread so that the phase's ticker can speak
    async with phase("loading transformers (the tokenizer's library)", out=out):
        transformers = await asyncio.to_thread(importlib.import_module, "transformers")

    from ..agents import group_stats, rollout_group  # lazy: cli-start
    from ..tasks import calculator as task  # lazy: cli-start
    from ..tasks.tool_model import ensure_tool_model_async  # lazy: cli-start

    t_start = time.perf_counter()
    if not servers:
        engine = engine or CpuEngineConfig()
        if engine.model_path is None:
            path = await ensure_tool_model_async(engine.home, progress=demo.progress)
            engine = dataclasses.replace(engine, model_path=str(path))
    where = ", ".join(servers) if servers else "embedded CPU engine"
    t_open = time.perf_counter()  # "ready in" is the engine's start, not the model's training above
    async with RolloutClient(servers, engine=engine if not servers else None, config=client) as rc:
        t_ready = time.perf_counter()
        say(_model_line(rc.model_path or ""))
        say(f"servers: {where}; ready in {t_ready - t_open:.1f}s")
        tokenizer = await asyncio.to_thread(transformers.AutoTokenizer.from_pretrained, rc.model_path)
        agent = task.make_agent(
            tokenizer, temperature=demo.temperature, seed=demo.seed, max_new_tokens=demo.max_new_tokens
        )
        instances = task.samples(demo.prompts, seed=demo.seed, split="test")
        t0 = time.perf_counter()
        async with rollout_progress(rc, demo.prompts * demo.group_size, demo.progress) as bar:
            counted = _Counted(agent, bar)  # the bar moves as each trajectory ends, not each group

            async def group(i: int, sample: dict[str, Any]) -> list[Any]:
                return await rollout_group(
                    rc, counted, sample, group_size=demo.group_size, reward=task.reward, sample_index=i
                )

            groups = await asyncio.gather(*(group(i, s) for i, s in enumerate(instances)))
        wall = time.perf_counter() - t0
        stats = rc.stats()

    trajs = [t for g in groups for t in g]
    if demo.export:
        n = await asyncio.to_thread(write_jsonl, trajs, demo.export)
        say(f"wrote {n} trajectories to {demo.export}")
    totals = group_stats(groups)
    solved = sum(1 for t in trajs if (t.reward or 0) > 0)
    model_tokens = int(totals["model_tokens"])
    report = {
        "trajectories": len(trajs),
        "groups": len(groups),
        "success_rate": solved / max(1, len(trajs)),
        "tool_calls": int(totals["tool_calls"]),
        "tool_errors": int(totals["tool_errors"]),
        "model_turns": int(totals["turns"]),
        "wall_s": wall,
        "trajectories_per_s": len(trajs) / wall,
        "model_tokens": model_tokens,
        "model_tokens_per_s": model_tokens / wall,
        "client_latency_p50_s": stats.latency_p50_s,
        "client_latency_p90_s": stats.latency_p90_s,
        "client_latency_p99_s": stats.latency_p99_s,
        "total_s": time.perf_counter() - t_start,
    }
    temp = "greedy" if demo.temperature == 0 else f"sampled at temperature {demo.temperature:g}"
    say("")
    say(f"solved {solved} of {len(trajs)} trajectories ({report['success_rate']:.0%}, {temp}, held-back questions)")
    say("")
    shown = [g[0] for g in groups if g][: demo.show]  # one trajectory of each of the first questions
    for t in shown:
        sample = instances[t.sample_index]
        calls = [f"{c.name}({_args(c.arguments)}) -> {_tool_result(t, k)}" for k, c in enumerate(_calls(t))]
        mark = "ok   " if (t.reward or 0) > 0 else "WRONG"
        say(f"  {mark} {sample['messages'][0]['content']:<18} {'; '.join(calls) or '(no tool call)'}")
        say(f"        answer {task.final_answer(t)!r}   (right: {sample['answer']}, {len(t.turns)} model turns)")
    say("")
    say("throughput")
    say(f"  trajectories   {len(trajs)} in {wall:.2f}s = {report['trajectories_per_s']:.1f}/s")
    say(f"  model turns    {report['model_turns']} (each one request), tool calls {report['tool_calls']}")
    say(f"  model tokens   {model_tokens} = {report['model_tokens_per_s']:.0f} tok/s")
    say("latency per model turn (client side)")
    say(f"  p50 {_ms(stats.latency_p50_s)}  p90 {_ms(stats.latency_p90_s)}  p99 {_ms(stats.latency_p99_s)}")
    say("servers")
    for s in stats.servers:
        say(
            f"  {s.server_id:<14} {'alive' if s.alive else 'dead'}  completed {s.completed}  aborted {s.aborted}"
            f"  errors {s.errors}  p50 {_ms(s.latency_p50_s)}"
        )
    if trajs:
        t = max(shown or trajs[:1], key=lambda t: len(t.turns))
        say("")
        say(f"one trajectory, as a trainer gets it (question {t.sample_index}; reward {t.reward})")
        say(f"  prompt_ids    {len(t.prompt_ids)} tokens (system prompt with the tool schema, the question)")
        say(f"  response_ids  {len(t.response_ids)} tokens: {t.response_ids[:10]}...")
        say(f"  loss_mask     {''.join(str(m) for m in t.loss_mask)}")
        say("                (1: the model's tokens; 0: what the loop added: end of turn, tool result, next prompt)")
        lps = [round(lp, 3) for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m][:8]
        say(f"  logprobs      {lps}... (the engine's, one per model token)")
        say(f"  finish        {t.finish_reason}   weight versions {t.weight_versions} (version, model tokens)")
        say("  decoded       " + repr(tokenizer.decode(t.response_ids))[:400])
    say(f"\ndone in {report['total_s']:.1f}s")
    return report


class _Counted(Agent):
    """``agent``, with each finished trajectory counted on the progress bar."""

    def __init__(self, agent: Agent, bar: Any) -> None:
        self.agent = agent
        self.bar = bar

    async def run(self, ctx: Any, sample: Any) -> Any:
        traj = await self.agent.run(ctx, sample)
        self.bar.update(1)
        return traj


def _calls(t: Any) -> list[Any]:
    return [c for turn in t.turns for c in turn.tool_calls]


def _args(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in arguments.items())


def _tool_result(t: Any, k: int) -> str:
    results = [m.get("content", "") for m in t.messages if m.get("role") == "tool"]
    return str(results[k]) if k < len(results) else "?"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"
