"""Dispatch overhead of rollout-sdk with a no-op engine, against a Ray async actor doing the same.

What is measured
----------------
1. **rollout-sdk**: 1 and 4 ``rollout-sdk serve --engine fake`` processes in *instant* mode (the default
   ``FakeEngineConfig``: ``step_base_s == 0``, so every request is answered as soon as it arrives), and one
   ``RolloutClient(servers=[...])`` in this process on uvloop.  Closed-loop load: ``c`` coroutines (1 and
   256) each awaiting ``client.generate(prompt, sampling=...)`` back to back, with a ~64-token prompt and
   ``max_new_tokens=4``.  The engine does no work, so the client-observed latency *is* the latency the SDK
   adds (client -> ZMQ -> server -> engine -> back).
2. **Ray baseline**, same run, same workload: ``ray.init(num_cpus=2, include_dashboard=False,
   log_to_driver=False)``, 1 and 4 async actors whose ``async def generate(self, input_ids, sampling)``
   returns ``{"output_ids", "logprobs", "finish_reason"}`` at once; the driver (same event loop kind) issues
   ``await actor.generate.remote(...)`` from ``c`` coroutines, round-robin over the actors.
   **Authentication on vs off** (``--auth both``, the default): every rollout-sdk cell is measured twice
   in alternation, ``--auth-reps`` times each (ABBA order: off on, on off, ...): servers without keys, and
   servers started with ``--secret-file`` (CURVE + ZAP, the client holding the control key;
   docs/security.md).  The table shows the medians side by side, auth/off req/s (of the medians, and the
   median of each repetition's pair) and the added p50 latency.
3. **Client memory** (rollout-sdk): (a) ``N`` requests held in flight on a fake server that never finishes
   them (``--fake-step-base-s 3600 --fake-max-batch 1``): growth of tracemalloc's current size and of RSS
   divided by ``N``, then they are cancelled; for scale, the same is measured for ``N`` bare asyncio tasks
   awaiting a future (the floor of any one-task-per-request design).  (b) tracemalloc current size and RSS
   after 1,000 and 10,000 completed requests (plus later checkpoints): these should stay flat.

How
---
Every cell gets fresh processes (servers for rollout-sdk, actors for Ray), warms up for ``--warmup``
seconds, then measures for ``--duration`` seconds: a request counts when it completes inside the window;
req/s is that count over the window; p50/p99 are over those requests' latencies (``perf_counter`` around
the await).  At concurrency 256 the latency is mostly queueing (Little's law: about 256 / req/s); the
added latency of one request is the concurrency-1 p50.  rollout-sdk runs first and Ray starts only after
every server has stopped, so neither shares the cores with the other's idle processes.

Per cell, psutil samples the CPU of this process, of its descendants (servers, or Ray's raylet, GCS and
workers) and of every other process on the machine ("foreign": other people's jobs on a shared machine,
which make the numbers noisy; ``--wait-quiet`` waits for them before each cell).

The fake engine keeps every request it has seen (``FakeEngine.requests_seen``, for tests), so a fake
server grows by a few KiB per request and spends more and more time in the garbage collector: its RSS at
the end of each cell is recorded.  ``--no-fake-history`` starts the servers through a small wrapper that
drops that list, to measure the dispatch path without it (src/ is not changed).

Run::

    python bench/dispatch.py            # full mode, ~2.5 minutes
    python bench/dispatch.py --quick    # ~1 minute
    python bench/dispatch.py --no-ray   # rollout-sdk only
    python bench/dispatch.py --no-ray --no-memory --auth-reps 3   # auth on vs off, medians of 3
    python bench/dispatch.py --wait-quiet 120   # on a shared machine

Numbers go to ``--json`` (default ``bench/results/dispatch.json``); the table is printed last.
Every process this script starts is stopped at the end, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness import CpuMeter, ServerProcs, foreign_load, log, pct, wait_quiet

VOCAB = 151936
TARGET_RATIO = 5.0
TARGET_P50_MS = 0.5


# -- results -------------------------------------------------------------------------------------------


@dataclass
class Cell:
    system: str
    servers: int
    concurrency: int
    requests: int
    duration_s: float
    req_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    #: CPU in % of one core: this (client / driver) process, its descendants (servers, or Ray's raylet,
    #: GCS and workers), and every other process on the machine (not ours: noise)
    client_cpu_pct: float | None = None
    children_cpu_pct: float | None = None
    foreign_cpu_pct: float | None = None
    #: RSS of each server at the end of the cell (rollout-sdk only)
    server_rss_mib: list[float] | None = None
    #: 1, or more when the cell was measured again because other processes used the cores
    attempts: int = 1


@dataclass
class Report:
    meta: dict[str, Any] = field(default_factory=dict)
    cells: list[Cell] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)


# -- process helpers -----------------------------------------------------------------------------------


def _rss_bytes(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (this process by default), in bytes."""
    return 1024 * harness.rss_kb(os.getpid() if pid is None else pid)


#: ``python -c`` wrapper for ``--no-fake-history``: FakeEngine keeps every request it has seen
#: (``requests_seen``, for tests); this drops them, so the server's memory stays flat under load
_NO_HISTORY_WRAPPER = """
import sys
from rollout_sdk.engines import fake

class _Drop(list):
    def append(self, item):
        pass

_init = fake.FakeEngine.__init__

def _patched(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.requests_seen = _Drop()

fake.FakeEngine.__init__ = _patched
from rollout_sdk.launch.cli import main
sys.exit(main(sys.argv[1:]))
"""


class FakeServers(ServerProcs):
    """``python -m rollout_sdk serve --engine fake`` processes, named in start order."""

    def __init__(self, logdir: Path, *, no_history: bool = False) -> None:
        super().__init__(logdir)
        self._no_history = no_history
        self._count = 0

    def fake(self, *args: str) -> tuple[subprocess.Popen[str], str]:
        entry = ["-c", _NO_HISTORY_WRAPPER] if self._no_history else ["-m", "rollout_sdk"]
        self._count += 1
        return self.spawn(f"server-{self._count - 1}", [sys.executable, *entry, "serve", "--engine", "fake", *args])

    @contextlib.asynccontextmanager
    async def fleet(self, n: int, *args: str) -> AsyncIterator[list[tuple[subprocess.Popen[str], str]]]:
        """``n`` fresh servers for one cell, stopped when it ends."""
        started: list[tuple[subprocess.Popen[str], str]] = []
        try:
            while len(started) < n:
                started.append(await asyncio.to_thread(self.fake, *args))
            yield started
        finally:
            await asyncio.to_thread(self.stop, [p for p, _ in started])


# -- the closed loop -----------------------------------------------------------------------------------


async def closed_loop(
    call: Callable[[], Awaitable[Any]],
    *,
    system: str,
    servers: int,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    quiet_s: float = 0.0,
) -> Cell:
    """``concurrency`` coroutines calling ``call`` back to back; measure those completing in the window."""
    await wait_quiet(quiet_s)
    perf = time.perf_counter
    lat: list[float] = []
    meter = CpuMeter()
    t_start = perf() + warmup_s
    t_end = t_start + duration_s

    async def worker() -> None:
        while True:
            t0 = perf()
            if t0 >= t_end:
                return
            await call()
            t1 = perf()
            if t_start <= t1 < t_end:
                lat.append(t1 - t0)

    async def meter_window() -> tuple[float, float, float] | None:
        await asyncio.sleep(max(0.0, t_start - perf()))
        meter.start()
        await asyncio.sleep(max(0.0, t_end - perf()))
        return meter.stop_all()

    cpu_task = asyncio.ensure_future(meter_window())
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu = await cpu_task
    lat.sort()
    n = len(lat)
    return Cell(
        system=system,
        servers=servers,
        concurrency=concurrency,
        requests=n,
        duration_s=duration_s,
        req_per_s=n / duration_s,
        p50_ms=1e3 * pct(lat, 0.50),
        p90_ms=1e3 * pct(lat, 0.90),
        p99_ms=1e3 * pct(lat, 0.99),
        mean_ms=1e3 * sum(lat) / n if n else float("nan"),
        max_ms=1e3 * lat[-1] if n else float("nan"),
        client_cpu_pct=cpu[0] if cpu else None,
        children_cpu_pct=cpu[1] if cpu else None,
        foreign_cpu_pct=cpu[2] if cpu else None,
    )


def _log_cell(c: Cell) -> None:
    cpu = ""
    if c.client_cpu_pct is not None:
        cpu = (
            f"  cpu: client {c.client_cpu_pct:.0f}% children {c.children_cpu_pct:.0f}% foreign {c.foreign_cpu_pct:.0f}%"
        )
    log(
        f"{c.system:11s} servers={c.servers} c={c.concurrency:<3d} {c.req_per_s:9.0f} req/s  "
        f"p50 {c.p50_ms:7.3f} ms  p99 {c.p99_ms:7.3f} ms{cpu}"
    )


# -- rollout-sdk ---------------------------------------------------------------------------------------


def _prompt(tokens: int) -> list[int]:
    return [1000 + (i * 7919) % 50_000 for i in range(tokens)]


async def measure(run_once: Callable[[], Awaitable[Cell]], args: argparse.Namespace) -> Cell:
    """Run one cell; with ``--wait-quiet``, run it again (up to ``--retries`` times) when other processes
    used more than QUIET_PCT of a core during its window."""

    async def logged() -> Cell:
        cell = await run_once()
        _log_cell(cell)
        return cell

    # closed_loop waits for a quiet machine and measures the foreign load in the cell's own window
    cell, _, attempts = await harness.until_quiet(
        logged,
        wait_quiet_s=args.wait_quiet,
        retries=args.retries,
        foreign=lambda c: c.foreign_cpu_pct,
        wait_first=False,
    )
    cell.attempts = attempts
    return cell


SDK_AUTH = "rollout-sdk+auth"


async def bench_sdk(procs: FakeServers, args: argparse.Namespace, report: Report) -> None:
    from rollout_sdk import JobSecret, RolloutClient, SamplingParams

    prompt = _prompt(args.prompt_tokens)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    secret_file = Path(tempfile.mkdtemp(prefix="rollout-sdk-bench-")) / "job.secret"
    JobSecret.generate().write(secret_file)
    creds = JobSecret.read(secret_file).credentials("control")

    async def one_cell(n: int, c: int, auth: bool) -> Cell:
        # fresh servers per cell: no cell inherits another's server state
        server_args = ("--secret-file", str(secret_file)) if auth else ()
        async with (
            procs.fleet(n, *server_args) as fleet,
            RolloutClient(servers=[a for _, a in fleet], credentials=creds if auth else None) as client,
        ):
            r = await client.generate(prompt, sampling=sp)  # sanity: the no-op engine's answer
            assert r.finish_reason == "length" and len(r.output_ids) == args.max_new_tokens, r
            assert r.logprobs is not None and len(r.logprobs) == args.max_new_tokens, r

            async def call() -> Any:
                return await client.generate(prompt, sampling=sp)

            cell = await closed_loop(
                call,
                system=SDK_AUTH if auth else "rollout-sdk",
                servers=n,
                concurrency=c,
                warmup_s=args.warmup,
                duration_s=args.duration,
                quiet_s=args.wait_quiet,
            )
            st = client.stats()
            assert st.errors == 0 and st.aborted == 0, st
            cell.server_rss_mib = [round(_rss_bytes(p.pid) / 2**20, 1) for p, _ in fleet]
        return cell

    modes = {"off": [False], "on": [True], "both": [False, True]}[args.auth]
    for n in args.servers:
        for c in args.concurrency:
            for rep in range(args.auth_reps):
                # alternating off / on in ABBA order (off on, on off, off on, ...): a drift through the run
                # (the machine's load, the VM's) hits both modes alike, where off-then-on every time put
                # each auth cell after its off cell and charged the drift to auth
                for auth in modes if rep % 2 == 0 else modes[::-1]:
                    report.cells.append(await measure(functools.partial(one_cell, n, c, auth), args))


def _traced() -> int:
    return tracemalloc.get_traced_memory()[0]


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0.05)
    gc.collect()


async def bench_memory_inflight(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """(a) client memory per request held in flight, then cancelled."""
    from rollout_sdk import RolloutClient, SamplingParams

    n = args.mem_inflight
    prompt = _prompt(args.prompt_tokens)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    out: dict[str, Any] = {"n": n, "prompt_tokens": args.prompt_tokens}

    # the floor: N bare tasks each awaiting a future (what any one-task-per-request design costs)
    loop = asyncio.get_running_loop()
    await _settle()
    base = _traced()
    futs = [loop.create_future() for _ in range(n)]

    async def bare(f: asyncio.Future[None]) -> None:
        await f

    tasks = [asyncio.ensure_future(bare(f)) for f in futs]
    await _settle()
    out["bare_task_bytes_per_request"] = (_traced() - base) / n
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    del futs, tasks

    from rollout_sdk.client.admission import AdmissionConfig

    # the stalled engine runs one request at a time: let the client's window queue all N there anyway
    # (the default window is the engine's running limit plus a short queue; the rest would wait here)
    admission = AdmissionConfig(ceiling=n + 64, min_queue=n + 64)
    async with RolloutClient(servers=[address], admission=admission) as client:
        conn = client.servers[0]

        async def hold(k: int) -> list[asyncio.Task[Any]]:
            ts = [asyncio.ensure_future(client.generate(prompt, sampling=sp)) for _ in range(k)]
            deadline = time.monotonic() + 60
            while True:  # every request sent, and every one arrived at the server
                await asyncio.sleep(0.05)
                if conn.num_pending == k and (await conn.fetch_stats()).in_flight == k:
                    return ts
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {conn.num_pending}/{k} requests in flight after 60 s")

        async def cancel(ts: list[asyncio.Task[Any]]) -> None:
            for t in ts:
                t.cancel()
            await asyncio.gather(*ts, return_exceptions=True)
            deadline = time.monotonic() + 30
            while (await conn.fetch_stats()).in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

        await cancel(await hold(min(n, 200)))  # warm every code path (send, abort, cancel) once
        await _settle()
        snap0 = tracemalloc.take_snapshot()  # before the baseline: the snapshot itself is traced memory
        traced0, rss0 = _traced(), _rss_bytes()
        tasks = await hold(n)
        await _settle()
        traced1, rss1 = _traced(), _rss_bytes()
        out["top_sites"] = [
            {"site": str(st.traceback[0]), "bytes_per_request": round(st.size_diff / n, 1)}
            for st in tracemalloc.take_snapshot().compare_to(snap0, "lineno")[:8]
        ]
        del snap0
        out["in_flight_confirmed_by_server"] = (await conn.fetch_stats()).in_flight
        t0 = time.perf_counter()
        await cancel(tasks)
        out["cancel_all_s"] = time.perf_counter() - t0
        del tasks
        await _settle()
        traced2, rss2 = _traced(), _rss_bytes()
    out.update(
        traced_bytes_per_request=(traced1 - traced0) / n,
        rss_bytes_per_request=(rss1 - rss0) / n,
        traced_after_cancel_minus_before=traced2 - traced0,
        rss_after_cancel_minus_before=rss2 - rss0,
    )
    return out


async def bench_memory_completed(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """(b) tracemalloc current size and RSS after 1,000 / 10,000 / ... completed requests."""
    from rollout_sdk import RolloutClient, SamplingParams

    prompt = _prompt(args.prompt_tokens)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    c = args.mem_concurrency
    points: list[dict[str, Any]] = []
    async with RolloutClient(servers=[address]) as client:
        done = 0

        async def run_until(total: int) -> None:
            nonlocal done
            issued = done

            async def worker() -> None:
                nonlocal issued, done
                while issued < total:
                    issued += 1
                    await client.generate(prompt, sampling=sp)
                    done += 1

            await asyncio.gather(*(worker() for _ in range(c)))

        await run_until(args.mem_warmup)
        await _settle()
        traced0, rss0 = _traced(), _rss_bytes()
        points.append({"completed": done, "traced_bytes": traced0, "rss_bytes": rss0})
        for target in args.mem_checkpoints:
            t0 = time.perf_counter()
            await run_until(target)
            dt = time.perf_counter() - t0
            await _settle()
            points.append(
                {"completed": done, "traced_bytes": _traced(), "rss_bytes": _rss_bytes(), "seconds_to_here": dt}
            )
        st = client.stats()
        assert st.errors == 0, st
        # the client keeps a bounded latency history: it fills up during the first requests
        history = {
            "Scheduler.latencies": client.scheduler.latencies.maxlen,
            "ServerConnection.latencies": client.servers[0].latencies.maxlen,
        }
    return {"concurrency": c, "warmup_requests": args.mem_warmup, "points": points, "latency_history_maxlen": history}


# -- Ray -----------------------------------------------------------------------------------------------


class _NoOpActor:
    """The Ray baseline's engine: answers like the instant fake engine, at once."""

    async def generate(self, input_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        n = sampling["max_new_tokens"]
        base = input_ids[-1]
        return {
            "output_ids": [(base + i + 1) % VOCAB for i in range(n)],
            "logprobs": [-0.1 * (1 + (i + 1) % 7) for i in range(n)],
            "finish_reason": "length",
        }


async def bench_ray(args: argparse.Namespace, report: Report) -> None:
    import ray

    prompt = _prompt(args.prompt_tokens)
    sampling = {"max_new_tokens": args.max_new_tokens}
    actor_cls: Any = ray.remote(num_cpus=0)(_NoOpActor)

    async def one_cell(n: int, c: int) -> Cell:
        actors: list[Any] = [actor_cls.remote() for _ in range(n)]  # fresh actors per cell
        try:
            await asyncio.gather(*(a.generate.remote(prompt, sampling) for a in actors))  # actors up
            r = await actors[0].generate.remote(prompt, sampling)
            assert r["finish_reason"] == "length" and len(r["output_ids"]) == args.max_new_tokens, r
            turn = 0

            async def call() -> Any:
                nonlocal turn
                a = actors[turn % n]
                turn += 1
                return await a.generate.remote(prompt, sampling)

            return await closed_loop(
                call,
                system="ray",
                servers=n,
                concurrency=c,
                warmup_s=args.warmup,
                duration_s=args.duration,
                quiet_s=args.wait_quiet,
            )
        finally:
            for a in actors:
                ray.kill(a)

    for n in args.servers:
        for c in args.concurrency:
            report.cells.append(await measure(functools.partial(one_cell, n, c), args))


# -- orchestration -------------------------------------------------------------------------------------


async def run_all(args: argparse.Namespace, report: Report, procs: FakeServers) -> None:
    report.meta["foreign_cpu_pct_at_start"] = await foreign_load()
    # rollout-sdk first, so that Ray's background processes do not share the cores with it
    await bench_sdk(procs, args, report)

    if not args.no_memory:
        async with (
            procs.fleet(1) as instant,
            # this measures the client: lift the server's admission cap (4,096 by default) above N
            procs.fleet(
                1, "--fake-step-base-s", "3600", "--fake-max-batch", "1", "--max-requests", str(10 * args.mem_inflight)
            ) as stalled,
        ):
            tracemalloc.start()
            try:
                log(f"client memory: {args.mem_inflight:,} requests in flight")
                report.memory["in_flight"] = await bench_memory_inflight(stalled[0][1], args)
                log(f"client memory: completed requests up to {args.mem_checkpoints[-1]:,}")
                report.memory["completed"] = await bench_memory_completed(instant[0][1], args)
            finally:
                tracemalloc.stop()

    if args.no_ray:
        return
    import logging

    import ray

    log("starting ray")
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    report.meta["ray_init_s"] = round(time.perf_counter() - t0, 2)
    try:
        await bench_ray(args, report)
    finally:
        ray.shutdown()


def _fmt_bytes(b: float) -> str:
    sign = "-" if b < 0 else ""
    b = abs(b)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{sign}{b:.0f} {unit}" if unit == "B" else f"{sign}{b:.1f} {unit}"
        b /= 1024
    return ""  # pragma: no cover


def render(report: Report) -> str:
    lines: list[str] = []
    ray_rate = {(c.servers, c.concurrency): c.req_per_s for c in report.cells if c.system == "ray"}
    order = sorted(report.cells, key=lambda c: (c.servers, c.concurrency, c.system != "rollout-sdk"))
    hdr = f"{'system':<12}{'servers':>8}{'conc':>6}{'req/s':>11}{'p50 ms':>10}{'p99 ms':>10}{'sdk/ray':>9}"
    hdr += f"{'cpu % me/kids/foreign':>23}"
    lines += [hdr, "-" * len(hdr)]
    for c in order:
        ratio = ""
        base = ray_rate.get((c.servers, c.concurrency))
        if c.system in ("rollout-sdk", SDK_AUTH) and base:
            ratio = f"{c.req_per_s / base:.2f}x"
        cpu = ""
        if c.client_cpu_pct is not None:
            cpu = f"{c.client_cpu_pct:.0f} / {c.children_cpu_pct:.0f} / {c.foreign_cpu_pct:.0f}"
        lines.append(
            f"{c.system:<12}{c.servers:>8}{c.concurrency:>6}{c.req_per_s:>11,.0f}{c.p50_ms:>10.3f}"
            f"{c.p99_ms:>10.3f}{ratio:>9}{cpu:>23}"
        )
    mem = report.memory
    if "in_flight" in mem:
        m = mem["in_flight"]
        lines.append("")
        lines.append(
            f"client memory per in-flight request (N={m['n']:,}, {m['prompt_tokens']}-token prompt): "
            f"tracemalloc {_fmt_bytes(m['traced_bytes_per_request'])}, RSS {_fmt_bytes(m['rss_bytes_per_request'])}"
            f"  (bare asyncio task awaiting a future: {_fmt_bytes(m['bare_task_bytes_per_request'])})"
        )
        lines.append(
            f"after cancelling all {m['n']:,} (took {m['cancel_all_s'] * 1e3:.0f} ms): tracemalloc "
            f"{_fmt_bytes(m['traced_after_cancel_minus_before'])}, "
            f"RSS {_fmt_bytes(m['rss_after_cancel_minus_before'])} vs. before"
        )
    if "completed" in mem:
        pts = mem["completed"]["points"]
        first = pts[0]
        lines.append(f"client memory after completed requests (c={mem['completed']['concurrency']}):")
        for p in pts:
            lines.append(
                f"  {p['completed']:>7,} done: tracemalloc {_fmt_bytes(p['traced_bytes']):>10} "
                f"({_fmt_bytes(p['traced_bytes'] - first['traced_bytes']):>10} vs {first['completed']:,}), "
                f"RSS {_fmt_bytes(p['rss_bytes']):>10} ({_fmt_bytes(p['rss_bytes'] - first['rss_bytes']):>10})"
            )
    if "completed" in mem:
        hist = mem["completed"]["latency_history_maxlen"]
        lines.append(
            "  (bounded by design: the client keeps the last "
            + " and ".join(f"{v:,} latencies ({k})" for k, v in hist.items())
            + "; flat once they are full)"
        )
    if "in_flight" in mem:
        top = ", ".join(
            f"{t['site'].split('/')[-1]} {t['bytes_per_request']:.0f} B" for t in mem["in_flight"]["top_sites"][:6]
        )
        lines.append(f"  in-flight bytes per request by allocation site: {top}")
    rss = [f"{c.servers}x c={c.concurrency}: {max(c.server_rss_mib)} MiB" for c in report.cells if c.server_rss_mib]
    if rss:
        lines.append("largest fake-server RSS at the end of each rollout-sdk cell: " + ", ".join(rss))
    sdk = [c for c in report.cells if c.system in ("rollout-sdk", SDK_AUTH)]
    ratios = [c.req_per_s / ray_rate[(c.servers, c.concurrency)] for c in sdk if (c.servers, c.concurrency) in ray_rate]
    p50_c1 = [c.p50_ms for c in sdk if c.concurrency == 1]
    lines.append("")
    if ratios:
        ok = min(ratios) >= TARGET_RATIO
        lines.append(
            f"target req/s >= {TARGET_RATIO:g}x ray: min {min(ratios):.2f}x, max {max(ratios):.2f}x "
            f"-> {'met' if ok else 'NOT met'}"
        )
    if p50_c1:
        ok = max(p50_c1) <= TARGET_P50_MS
        lines.append(
            f"target p50 added latency <= {TARGET_P50_MS} ms (c=1): "
            + ", ".join(f"{v:.3f} ms" for v in p50_c1)
            + f" -> {'met' if ok else 'NOT met'}"
        )
    lines += _render_auth(report, ray_rate)
    return "\n".join(lines)


def _render_auth(report: Report, ray_rate: dict[tuple[int, int], float]) -> list[str]:
    """Authentication on vs off, medians over the alternating repetitions, side by side."""
    keys = sorted({(c.servers, c.concurrency) for c in report.cells if c.system == SDK_AUTH})
    if not keys:
        return []
    hdr = (
        f"{'servers':>8}{'conc':>6}{'reps':>6}{'off req/s':>11}{'auth req/s':>12}{'auth/off':>10}{'paired':>8}"
        f"{'off p50 ms':>12}{'auth p50 ms':>13}{'added ms':>10}{'cpu us/req off':>16}{'auth':>7}{'ray':>7}"
        f"{'auth/ray':>10}"
    )
    lines = ["", "authentication (CURVE + ZAP) on vs off, medians:", hdr, "-" * len(hdr)]
    for n, c in keys:
        off = [x for x in report.cells if (x.system, x.servers, x.concurrency) == ("rollout-sdk", n, c)]
        on = [x for x in report.cells if (x.system, x.servers, x.concurrency) == (SDK_AUTH, n, c)]
        if not off:
            continue
        r_off, r_on = harness.median([x.req_per_s for x in off]), harness.median([x.req_per_s for x in on])
        # each repetition's auth cell against the off cell measured next to it, then the median of those
        paired = harness.median([a.req_per_s / b.req_per_s for a, b in zip(on, off, strict=False) if b.req_per_s])
        p_off, p_on = harness.median([x.p50_ms for x in off]), harness.median([x.p50_ms for x in on])
        base = ray_rate.get((n, c))
        vs_ray = f"{r_on / base:.2f}x" if base else "-"
        ray = [x for x in report.cells if (x.system, x.servers, x.concurrency) == ("ray", n, c)]
        lines.append(
            f"{n:>8}{c:>6}{len(on):>6}{r_off:>11,.0f}{r_on:>12,.0f}{r_on / r_off:>10.2f}{paired:>8.2f}"
            f"{p_off:>12.3f}{p_on:>13.3f}{p_on - p_off:>10.3f}{_cpu_us(off):>16}{_cpu_us(on):>7}{_cpu_us(ray):>7}"
            f"{vs_ray:>10}"
        )
    lines.append(
        "  paired: median over the repetitions of auth req/s / the off req/s measured beside it (ABBA order).  "
        "cpu us/req: CPU time of the client and its servers per completed request (median), which other "
        "people's load on the cores disturbs less than req/s does"
    )
    return lines


def _cpu_us(cells: Sequence[Cell]) -> str:
    per = [
        ((c.client_cpu_pct or 0) + (c.children_cpu_pct or 0)) / 100 * c.duration_s / c.requests * 1e6
        for c in cells
        if c.requests and c.client_cpu_pct is not None
    ]
    return f"{harness.median(per):.0f}" if per else "-"


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.parser(
        __doc__, quick="shorter cells and fewer requests (about 1 minute)", json="dispatch", json_type=Path
    )
    p.add_argument("--servers", type=_parse_ints, default=[1, 4], help="server / actor counts (default: 1,4)")
    p.add_argument("--concurrency", type=_parse_ints, default=[1, 256], help="coroutines (default: 1,256)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per cell (full 8, quick 3)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (full 2, quick 0.5)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--mem-inflight", type=int, default=5000, help="requests held in flight for memory (a)")
    p.add_argument(
        "--mem-checkpoints",
        type=_parse_ints,
        default=None,
        help="completed-request counts for memory (b) (full 1000,10000,30000; quick 1000,10000)",
    )
    p.add_argument("--mem-concurrency", type=int, default=64, help="coroutines for memory (b)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray baseline")
    p.add_argument("--no-memory", action="store_true", help="skip the client-memory measurements")
    harness.add_quiet(p, "cell")
    p.add_argument(
        "--no-fake-history",
        action="store_true",
        help="start the fake servers with FakeEngine.requests_seen disabled (it keeps every request; "
        "see the module docstring)",
    )
    p.add_argument("--no-uvloop", action="store_true", help="run on the default asyncio loop")
    p.add_argument(
        "--auth", choices=["off", "on", "both"], default="both", help="rollout-sdk servers with CURVE keys or not"
    )
    p.add_argument("--auth-reps", type=int, default=1, help="alternating auth off/on repetitions per cell")
    args = p.parse_args(argv)
    harness.by_mode(
        args, duration=(8.0, 3.0), warmup=(2.0, 0.5), mem_checkpoints=([1000, 10_000, 30_000], [1000, 10_000])
    )
    args.mem_warmup = min(500, args.mem_checkpoints[0])
    if sorted(args.mem_checkpoints) != args.mem_checkpoints or args.mem_checkpoints[0] < args.mem_warmup:
        p.error("--mem-checkpoints must be increasing")
    if not args.no_ray and importlib.util.find_spec("ray") is None:
        p.error("ray is not installed: pip install 'ray[default]' (the 'bench' extra), or pass --no-ray")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report()
    report.meta = {
        **harness.facts((*harness.machine.DISTS, "ray")),
        **harness.mode_facts(args),
        "fake_history": not args.no_fake_history,
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "servers": args.servers,
            "concurrency": args.concurrency,
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "engine": "FakeEngine instant mode (default FakeEngineConfig) / Ray async actor returning at once",
        },
    }
    t0 = time.perf_counter()
    with FakeServers.session("dispatch-bench-", no_history=args.no_fake_history) as procs:
        try:
            harness.run(run_all(args, report, procs), uvloop=not args.no_uvloop)
        finally:
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                with contextlib.suppress(Exception):
                    ray.shutdown()
    report.meta["runtime_s"] = round(time.perf_counter() - t0, 1)
    payload = {"meta": report.meta, "cells": [asdict(c) for c in report.cells], "memory": report.memory}
    harness.publish(args.json, payload, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
