"""The fixed workloads of bench/gpu_rl.py and bench/gpu_soak.py: ``(prompt ids, new tokens)`` per request,
drawn from a seed of the name and shape only, so every side and repetition sends the very same requests
(the benches flush the prefix cache between passes instead).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from workloads.work import Draw

#: (prompt ids, new tokens) per request
Requests = list[tuple[list[int], int]]


def make_workload(name: str, *, shape: str, max_running: int, vocab: int, quick: bool) -> Requests:
    """gpu_rl.py's: ``grpo``, ``short``, ``long``, ``oversub`` (4x the engine's running-request limit) and
    ``warm`` (a warm-up); deterministic from the name, the shape and the engine's limit."""
    draw = Draw(f"{name}-{shape}", vocab)
    ids = draw.ids
    big = shape != "7b"
    if name == "grpo":  # prompts x 8 samples, GRPO's long-tailed lengths
        prompts = 16 if quick else (64 if big else 32)
        out: Requests = []
        for _ in range(prompts):
            p = ids(draw.size(128, 513))
            for _ in range(8):
                n = draw.tail_len()  # drawn in quick mode too: the same prompts in both modes
                out.append((p, 64 if quick else n))
        return out
    if name == "warm":
        return [(ids(64), 8) for _ in range(256)]
    if name == "short":  # 64 in / 16 out
        return [(ids(64), 16) for _ in range(256 if quick else (8192 if big else 4096))]
    if name == "long":  # fixed 512-token prompts, long fixed outputs
        n, o = (32, 64) if quick else ((256, 1024) if big else (256, 512))
        return [(ids(64 if quick else 512), o) for _ in range(n)]
    if name == "oversub":  # 4x the engine's running-request limit at once
        n = 4 * max_running
        return [(ids(16), 8 if quick else 16) for _ in range(n)]
    raise ValueError(name)


def soak_workload(name: str, *, shape: str, vocab: int, quick: bool) -> Requests:
    """gpu_soak.py's one-shot workloads: gpu_rl.py's ``grpo``, ``short`` and ``oversub`` (4 x SGLang's running
    limit at 0.5B, 4,096); ``long`` (1,024 at 0.5B / 256 at 7B x 512 in / 512 out: the shape that stalled,
    issue #30) and ``long128`` (the same prompts, 128 new tokens: a shorter look at a stall)."""
    if name in ("grpo", "short", "oversub"):
        return make_workload(name, shape=shape, max_running=64 if quick else 4096, vocab=vocab, quick=quick)
    draw = Draw(f"soak-{name}-{shape}", vocab)
    if name in ("long", "long128"):
        n, out = (32, 64) if quick else ((1024 if shape != "7b" else 256), 512 if name == "long" else 128)
        return [(draw.ids(64 if quick else 512), out) for _ in range(n)]
    raise ValueError(name)


def agent_plan(*, shape: str, vocab: int, quick: bool) -> list[dict[str, Any]]:
    """gpu_soak.py's agents: per agent its first prompt, then per turn (new tokens, tool-result ids appended
    after the turn)."""
    draw = Draw(f"soak-agent-{shape}", vocab)
    agents = 16 if quick else (128 if shape != "7b" else 64)
    turns = 3 if quick else 4
    out = []
    for _ in range(agents):
        prompt = draw.ids(draw.size(128, 385))
        steps = []
        for _ in range(turns):
            n = 16 if quick else int(min(512, max(16, draw.shape.lognormvariate(math.log(128), 0.7))))
            steps.append((n, draw.ids(draw.size(32, 97))))
        out.append({"prompt": prompt, "turns": steps})
    return out


async def run_agents(
    plan: list[dict[str, Any]], turn: Callable[[int, list[int], int], Awaitable[tuple[list[int], int]]]
) -> tuple[int, bool]:
    """Run every agent of :func:`agent_plan` concurrently; ``turn(agent_index, prompt, n)`` -> (output ids,
    logprob count).  (output tokens, every turn answered in full)."""

    async def one(i: int, a: dict[str, Any]) -> tuple[int, bool]:
        prompt, toks, ok = list(a["prompt"]), 0, True
        for n, tool in a["turns"]:
            ids, lps = await turn(i, prompt, n)
            ok = ok and len(ids) == n and lps == n
            toks += len(ids)
            prompt = prompt + list(ids) + tool
        return toks, ok

    rows = await asyncio.gather(*(one(i, a) for i, a in enumerate(plan)))
    return sum(t for t, _ in rows), all(ok for _, ok in rows)


def summarize(outs: list[tuple[int, int]], expect: list[int], dt: float, *, req_s: bool = False) -> dict[str, Any]:
    """A pass's row from (output tokens, logprobs) per request in request order: wall, tokens (/s), requests/s
    (``req_s``), and ``ok``: every request answered with its new tokens and as many logprobs."""
    toks = sum(o for o, _ in outs)
    ok = len(outs) == len(expect) and all(o == e and lp == e for (o, lp), e in zip(outs, expect, strict=True))
    row: dict[str, Any] = {"s": round(dt, 3), "tok": toks, "tok_s": round(toks / dt, 1)}
    if req_s:
        row["req_s"] = round(len(outs) / dt, 1)
    row["ok"] = ok
    return row
