"""The rollout phase on a long-tailed workload: batch-gather vs continuous refill vs carry-over.

What is measured
----------------
An RL loop of ``--steps`` steps.  Each step needs ``--batch`` finished samples; a sample's response length
is drawn lognormal (``max_new_tokens`` = the length, ``ignore_eos``), so a few samples are 5-10x the
median.  Between steps the "trainer" sleeps ``--train-s`` and bumps the weight version.  Three producers
(``client.rollouts`` modes) run the same workload against the same servers:

* ``sync`` — batch-gather: start exactly ``batch`` samples, wait for the last, train, repeat.  The engines
  idle while the long tail finishes and while the trainer trains.
* ``async`` — continuous refill with over-provisioning (``--over-provision`` x batch in flight); a batch is
  yielded as soon as ``batch`` samples are done; unfinished ones keep running (one version of staleness).
* ``partial`` — as async, but unfinished samples are aborted at each batch and resumed from their tokens
  on the next weights (carry-over of partial samples); ``max_staleness=1``.

Per batch: the rollout makespan (from the moment the trainer asks for the batch to the moment it gets it),
and each server's busy fraction (share of 20 ms ticks with at least one request in flight).  Target
(issue): carry-over makespan <= 0.5 x batch-gather.

The engines are fake engines in their own processes following a batching cost model (documented, not a
measurement of a GPU): each decode step advances every running request by one token and takes
``step_base_s + step_per_seq_s * batch``; at most ``max_batch`` run at once.

    python bench/longtail.py            # ~1 minute
    python bench/longtail.py --quick
    python bench/longtail.py --addresses tcp://h:p ... --median 256 --cap 4096   # against SGLang servers
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

import harness

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams


def start_servers(procs: harness.ServerProcs, n: int, a: argparse.Namespace) -> list[str]:
    """Start ``n`` fake servers with the cost model's step times; their addresses."""
    argv = harness.fake_server_argv(
        "--fake-step-base-s", str(a.step_base), "--fake-step-per-seq-s", str(a.step_per_seq),
        "--fake-max-batch", str(a.max_batch),
    )  # fmt: skip
    return [procs.spawn(f"fake{i}", argv)[1] for i in range(n)]


def prompts(n: int, a: argparse.Namespace, seed: int) -> list[GenerateRequest]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        length = max(1, min(a.cap, int(rnd.lognormvariate(0.0, a.sigma) * a.median)))
        out.append(GenerateRequest(input_ids=[11, i % 50000], sampling=SamplingParams(max_new_tokens=length)))
    return out


async def run_mode(mode: str, addrs: list[str], a: argparse.Namespace) -> dict[str, Any]:
    source = prompts(a.batch * (a.steps + 4), a, seed=a.seed)
    makespans, busy, tokens = [], [], 0
    async with RolloutClient(servers=addrs) as client:
        stream = client.rollouts(
            source,
            batch_groups=a.batch,
            mode=mode,
            over_provision=a.over_provision,
            max_staleness=None if mode == "sync" else 1,
        )
        async with stream:
            t_all = time.perf_counter()
            for _ in range(a.steps):
                t0 = time.perf_counter()
                batch = await stream.__anext__()
                makespans.append(time.perf_counter() - t0)
                busy.append(statistics.mean(batch.metrics["busy_fraction"].values()))
                tokens += batch.metrics["model_tokens"]
                await asyncio.sleep(a.train_s)  # the trainer's step: engines keep working in async/partial
                await client.set_weight_version(client.weight_version + 1)
            total = time.perf_counter() - t_all
    return {
        "mode": mode,
        "makespan_mean_s": statistics.mean(makespans),
        "makespan_p90_s": sorted(makespans)[int(0.9 * (len(makespans) - 1))],
        "busy_fraction": statistics.mean(busy),
        "total_s": total,
        "tokens_per_s": tokens / total,
        "makespans": makespans,
    }


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    with harness.ServerProcs.session("longtail-") as procs:
        # running servers (e.g. SGLang ones from launch/serve.sh): no fake servers started
        addrs = list(a.addresses) if a.addresses else start_servers(procs, a.servers, a)
        results = [await run_mode(m, addrs, a) for m in ("sync", "async", "partial")]
    base = results[0]["makespan_mean_s"]
    for r in results:
        r["makespan_vs_sync"] = r["makespan_mean_s"] / base
    return {
        "benchmark": "longtail",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cores": os.cpu_count(),
        "config": {k: v for k, v in vars(a).items() if k != "json"},
        "results": results,
    }


def table(results: list[dict[str, Any]]) -> str:
    """One row per producer mode (also bench/gpu_fleet.py's long-tail table)."""
    cols = {"makespan s": "makespan_mean_s", "p90 s": "makespan_p90_s", "vs sync": "makespan_vs_sync"}
    cols |= {"busy": "busy_fraction", "total s": "total_s", "tok/s": "tokens_per_s"}
    fmt = {"makespan s": ".3f", "p90 s": ".3f", "vs sync": ".2f", "busy": ".2f", "total s": ".2f", "tok/s": ".0f"}
    rows = [[r["mode"], *(f"{r[k]:{fmt[c]}}" for c, k in cols.items())] for r in results]
    return harness.table(["mode", *cols], rows)


def main() -> None:
    ap = harness.parser(__doc__, quick=True, json="longtail")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--median", type=int, default=40)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=800)
    ap.add_argument("--step-base", type=float, default=0.004)
    ap.add_argument("--step-per-seq", type=float, default=0.00005)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--over-provision", type=float, default=2.0)
    ap.add_argument("--train-s", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--addresses",
        nargs="*",
        default=None,
        help="use these running servers instead of fake ones (the GPU variant: SGLang servers)",
    )
    a = ap.parse_args()
    if a.quick:
        a.steps, a.batch = 4, 32
    res = harness.run(main_async(a))
    harness.write_json(a.json, res, indent=1)
    c = res["config"]
    print(
        f"\nlong-tail rollout: {c['servers']} fake servers (step {c['step_base'] * 1e3:.1f} ms + "
        f"{c['step_per_seq'] * 1e6:.0f} us/seq, max batch {c['max_batch']}), batch {c['batch']}, {c['steps']} steps, "
        f"lengths lognormal(median {c['median']}, sigma {c['sigma']}, cap {c['cap']}), train {c['train_s']} s/step"
    )
    print(table(res["results"]))
    part = next(r for r in res["results"] if r["mode"] == "partial")
    print(
        f"target carry-over makespan <= 0.5 x batch-gather: {part['makespan_vs_sync']:.2f} -> "
        f"{'met' if part['makespan_vs_sync'] <= 0.5 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
