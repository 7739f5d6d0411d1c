"""What an RL-step pass sends (:class:`Work`: requests or agent sessions) and its accounting (:func:`summarize`).

Prompts are random token ids from a :class:`Draw`, deterministic from the workload's name, the model's
shape and a salt (gpu_rlstep.py salts with the repetition and side, so no pass is served from another's
prefix cache).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any


class Draw:
    """The random draws of one workload: token ids within the vocabulary (``rnd``), and its shape (``shape``:
    GRPO's long-tailed lengths, prompt sizes, tool waits).  With ``shape_seed`` the shape has a stream of its
    own, so two passes can send different prompts (no cache hits between them) of the same lengths (one
    comparison: a long-tailed step's wall is its longest sample's); without it, one stream draws both."""

    def __init__(self, seed: str, vocab: int, *, shape_seed: str | None = None) -> None:
        self.rnd = random.Random(seed)
        self.shape = random.Random(shape_seed) if shape_seed is not None else self.rnd
        self.vocab = vocab

    def ids(self, n: int) -> list[int]:
        return [self.rnd.randrange(1000, self.vocab - 1000) for _ in range(n)]

    def tail_len(self) -> int:
        """GRPO's long tail: lognormal, median 300, at least 16, at most 2,048."""
        return int(min(2048, max(16, self.shape.lognormvariate(math.log(300), 1.0))))

    def size(self, lo: int, hi: int) -> int:
        """A prompt's size in [lo, hi) (the shape's stream)."""
        return self.shape.randrange(lo, hi)


@dataclass
class Item:
    prompt: list[int]
    max_new: int
    group: str | None = None


@dataclass
class Work:
    name: str
    items: list[Item] = field(default_factory=list)
    #: agent workloads: sessions of turns instead of items
    sessions: list[list[int]] = field(default_factory=list)
    turns: int = 0
    turn_new: int = 0
    tool_tokens: int = 0
    waits: list[list[float]] = field(default_factory=list)

    @property
    def ideal_prefill(self) -> int:
        if self.sessions:  # each turn's new tokens only: the first prompt, then the tool's result and the last
            # output token per turn (the model's other tokens are in the cache from decoding them)
            return sum(len(s) for s in self.sessions) + len(self.sessions) * (self.turns - 1) * (self.tool_tokens + 1)
        seen: set[tuple[str | None, int]] = set()
        total = 0
        for it in self.items:
            key = (it.group, len(it.prompt)) if it.group else (None, id(it))
            if key not in seen:
                seen.add(key)
                total += len(it.prompt)
        return total


#: one request's outcome: output tokens, prompt tokens, cached tokens, engine, output ids (agents)
Out = tuple[int, int, int, str, list[int] | None]


def summarize(work: Work, outs: list[Out], dt: float, turn_s: list[float] | None = None) -> dict[str, Any]:
    """A pass's row: wall, output tokens (/s), requests, prefill computed (prompt minus cached) and its ideal,
    requests / output tokens per engine, every token arrived (``ok``); agents: turn latencies and the share
    of a resumed turn's context computed again."""
    toks = sum(o[0] for o in outs)
    prefill = sum(max(0, o[1] - o[2]) for o in outs)
    per_engine: dict[str, list[int]] = {}
    for o, _, _, e, _ in outs:
        slot = per_engine.setdefault(e, [0, 0])
        slot[0] += 1
        slot[1] += o
    expect = sum(it.max_new for it in work.items) * (work.turns or 1) if not work.sessions else None
    row: dict[str, Any] = {
        "s": round(dt, 3),
        "tok": toks,
        "tok_s": round(toks / dt, 1),
        "requests": len(outs),
        "prefill": prefill,
        "prefill_ideal": work.ideal_prefill,
        "per_engine": per_engine,
        "ok": expect is None or toks == expect,
    }
    if turn_s:
        q = statistics.quantiles(turn_s, n=100)
        row["turn_p50_s"], row["turn_p95_s"] = round(statistics.median(turn_s), 3), round(q[94], 3)
        row["turn_p99_s"] = round(q[98], 3)
    if work.sessions:  # resumed turns (every turn but a session's first): the share of the context computed
        resumed = [(o[1], o[2]) for o in outs if o[1] > len(work.sessions[0]) + 1]
        if resumed:
            row["reprefill_frac"] = round(statistics.mean((p - c) / p for p, c in resumed), 4)
            row["reprefill_tokens"] = sum(p - c for p, c in resumed)
    return row


def load_cv(per_engine: dict[str, list[int]], index: int) -> float | None:
    """How unevenly the engines were loaded: the coefficient of variation of requests (0) or tokens (1)."""
    vals = [v[index] for v in per_engine.values()]
    if len(vals) < 2 or not sum(vals):
        return None
    return round(statistics.pstdev(vals) / statistics.mean(vals), 4)


def inferred_group_prefills(work: Work, outs: list[Out]) -> int:
    """Engines in other processes (``--serve``): a server where a group's members took all but the last
    prompt token from the cache computed the prompt once, in its prefill pass."""
    seen: set[tuple[str, str]] = set()
    total = 0
    for it, (_, p, c, server, _) in zip(work.items, outs, strict=True):
        if it.group and c >= p - 1 and (it.group, server) not in seen:
            seen.add((it.group, server))
            total += p
    return total
