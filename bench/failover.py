"""Issue 36's failover figures: recovery after a server dies, and a poison request's cost.

* ``healthy``: the same 600 requests (50 tokens each) on a healthy fleet of 2 servers: the reference;
* ``sigkill`` / ``sigstop``: 3 servers, 600 requests of 50 tokens, the victim holding ~200 of them in
  flight, then SIGKILL (or SIGSTOP) of the victim: the time from the signal to the victim marked dead and to
  the last result, and how many requests failed;
* ``poison``: 3 in-process servers whose engine dies on any request holding token 666, 300 innocent requests
  (40 tokens) in flight, then the poison request: engines lost, innocents failed, wall time.

Servers are ``rollout-sdk serve --engine fake`` processes (``--fake-step-base-s`` per decode step, default
20 ms, so a 50-token request takes ~1 s).  ``--clear-suspects finished`` gives issue 25's rule (one suspect
per server until it finishes: the "before" column), ``answered`` (the default) issue 36's (one suspect on
probation per server, cleared by a later answer; client/scheduler.py, "Suspects").

Run::

    python bench/failover.py                                 # every part, issue 36's rule
    python bench/failover.py --clear-suspects finished       # the same with issue 25's rule
    python bench/failover.py --parts healthy,sigkill --tokens 200     # longer requests
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from hardening import poison_case  # the same poison experiment, with the client rule as an option
from harness import ServerProcs, log

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("healthy", "sigkill", "sigstop", "poison")
REQUESTS = 600


def _spawn(procs: ServerProcs, name: str, step_s: float) -> tuple[subprocess.Popen[str], str]:
    return procs.spawn(name, harness.fake_server_argv("--fake-step-base-s", str(step_s)))


async def _generate_all(client: Any, tokens: int, on_result: Any = None) -> tuple[list[Any], float]:
    from rollout_sdk import SamplingParams

    sp = SamplingParams(max_new_tokens=tokens)

    async def one(i: int) -> Any:
        try:
            r = await client.generate([5, 6, i % 1000 + 1], sampling=sp)
        except Exception as exc:  # counted, by type
            r = exc
        if on_result is not None:
            on_result()
        return r

    t = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i)) for i in range(REQUESTS)]
    return tasks, t


async def _healthy(procs: ServerProcs, args: argparse.Namespace) -> dict[str, Any]:
    from rollout_sdk import RolloutClient

    started = [_spawn(procs, f"healthy{i}", args.step_s) for i in range(2)]
    try:
        async with RolloutClient(servers=[a for _, a in started], clear_suspects=args.clear_suspects) as client:
            tasks, t = await _generate_all(client, args.tokens)
            results = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t
            failed = sum(1 for r in results if isinstance(r, BaseException))
            return {"servers": 2, "requests": REQUESTS, "wall_s": round(wall, 2), "failed": failed}
    finally:
        procs.stop([p for p, _ in started])


async def _kill(procs: ServerProcs, args: argparse.Namespace, sig: signal.Signals) -> dict[str, Any]:
    from rollout_sdk import RolloutClient

    started = [_spawn(procs, f"{sig.name.lower()}{i}", args.step_s) for i in range(3)]
    victim_proc, victim_addr = started[1]
    try:
        async with RolloutClient(servers=[a for _, a in started], clear_suspects=args.clear_suspects) as client:
            victim = next(c for c in client.servers if c.address == victim_addr)
            done = 0
            last = [0.0]

            def on_result() -> None:
                nonlocal done
                done += 1
                last[0] = time.perf_counter()

            tasks, t = await _generate_all(client, args.tokens, on_result)
            while victim.in_flight < REQUESTS // 3 - 10 and done == 0:  # the victim holds its share
                await asyncio.sleep(0.001)
            in_flight = victim.in_flight
            t_kill = time.perf_counter()
            os.kill(victim_proc.pid, sig)
            while victim.alive:
                await asyncio.sleep(0.005)
            t_dead = time.perf_counter()
            results = await asyncio.gather(*tasks)
            failed = collections.Counter(type(r).__name__ for r in results if isinstance(r, BaseException))
            sched = client.scheduler
            return {
                "signal": sig.name,
                "servers": 3,
                "requests": REQUESTS,
                "victim_in_flight": in_flight,
                "kill_to_dead_s": round(t_dead - t_kill, 2),
                "dead_to_last_s": round(last[0] - t_dead, 2),
                "kill_to_last_s": round(last[0] - t_kill, 2),
                "wall_s": round(last[0] - t, 2),
                "failed": dict(failed),
                "retried": sched.retried,
                "probes_sent": sched.probes_sent,
                "max_suspects_running_per_server": sched.max_suspects_running,
            }
    finally:
        if sig == signal.SIGSTOP:
            os.kill(victim_proc.pid, signal.SIGCONT)
        procs.stop([p for p, _ in started])


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    out: dict[str, Any] = {"clear_suspects": args.clear_suspects, "step_s": args.step_s, "tokens": args.tokens}
    with ServerProcs.session("failover-") as procs:
        if "healthy" in parts:
            log("healthy")
            out["healthy"] = await _healthy(procs, args)
        for name, sig in (("sigkill", signal.SIGKILL), ("sigstop", signal.SIGSTOP)):
            if name in parts:
                log(name)
                out[name] = await _kill(procs, args, sig)
        if "poison" in parts:
            log("poison")
            out["poison"] = await poison_case(clear_suspects=args.clear_suspects)
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--clear-suspects", choices=["answered", "finished"], default="answered")
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--tokens", type=int, default=50, help="new tokens per request (the issue: 50)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = harness.run(_drive(args), uvloop=False)
    for k, v in out.items():
        print(f"{k}: {v}")
    name = args.out or f"bench/results/failover_{args.clear_suspects}.json"
    harness.save_results(name, [out], vars(args))


if __name__ == "__main__":
    main()
