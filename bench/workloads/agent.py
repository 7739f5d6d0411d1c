"""Agents: sessions of turns with tool waits between them, every session at once.

Each turn's prompt is the last one grown by the model's own output and the tool's result, so what an
engine keeps of a session's KV through the wait decides how much of the context is computed again.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from workloads.work import Draw, Item, Out, Work

#: ``gen(prompt, new tokens, group, session id)``: one turn on one side
Gen = Callable[[list[int], int, str | None, str | None], Awaitable[Out]]
#: ``hint(session id, expected wait in s or None, ended)``: the SDK's session hints
Hint = Callable[[str, float | None, bool], Awaitable[None]]


def sessions(name: str, draw: Draw, *, quick: bool, big: bool = True, salt: str = "") -> Work:
    """``agent``: 256 sessions x 4 turns, a 2,048-token first prompt growing by each turn's 128 output tokens
    and a 64-token tool result, tool waits uniform in 1-10 s (``quick``: 16 sessions, 10-100 ms)."""
    n = 16 if quick else 256
    w = Work(name, turns=4, turn_new=16 if quick else 128, tool_tokens=8 if quick else 64)
    w.sessions = [draw.ids(128 if quick else 2048) for _ in range(n)]
    lo, hi = (0.01, 0.1) if quick else (1.0, 10.0)
    w.waits = [[draw.shape.uniform(lo, hi) for _ in range(w.turns - 1)] for _ in range(n)]
    w.items = [Item(s, w.turn_new) for s in w.sessions]  # (for counting only)
    return w


def tool_ids(session: int, turn: int, n: int, vocab: int) -> list[int]:
    """A tool's result (or, where a side returns no output ids, the model's turn): ``n`` ids, the same on every side."""
    rnd = random.Random(f"tool-{session}-{turn}")
    return [rnd.randrange(1000, vocab - 1000) for _ in range(n)]


async def run_agent(work: Work, gen: Gen, turn_s: list[float], vocab: int, hint: Hint | None = None) -> list[Out]:
    """Every session at once: turn, tool wait, next turn on the context grown by the model's own tokens and
    the tool's result.  ``hint(session, wait_s, ended)``: the SDK's session hints (the tool's expected wait
    before it runs, "ended" after the last turn).  Each turn's latency is appended to ``turn_s``."""
    outs: list[Out] = []

    async def session(k: int) -> None:
        ctx = list(work.sessions[k])
        sid = f"agent-{id(work)}-{k}"
        for t in range(work.turns):
            t0 = time.perf_counter()
            o = await gen(ctx, work.turn_new, None, sid)
            turn_s.append(time.perf_counter() - t0)
            outs.append(o)
            if t + 1 < work.turns:
                if hint is not None:
                    await hint(sid, work.waits[k][t], False)
                await asyncio.sleep(work.waits[k][t])
                ctx += (o[4] or tool_ids(k, 1000 + t, o[0], vocab)) + tool_ids(k, t, work.tool_tokens, vocab)
            elif hint is not None:
                await hint(sid, None, True)

    await asyncio.gather(*(session(k) for k in range(len(work.sessions))))
    return outs
