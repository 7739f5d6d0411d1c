"""Long tail and load balance: the makespan of one synchronous RL rollout step over D data-parallel servers.

What is measured
----------------
One rollout step of a synchronous RL loop: ``B`` requests are sent at once and the step ends when the
last one finishes (the *makespan*).  Response lengths are long-tailed: lognormal (seeded), rounded,
clipped to ``[1, cap]`` (RL always has a response-length cap).  Each request gets
``max_new_tokens = its length`` and ``ignore_eos=True``; the fake engine's default outputs are
``(last_prompt_token + i + 1) % vocab`` and the prompts end in small ids, so they never reach EOS and each
request decodes exactly its length.  The placement schemes, all through the real client and real servers:

a. ``least_load``      -- the SDK's default policy, all ``B`` requests submitted at once (default
                          ``max_in_flight_per_server=512``, so nothing waits in the client).
a'. ``least_load (lengths hidden)`` -- the same, but every request has the same ``max_new_tokens = cap`` and
                          stops on EOS at its length (the prompt ends in ``vocab - length``, so the default
                          output reaches EOS id 0 exactly there).  In RL the length is not known in advance;
                          in (a) the policy's tie-break on outstanding tokens sees it.
b. ``round_robin``     -- ``RolloutClient(policy="round_robin")``.
c. ``static split``    -- the batch cut into D equal contiguous chunks, chunk i sent to server i (one
                          ``RolloutClient(servers=[address_i])`` per server): the approach the scheduler
                          replaces.  Every ratio below is to this one, per seed (same lengths).
d. ``least_load + cap`` -- the default policy with ``max_in_flight_per_server = max_batch``: the rest of
                          the batch waits in the client (FIFO) and goes to whichever server frees a slot.

Workloads (``--workloads``): ``skewed`` -- the issue's: B=512, lognormal median 64 tokens, sigma 1.0,
cap 1024; ``throughput`` -- B=2048, median 24, sigma 0.5, cap 256 (eight batches' worth per server, so the
servers are throughput-bound rather than bound by the longest request).  Each on two server sets:
``4 equal`` and ``3 + 1 slow`` (one server with twice the ``step_base_s``).

The cost model
--------------
Each server is ``python -m rollout_sdk serve --engine fake`` (a separate process) in *batched* mode: every
step decodes one token for each running request (at most ``max_batch``, the rest wait FIFO) and takes
``step_s = step_base_s + step_per_seq_s * batch``.  Defaults: ``step_base_s = 2 ms`` (the fixed cost of a
decode step: weights read once), ``step_per_seq_s = 0.02 ms`` (KV reads, sampling), ``max_batch = 64``;
so one step costs 2.02 ms alone and 3.28 ms with a full batch, a full server decodes ~19.5k tokens/s, and a
request of L tokens takes at least L * 2.02 ms.  The slow server has ``step_base_s = 4 ms``.

The fake engine sleeps with ``asyncio.sleep``, whose timers (uvloop / libuv) have millisecond
resolution, so the executed step times are not exactly the nominal ones (measured on the 2-core machine:
~2.15 ms for batches up to 24 and ~3.15 ms from 32 on; the slow server ~4.15 / ~5.2 ms: the sleep is
rounded to whole milliseconds, plus ~0.15 ms of loop overhead).  The script therefore first
*calibrates*: on one server at a time it times ``b`` requests of two lengths for several batch sizes ``b``
and takes the per-step time from the difference (fixed overheads cancel).  A discrete-event simulation of
the same cost model with those calibrated step times then predicts each run's makespan ("model"), and
gives a lower bound no placement can beat::

    makespan >= max( L_max * step(1),  total tokens / sum over servers of (max_batch / step(max_batch)) )

(a request's tokens are sequential; a server decodes at most max_batch tokens per step).  Measured and
model agree within a few percent (the table shows both; measured is ~2-8% higher: the client's own time to
send and receive the batch), which is the evidence that running 5 server processes and the client on a
2-core machine does not distort the numbers.  The exception is (d) on the skewed workload with a slow
server, where which server the few longest requests land on depends on completion timing.

Why the placement barely matters on the skewed workload: with 512 requests over 4 servers of 64 rows, a
server holds two batches' worth, so its work (~2 x mean length steps at full batch) is far below the
longest request (~16 x the median).  Every scheme's makespan is about ``L_max`` steps of a small batch plus
the time the longest request waited for a row, which is short (rows free up as short requests finish: in
a batching engine a short request waits for a row, not behind a long request).  The lower bound is
already ~0.85-0.9 x the static split, so ``<= 0.75 x static`` is out of reach for *any* placement that
cannot split a request.  Balance matters when servers are throughput-bound (the ``throughput`` workload)
and, much more, when they differ in speed.  Then only (d) helps: in (a) the default cap (512 per server)
is never reached, so all ``B`` requests are placed at t=0, before anything completes, on equal in-flight
counts (ties broken by outstanding tokens) -- a count-balanced static split that cannot see a server's
speed.  With the cap at ``max_batch`` the rest of the batch waits in the client and each completion pulls
the next request, so a server's share follows its speed.  On the skewed workload even (d) cannot keep the
few longest requests off the slow server (it does not know lengths): the request that finishes last is a
long one that ran there.

How
---
Servers start once (4 equal + 1 slow) and are reused; for each workload, server set and seed every scheme
runs once on the same lengths (scheme order rotated per seed), with fresh clients opened before the clock
starts.  Client CPU and the CPU other processes used during each run are recorded (``--wait-quiet`` waits
for a quiet machine and repeats a disturbed run).  Results are checked: every request returns exactly its
length.

Run::

    python bench/load_balance.py            # full: 3 seeds, both workloads, ~2.3 minutes
    python bench/load_balance.py --quick    # 1 seed, ~40 s
    python bench/load_balance.py --seeds 0 1 2 3 4 5 --workloads skewed   # tighter means
    python bench/load_balance.py --wait-quiet 120   # on a shared machine: runs wait for / repeat on quiet

Numbers go to ``--json`` (default ``bench/results/load_balance.json``); the table is printed last.
Every process this script starts is stopped at the end, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import heapq
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness import ServerProcs, interpolate, log
from harness.stats import StepFn
from workloads.lengths import WORKLOADS  # bench/workloads/: the long-tailed batches

VOCAB = 151936
TARGET_RATIO = 0.75
PROMPT_TOKENS = 16

SCHEMES = ("static", "round_robin", "least_load", "least_load_hidden", "least_load_cap")
SCHEME_LABEL = {
    "static": "(c) static split",
    "round_robin": "(b) round robin",
    "least_load": "(a) least_load",
    "least_load_hidden": "(a') least_load, lengths hidden",
    "least_load_cap": "(d) least_load + cap=max_batch",
}


@dataclass(frozen=True)
class CostModel:
    step_base_s: float
    step_per_seq_s: float
    max_batch: int
    slow_factor: float

    def server_args(self, slow: bool) -> list[str]:
        base = self.step_base_s * (self.slow_factor if slow else 1.0)
        return [
            "--fake-step-base-s",
            repr(base),
            "--fake-step-per-seq-s",
            repr(self.step_per_seq_s),
            "--fake-max-batch",
            str(self.max_batch),
        ]


@dataclass
class Run:
    workload: str
    servers: str
    seed: int
    scheme: str
    makespan_s: float
    model_s: float
    #: tokens decoded per server (in server order), and max / mean of those
    tokens_per_server: list[int]
    requests_per_server: list[int]
    token_imbalance: float
    p50_latency_s: float
    client_cpu_s: float
    #: the longest request: its server, when it finished (from the start), how long it waited for a row
    #: (finish - its decode time in the engine: client queue + transfer + engine queue)
    longest_tokens: int = 0
    longest_server: str = ""
    longest_finish_s: float = 0.0
    longest_start_delay_s: float = 0.0
    #: the request that finished last (it sets the makespan): its length, server and wait for a row
    last_tokens: int = 0
    last_server: str = ""
    last_start_delay_s: float = 0.0
    #: CPU of other processes on the machine during the run, % of one core (None without psutil)
    foreign_cpu_pct: float | None = None


@dataclass
class Report:
    meta: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)


# -- processes -------------------------------------------------------------------------------------------


def fake_server(procs: ServerProcs, server_id: str, *args: str) -> str:
    """Start ``python -m rollout_sdk serve --engine fake``; its address."""
    return procs.spawn(server_id, harness.fake_server_argv("--server-id", server_id, *args))[1]


# -- the cost model, simulated -----------------------------------------------------------------------------


def simulate(
    steps: Sequence[StepFn],
    max_batch: int,
    *,
    assigned: Sequence[Sequence[int]] | None = None,
    pulled: Sequence[int] | None = None,
    cap: int = 0,
) -> float:
    """Makespan of the fake engine's step loop on each server.

    ``assigned``: per-server request lengths, all arriving at t=0 (FIFO).  ``pulled``: lengths waiting in
    the client, placed like the scheduler with a per-server cap (least in-flight, then fewest outstanding
    tokens, then server index); one sent after a completion joins its server's batch one step later (it
    arrives while the server sleeps through the next step), or at once when that server is idle.
    """
    d = len(steps)
    waiting: list[collections.deque[int]] = [collections.deque(a) for a in (assigned or [[]] * d)]
    running: list[list[list[int]]] = [[] for _ in range(d)]  # [tokens left, length]
    arrivals: list[collections.deque[tuple[float, int]]] = [collections.deque() for _ in range(d)]
    in_flight = [0] * d
    tokens = [0] * d
    queue = collections.deque(pulled or [])
    idle = [False] * d
    heap: list[tuple[float, int, bool]] = []  # (time, server, woken from idle)

    def place(t: float) -> None:
        while queue:
            free = [s for s in range(d) if in_flight[s] < cap]
            if not free:
                return
            s = min(free, key=lambda k: (in_flight[k], tokens[k], k))
            n = queue.popleft()
            in_flight[s] += 1
            tokens[s] += n
            arrivals[s].append((t, n))
            if idle[s]:
                idle[s] = False
                heapq.heappush(heap, (t, s, True))

    place(-1.0)
    for s in range(d):
        heapq.heappush(heap, (0.0, s, False))
    makespan = 0.0
    while heap:
        now, s, woken = heapq.heappop(heap)
        arr = arrivals[s]
        while arr and (arr[0][0] < now or (woken and arr[0][0] <= now)):
            waiting[s].append(arr.popleft()[1])
        while len(running[s]) < max_batch and waiting[s]:
            n = waiting[s].popleft()
            running[s].append([n, n])
        if not running[s]:
            idle[s] = True
            continue
        end = now + steps[s](len(running[s]))
        left: list[list[int]] = []
        done: list[int] = []
        for r in running[s]:
            r[0] -= 1
            if r[0]:
                left.append(r)
            else:
                done.append(r[1])
        running[s] = left
        heapq.heappush(heap, (end, s, False))
        if done:
            makespan = max(makespan, end)
            if pulled is not None:
                in_flight[s] -= len(done)
                tokens[s] -= sum(done)
                place(end)
    return makespan


def lower_bound(lengths: Sequence[int], steps: Sequence[StepFn], max_batch: int) -> float:
    per_token = max(lengths) * min(f(1) for f in steps)
    capacity = sum(max_batch / f(max_batch) for f in steps)
    return max(per_token, sum(lengths) / capacity)


def static_chunks(lengths: Sequence[int], d: int) -> list[list[int]]:
    b = len(lengths)
    return [list(lengths[i * b // d : (i + 1) * b // d]) for i in range(d)]


def least_load_split(lengths: Sequence[int], d: int, *, hidden: bool, cap_tokens: int) -> list[list[int]]:
    """The LeastLoad policy's placement when all requests arrive before any completes."""
    in_flight = [0] * d
    tokens = [0] * d
    out: list[list[int]] = [[] for _ in range(d)]
    for n in lengths:
        s = min(range(d), key=lambda k: (in_flight[k], tokens[k], k))
        out[s].append(n)
        in_flight[s] += 1
        tokens[s] += cap_tokens if hidden else n
    return out


def model_makespan(
    scheme: str, lengths: Sequence[int], steps: Sequence[StepFn], max_batch: int, cap_tokens: int
) -> float:
    d = len(steps)
    if scheme == "static":
        return simulate(steps, max_batch, assigned=static_chunks(lengths, d))
    if scheme == "round_robin":
        return simulate(steps, max_batch, assigned=[list(lengths[i::d]) for i in range(d)])
    if scheme in ("least_load", "least_load_hidden"):
        split = least_load_split(lengths, d, hidden=scheme == "least_load_hidden", cap_tokens=cap_tokens)
        return simulate(steps, max_batch, assigned=split)
    return simulate(steps, max_batch, pulled=lengths, cap=max_batch)


# -- measurement -------------------------------------------------------------------------------------------


def _requests(lengths: Sequence[int], hidden: bool, cap: int) -> list[tuple[list[int], Any]]:
    from rollout_sdk import SamplingParams

    head = [1000 + (i * 7919) % 50_000 for i in range(PROMPT_TOKENS - 1)]
    out: list[tuple[list[int], Any]] = []
    for i, n in enumerate(lengths):
        if hidden:  # same max_new_tokens for all; the default output hits EOS (id 0) after n tokens
            out.append(([*head, VOCAB - n], SamplingParams(max_new_tokens=cap)))
        else:  # ends in a small id: (id + i + 1) never wraps to EOS within n tokens; EOS ignored anyway
            out.append(([*head, 1 + i % 1000], SamplingParams(max_new_tokens=n, ignore_eos=True)))
    return out


async def run_once(
    scheme: str, addresses: Sequence[str], lengths: Sequence[int], cost: CostModel, cap: int
) -> tuple[float, list[Any], list[float], float]:
    """One rollout step: (makespan, results and finish times in request order, client CPU seconds)."""
    from rollout_sdk import RolloutClient

    d = len(addresses)
    reqs = _requests(lengths, scheme == "least_load_hidden", cap)
    async with contextlib.AsyncExitStack() as stack:
        if scheme == "static":
            clients = [await stack.enter_async_context(RolloutClient(servers=[a])) for a in addresses]
            b = len(reqs)
            owner = []  # chunk k = requests [k*b//d, (k+1)*b//d) -> server k
            for k, c in enumerate(clients):
                owner += [c] * ((k + 1) * b // d - k * b // d)
        else:
            options: dict[str, Any] = {}
            if scheme == "round_robin":
                options["policy"] = "round_robin"
            if scheme == "least_load_cap":
                options["max_in_flight_per_server"] = cost.max_batch
            client = await stack.enter_async_context(RolloutClient(servers=list(addresses), **options))
            owner = [client] * len(reqs)
        finish = [0.0] * len(reqs)

        async def one(i: int, c: Any, prompt: list[int], sp: Any) -> Any:
            r = await c.generate(prompt, sampling=sp)
            finish[i] = time.perf_counter() - t0
            return r

        cpu0 = time.process_time()
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one(i, c, p, s) for i, (c, (p, s)) in enumerate(zip(owner, reqs, strict=True)))
        )
        makespan = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    for n, r in zip(lengths, results, strict=True):
        want = "stop" if scheme == "least_load_hidden" else "length"
        if len(r.output_ids) != n or r.finish_reason != want:
            raise AssertionError(f"{scheme}: expected {n} tokens ({want}), got {len(r.output_ids)} ({r.finish_reason})")
    return makespan, list(results), finish, cpu


async def calibrate(address: str, cost: CostModel, n1: int, n2: int) -> dict[int, float]:
    """Executed step time per batch size on one server: (wall(n2) - wall(n1)) / (n2 - n1) for b requests."""
    from rollout_sdk import RolloutClient, SamplingParams

    sizes = sorted({1, 2, 4, 8, 16, 24, 32, 48, cost.max_batch})
    out: dict[int, float] = {}
    async with RolloutClient(servers=[address]) as client:

        async def wall(b: int, n: int) -> float:
            sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            await asyncio.gather(*(client.generate([5, 6, 7, 8 + i], sampling=sp) for i in range(b)))
            return time.perf_counter() - t0

        await wall(4, 4)  # warm
        for b in sizes:
            if b > cost.max_batch:
                continue
            out[b] = (await wall(b, n2) - await wall(b, n1)) / (n2 - n1)
    return out


def _nominal(cost: CostModel, slow: bool) -> dict[int, float]:
    base = cost.step_base_s * (cost.slow_factor if slow else 1.0)
    return {b: base + cost.step_per_seq_s * b for b in (1, cost.max_batch)}


async def run_all(args: argparse.Namespace, report: Report, procs: ServerProcs) -> None:
    cost = CostModel(args.step_base_s, args.step_per_seq_s, args.max_batch, args.slow_factor)
    d = args.servers
    log(f"starting {d} equal servers and 1 slow one")
    fast = [await asyncio.to_thread(fake_server, procs, f"s{i}", *cost.server_args(False)) for i in range(d)]
    slow = await asyncio.to_thread(fake_server, procs, "slow", *cost.server_args(True))
    server_sets = {f"{d} equal": fast, f"{d - 1} + 1 slow": [*fast[: d - 1], slow]}
    if args.no_hetero:
        server_sets.pop(f"{d - 1} + 1 slow")

    log("calibrating the executed step time per batch size")
    fast_cal = await calibrate(fast[0], cost, args.cal_tokens[0], args.cal_tokens[1])
    slow_cal = await calibrate(slow, cost, args.cal_tokens[0], args.cal_tokens[1])
    report.calibration = {
        "tokens": args.cal_tokens,
        "fast_step_s": fast_cal,
        "slow_step_s": slow_cal,
        "nominal_fast_step_s": _nominal(cost, False),
        "nominal_slow_step_s": _nominal(cost, True),
    }
    for name, cal in (("equal", fast_cal), ("slow", slow_cal)):
        log(f"  {name}: " + ", ".join(f"b={b}: {1e3 * s:.2f} ms" for b, s in cal.items()))
    step_fast, step_slow = interpolate(fast_cal), interpolate(slow_cal)

    # warm every server and code path once
    await run_once("least_load", [*fast, slow], [8] * 64, cost, 8)

    for wname in args.workloads:
        w = WORKLOADS[wname]
        for sname, addrs in server_sets.items():
            steps = [step_fast] * len(addrs) if addrs is fast else [*[step_fast] * (d - 1), step_slow]
            key = f"{wname} / {sname}"
            report.bounds[key] = {}
            for si, seed in enumerate(args.seeds):
                lengths = w.lengths(seed)
                lb = lower_bound(lengths, steps, cost.max_batch)
                report.bounds[key][str(seed)] = lb
                order = list(args.schemes)
                order = order[si % len(order) :] + order[: si % len(order)]
                for scheme in order:
                    cell = functools.partial(run_once, scheme, addrs, lengths, cost, w.cap)
                    got, foreign, _ = await harness.until_quiet(
                        cell, wait_quiet_s=args.wait_quiet, retries=args.retries
                    )
                    makespan, results, finish, cpu = got
                    ids = [f"s{i}" for i in range(d)] if addrs is fast else [*(f"s{i}" for i in range(d - 1)), "slow"]
                    toks = dict.fromkeys(ids, 0)
                    reqs = dict.fromkeys(ids, 0)
                    for r in results:
                        toks[r.server_id] += len(r.output_ids)
                        reqs[r.server_id] += 1
                    lat = sorted(r.timings.total_s for r in results)
                    run = Run(
                        workload=wname,
                        servers=sname,
                        seed=seed,
                        scheme=scheme,
                        makespan_s=makespan,
                        model_s=model_makespan(scheme, lengths, steps, cost.max_batch, w.cap),
                        tokens_per_server=list(toks.values()),
                        requests_per_server=list(reqs.values()),
                        token_imbalance=max(toks.values()) / (sum(toks.values()) / len(toks)),
                        p50_latency_s=lat[len(lat) // 2],
                        client_cpu_s=cpu,
                        foreign_cpu_pct=foreign,
                    )
                    k = max(range(len(lengths)), key=lengths.__getitem__)
                    lr = results[k]
                    run.longest_tokens = lengths[k]
                    run.longest_server = lr.server_id
                    run.longest_finish_s = finish[k]
                    run.longest_start_delay_s = finish[k] - (lr.timings.total_s - lr.timings.queue_s)
                    k = max(range(len(lengths)), key=finish.__getitem__)
                    lr = results[k]
                    run.last_tokens = lengths[k]
                    run.last_server = lr.server_id
                    run.last_start_delay_s = finish[k] - (lr.timings.total_s - lr.timings.queue_s)
                    report.runs.append(run)
                    log(
                        f"{key:28s} seed={seed} {SCHEME_LABEL[scheme]:34s} makespan {makespan:6.3f} s "
                        f"(model {run.model_s:6.3f}, bound {lb:6.3f})  tokens/server {run.tokens_per_server}  "
                        f"longest ({run.longest_tokens} tok) on {run.longest_server}, waited "
                        f"{1e3 * run.longest_start_delay_s:.0f} ms, done at {run.longest_finish_s:.3f} s; last done: "
                        f"{run.last_tokens} tok on {run.last_server}, waited {1e3 * run.last_start_delay_s:.0f} ms; "
                        f"client cpu {cpu:.2f} s"
                    )


# -- report --------------------------------------------------------------------------------------------------


def summarize(report: Report) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r.workload, r.servers) for r in report.runs))
    for wname, sname in keys:
        runs = [r for r in report.runs if (r.workload, r.servers) == (wname, sname)]
        static = {r.seed: r.makespan_s for r in runs if r.scheme == "static"}
        static_model = {r.seed: r.model_s for r in runs if r.scheme == "static"}
        bounds = report.bounds[f"{wname} / {sname}"]
        for scheme in SCHEMES:
            mine = [r for r in runs if r.scheme == scheme]
            if not mine:
                continue
            ms = [r.makespan_s for r in mine]
            ratios = [r.makespan_s / static[r.seed] for r in mine if r.seed in static]
            mratios = [r.model_s / static_model[r.seed] for r in mine if r.seed in static_model]
            rows.append(
                {
                    "workload": wname,
                    "servers": sname,
                    "scheme": scheme,
                    "seeds": [r.seed for r in mine],
                    "makespan_mean_s": statistics.mean(ms),
                    "makespan_sd_s": statistics.stdev(ms) if len(ms) > 1 else 0.0,
                    "ratio_to_static": statistics.mean(ratios) if ratios else None,
                    "model_mean_s": statistics.mean(r.model_s for r in mine),
                    "model_ratio_to_static": statistics.mean(mratios) if mratios else None,
                    "bound_mean_s": statistics.mean(bounds[str(r.seed)] for r in mine),
                    "bound_ratio_to_static": statistics.mean(bounds[str(r.seed)] / static[r.seed] for r in mine)
                    if static
                    else None,
                    "token_imbalance": statistics.mean(r.token_imbalance for r in mine),
                    "slow_server_token_share": statistics.mean(
                        r.tokens_per_server[-1] / sum(r.tokens_per_server) for r in mine
                    ),
                    "client_cpu_s": statistics.mean(r.client_cpu_s for r in mine),
                    "longest_on_slow": sum(r.longest_server == "slow" for r in mine),
                    "longest_start_delay_s": statistics.mean(r.longest_start_delay_s for r in mine),
                    "longest_finish_over_makespan": statistics.mean(r.longest_finish_s / r.makespan_s for r in mine),
                    "last_tokens_over_longest": statistics.mean(r.last_tokens / r.longest_tokens for r in mine),
                    "last_on_slow": sum(r.last_server == "slow" for r in mine),
                    "last_start_delay_s": statistics.mean(r.last_start_delay_s for r in mine),
                }
            )
    return rows


def render(report: Report, rows: list[dict[str, Any]]) -> str:
    cal = report.calibration
    lines = [
        "executed step time (calibrated) vs nominal cost model, ms: "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"b={b} {1e3 * s:.2f}" for b, s in cal[key].items() if b in (1, 32, max(cal[key])))
            + " (nominal "
            + ", ".join(f"b={b} {1e3 * s:.2f}" for b, s in cal["nominal_" + key].items())
            + ")"
            for name, key in (("equal server", "fast_step_s"), ("slow server", "slow_step_s"))
        ),
        "",
    ]
    hdr = (
        f"{'workload':<11}{'servers':<12}{'scheme':<34}{'makespan s':>14}{'/static':>9}{'model s':>9}"
        f"{'/static':>9}{'bound':>8}{'tok max/mean':>13}{'slow tok':>10}{'last: len/Lmax':>16}{'on slow':>9}"
        f"{'waited':>10}"
    )
    lines += [hdr, "-" * len(hdr)]
    prev = None
    for r in rows:
        if prev is not None and prev != (r["workload"], r["servers"]):
            lines.append("")
        prev = (r["workload"], r["servers"])
        hetero = "slow" in r["servers"]
        slow = f"{100 * r['slow_server_token_share']:.1f}%" if hetero else ""
        on_slow = f"{r['last_on_slow']}/{len(r['seeds'])}" if hetero else ""
        spread = f"{r['makespan_mean_s']:.3f}+-{r['makespan_sd_s']:.3f}"
        lines.append(
            f"{r['workload']:<11}{r['servers']:<12}{SCHEME_LABEL[r['scheme']]:<34}{spread:>14}"
            f"{r['ratio_to_static']:>8.2f}x{r['model_mean_s']:>9.3f}{r['model_ratio_to_static']:>8.2f}x"
            f"{r['bound_ratio_to_static']:>7.2f}x{r['token_imbalance']:>13.3f}{slow:>10}"
            f"{r['last_tokens_over_longest']:>16.2f}{on_slow:>9}{1e3 * r['last_start_delay_s']:>7.0f} ms"
        )
    lines += [
        "",
        "makespan: mean+-sd over seeds; /static: mean per-seed ratio to the static split (same lengths); model: the",
        "cost-model simulation with the calibrated step times; bound: max(L_max*step(1), tokens/capacity) / static;",
        "tok max/mean: busiest server's decoded tokens over the mean; slow tok: the slow server's share of tokens;",
        "last: the request that finished last (it sets the makespan): its length over the longest one's, on how",
        "many seeds it ran on the slow server, and how long it waited for a batch row (client + engine queue).",
    ]
    foreign = [r.foreign_cpu_pct for r in report.runs if r.foreign_cpu_pct is not None]
    if foreign:
        lines.append(
            f"other processes on the machine used {statistics.mean(foreign):.0f}% of a core on average during the runs "
            f"(max {max(foreign):.0f}%)" + ("  << noisy: numbers may be distorted" if max(foreign) > 20 else "")
        )
    lines.append("")
    for wname, sname in dict.fromkeys((r["workload"], r["servers"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["servers"]) == (wname, sname) and r["scheme"] != "static"]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["ratio_to_static"])
        bound = mine[0]["bound_ratio_to_static"]
        ok = best["ratio_to_static"] <= TARGET_RATIO
        lines.append(
            f"target makespan <= {TARGET_RATIO} x static, {wname} / {sname}: best {SCHEME_LABEL[best['scheme']]} "
            f"{best['ratio_to_static']:.2f}x -> {'met' if ok else 'NOT met'} (no placement can go below "
            f"{bound:.2f}x here)"
        )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.parser(
        __doc__,
        quick="one seed, shorter calibration (about 1 minute)",
        json="load_balance",
        json_type=Path,
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="length seeds (full 0 1 2, quick 0)")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["skewed", "throughput"])
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    p.add_argument("--servers", type=int, default=4, help="DP servers (default 4)")
    p.add_argument("--no-hetero", action="store_true", help="skip the set with one slow server")
    p.add_argument("--step-base-s", type=float, default=0.002)
    p.add_argument("--step-per-seq-s", type=float, default=0.00002)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--slow-factor", type=float, default=2.0, help="the slow server's step_base multiple")
    harness.add_quiet(p, "run")
    p.add_argument("--no-uvloop", action="store_true", help="run the client on the default asyncio loop")
    args = harness.by_mode(p.parse_args(argv), seeds=([0, 1, 2], [0]))
    args.cal_tokens = (10, 60) if args.quick else (20, 120)
    if args.servers < 2:
        p.error("--servers must be >= 2")
    if "static" not in args.schemes:
        args.schemes = ["static", *args.schemes]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report()
    report.meta = {
        **harness.facts(),
        **harness.mode_facts(args),
        "wait_quiet_s": args.wait_quiet,
        "cost_model": {
            "step_base_s": args.step_base_s,
            "step_per_seq_s": args.step_per_seq_s,
            "max_batch": args.max_batch,
            "slow_server_step_base_s": args.step_base_s * args.slow_factor,
        },
        "servers": args.servers,
        "seeds": args.seeds,
        "workloads": {w: asdict(WORKLOADS[w]) for w in args.workloads},
        "target": f"makespan <= {TARGET_RATIO} x static split",
    }
    t0 = time.perf_counter()
    with ServerProcs.session("load-balance-bench-") as procs:
        harness.run(run_all(args, report, procs), uvloop=not args.no_uvloop)
    report.meta["runtime_s"] = round(time.perf_counter() - t0, 1)
    rows = summarize(report)
    payload = {
        "meta": report.meta,
        "calibration": report.calibration,
        "summary": rows,
        "lower_bounds_s": report.bounds,
        "runs": [asdict(r) for r in report.runs],
    }
    harness.publish(args.json, payload, render(report, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
