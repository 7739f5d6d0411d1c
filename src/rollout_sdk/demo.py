"""``rollout-sdk demo``: the main job on the embedded default.

N chat prompts x n samples through ``RolloutClient`` -> ZMQ -> engine server -> CPU engine, with a progress
bar, then throughput, latency percentiles, per-server counters and one sample trajectory.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from .client import ClientConfig, RolloutClient
from .engines.cpu import CpuEngineConfig
from .protocol import SamplingParams

__all__ = ["DemoConfig", "run_demo"]

_QUESTIONS = [
    "What is 17 times 23?",
    "Name three prime numbers larger than 100.",
    "Write a haiku about gradient descent.",
    "Explain what a KV cache is in one sentence.",
    "What is the capital of Australia?",
    "Give me a Python one-liner that reverses a string.",
    "Why is the sky blue?",
    "Summarise reinforcement learning from human feedback.",
]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    #: distinct prompts
    prompts: int = 64
    #: samples per prompt (a GRPO-style group)
    samples: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    #: seed of the first prompt's samples (each sample gets its own)
    seed: int = 1234
    #: show a progress bar
    progress: bool = True
    #: also write every sample as a trajectory (JSONL, rollout_sdk.export) to this file
    export: str | None = None


def _load_tokenizer(path: str) -> Any:
    import os

    if not path or not os.path.isdir(path):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # a model directory without a tokenizer still demos, as token ids
        return None


async def run_demo(
    demo: DemoConfig,
    *,
    servers: list[str] | None = None,
    engine: CpuEngineConfig | None = None,
    client: ClientConfig | None = None,
    out: Any = None,
) -> dict[str, Any]:
    """Run the demo; print a report to ``out`` (stdout by default); return the numbers."""
    import sys

    out = out or sys.stdout

    def say(*parts: object) -> None:
        print(*parts, file=out, flush=True)

    t_start = time.perf_counter()
    where = ", ".join(servers) if servers else "embedded CPU engine (tiny Qwen2, made locally on first use)"
    say(f"rollout-sdk demo: {demo.prompts} prompts x {demo.samples} samples, {demo.max_new_tokens} new tokens")
    say(f"servers: {where}")
    async with RolloutClient(servers, engine=engine if not servers else None, config=client) as rc:
        t_ready = time.perf_counter()
        say(f"ready in {t_ready - t_start:.1f}s: {len(rc.servers)} server(s), model {rc.model_path or '?'}")
        tok = await asyncio.to_thread(_load_tokenizer, rc.model_path)
        prompts: list[list[int]] = []
        for i in range(demo.prompts):
            q = _QUESTIONS[i % len(_QUESTIONS)]
            if tok is not None:
                text = tok.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
                )
                prompts.append(tok.encode(text, add_special_tokens=False))
            else:
                prompts.append([1 + (i * 7 + j) % 1000 for j in range(16)])
        total = demo.prompts * demo.samples
        bar = _progress(total, demo.progress)
        groups = []
        t0 = time.perf_counter()
        reqs = [
            rc._as_request(
                p,
                SamplingParams(
                    max_new_tokens=demo.max_new_tokens,
                    temperature=demo.temperature,
                    top_p=demo.top_p,
                    seed=demo.seed + i * demo.samples,
                ),
            )
            for i, p in enumerate(prompts)
        ]
        async with rc.generate_many(reqs, n=demo.samples) as stream:
            async for g in stream:
                groups.append(g)
                bar.update(len(g.results))
        wall = time.perf_counter() - t0
        bar.close()
        stats = rc.stats()

    results = [r for g in groups for r in g.results]
    if demo.export:
        n = await asyncio.to_thread(export_demo_trajectories, demo.export, groups)
        say(f"wrote {n} trajectories to {demo.export}")
    out_tokens = sum(len(r.output_ids) for r in results)
    lat = sorted(r.timings.total_s for r in results)
    report = {
        "requests": len(results),
        "groups": len(groups),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "client_latency_p50_s": stats.latency_p50_s,
        "client_latency_p90_s": stats.latency_p90_s,
        "client_latency_p99_s": stats.latency_p99_s,
        "total_s": time.perf_counter() - t_start,
    }
    say("")
    say("throughput")
    say(f"  requests        {len(results)} in {wall:.2f}s = {report['requests_per_s']:.1f} req/s")
    say(f"  output tokens   {out_tokens} = {report['output_tokens_per_s']:.0f} tok/s")
    say("latency per request (client side)")
    say(
        f"  p50 {_ms(stats.latency_p50_s)}  p90 {_ms(stats.latency_p90_s)}  p99 {_ms(stats.latency_p99_s)}"
        f"   (engine-side p50 {_ms(lat[len(lat) // 2] if lat else None)})"
    )
    say("servers")
    for s in stats.servers:
        say(
            f"  {s.server_id:<14} {'alive' if s.alive else 'dead'}  completed {s.completed}  aborted {s.aborted}"
            f"  errors {s.errors}  p50 {_ms(s.latency_p50_s)}"
        )
    if groups:
        g = min(groups, key=lambda g: g.index)
        r = g.results[0]
        say("")
        say(f"one trajectory (prompt {g.index}, sample 1 of {len(g.results)})")
        if tok is not None:
            say(f"  prompt    {tok.decode(g.request.input_ids)!r}")
            say(f"  response  {tok.decode(r.output_ids)[:300]!r}")
        say(f"  prompt ids   {len(g.request.input_ids)} tokens: {g.request.input_ids[:12]}...")
        say(f"  output ids   {len(r.output_ids)} tokens: {r.output_ids[:12]}...")
        if r.logprobs:
            say(f"  logprobs     {[round(x, 3) for x in r.logprobs[:6]]}...")
        say(f"  finish       {r.finish_reason}   weight version {r.weight_version}   server {r.server_id}")
    say(f"\ndone in {report['total_s']:.1f}s")
    return report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"


class _NoBar:
    def update(self, n: int) -> None:
        return None

    def close(self) -> None:
        return None


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="generating", mininterval=0.2)


def export_demo_trajectories(path: str, groups: list[Any]) -> int:
    """Write the demo's samples as trajectories (one JSONL line each); returns how many."""
    from .export import trajectory_from_result, write_jsonl

    trajs = (
        trajectory_from_result(
            g.request.input_ids, r, sample_index=g.index, metadata={"prompt": g.index, "sample": k}
        )
        for g in groups
        for k, r in enumerate(g.results)
    )
    return write_jsonl(trajs, path)
