"""A flood from one peer against a normal client's latency: what server-side admission buys.

What is measured
----------------
One server process (``rollout-sdk serve --engine fake``, batched: ``--fake-step-base-s 0.002``,
``--fake-max-batch 256``) and two peers:

* the **flooder**: a raw DEALER socket that sends ``--flood`` GenerateRequests (16 new tokens each) as fast
  as it can without waiting, and reads whatever comes back (results, or ``busy`` replies);
* the **normal client**: a ``RolloutClient`` that, once the flood is sent, generates 4-token requests one
  after another (``--samples`` of them) and records each one's latency.

Two server configurations, same run: ``admission`` (the default ``max_requests=4096`` and a fair share per
client) and ``no cap`` (``--max-requests 1000000000``: the server accepts everything, as before issue 15).
A ``quiet`` row measures the normal client with no flood, for scale.

Run::

    python bench/flood.py            # 100,000-request flood
    python bench/flood.py --quick    # 30,000

The table: normal client latency p50 / p99 / max (ms), and how many of the flood's requests the server
accepted and answered busy.  Every process this script starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import ServerProcs, log, sigterm_as_interrupt

ROOT = Path(__file__).resolve().parent.parent


async def _flood(address: str, n: int, counts: dict[str, int], sent: asyncio.Event, stop: asyncio.Event) -> None:
    from rollout_sdk.protocol import (
        ErrorReply,
        GenerateRequest,
        GenerateResult,
        SamplingParams,
        decode_server_message,
        encode,
    )

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    sp = SamplingParams(max_new_tokens=16)

    async def reader() -> None:
        while True:
            msg = decode_server_message(await sock.recv())
            if isinstance(msg, GenerateResult):
                counts["answered"] += 1
            elif isinstance(msg, ErrorReply):
                counts[msg.code] = counts.get(msg.code, 0) + 1

    rtask = asyncio.create_task(reader())
    try:
        for i in range(n):
            await sock.send(encode(GenerateRequest(input_ids=[1, 2, 3, i % 1000], sampling=sp, rid=f"f{i}")))
            if i % 1000 == 0:
                await asyncio.sleep(0)
        sent.set()
        await stop.wait()
    finally:
        rtask.cancel()
        sock.close(0)
        ctx.term()


async def _normal(address: str, samples: int) -> list[float]:
    from rollout_sdk import RolloutClient, SamplingParams

    sp = SamplingParams(max_new_tokens=4)
    lat = []
    async with RolloutClient(servers=[address]) as client:
        for i in range(samples):
            t = time.perf_counter()
            await client.generate([5, 6, 7, i], sampling=sp)
            lat.append(time.perf_counter() - t)
    return lat


async def _cell(address: str, flood: int, samples: int) -> dict[str, Any]:
    counts: dict[str, int] = {"answered": 0}
    sent, stop = asyncio.Event(), asyncio.Event()
    ftask = None
    if flood:
        ftask = asyncio.create_task(_flood(address, flood, counts, sent, stop))
        await sent.wait()
    t0 = time.perf_counter()
    lat = await _normal(address, samples)
    elapsed = time.perf_counter() - t0
    stop.set()
    if ftask is not None:
        await ftask
    lat.sort()
    return {
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "max_ms": 1000 * lat[-1],
        "elapsed_s": elapsed,
        "flood_answered": counts.get("answered", 0),
        "flood_busy": counts.get("busy", 0),
    }


async def _drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="flood-"))
    procs = ServerProcs(tmp, ROOT)
    base = [sys.executable, "-m", "rollout_sdk", "serve", "--engine", "fake"]
    base += ["--fake-step-base-s", "0.002", "--fake-step-per-seq-s", "0.00001", "--fake-max-batch", "256"]
    rows = []
    cells = [("quiet", [], 0), ("admission", [], args.flood), ("no cap", ["--max-requests", "1000000000"], args.flood)]
    try:
        for rep in range(args.repeats):
            for name, extra, flood in cells:
                proc, address = procs.spawn(f"{name}-{rep}".replace(" ", "_"), base + extra)
                row = await _cell(address, flood, args.samples)
                row["config"] = name
                rows.append(row)
                log(
                    f"{name:9s} p50 {row['p50_ms']:9.1f} ms  p99 {row['p99_ms']:9.1f} ms  "
                    f"flood answered {row['flood_answered']}, busy {row['flood_busy']}"
                )
                procs.stop([proc])
    finally:
        procs.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=None, help="requests the flooder sends (full 100000, quick 30000)")
    p.add_argument("--samples", type=int, default=20, help="normal-client requests per cell")
    p.add_argument("--repeats", type=int, default=None, help="alternating repetitions (full 2, quick 1)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "flood.json"))
    args = p.parse_args()
    args.flood = args.flood or (30_000 if args.quick else 100_000)
    args.repeats = args.repeats or (1 if args.quick else 2)
    import uvloop

    t0 = time.time()
    with sigterm_as_interrupt():
        rows = uvloop.run(_drive(args))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "args": vars(args),
    }
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(
        f"{'config':10s} {'p50 ms':>9s} {'p99 ms':>9s} {'max ms':>9s} {'flood answered':>15s} {'flood busy':>11s}"
        "   (normal client, 4-token requests; medians over repeats)"
    )
    print("-" * 72)
    for name in ("quiet", "admission", "no cap"):
        rs = [r for r in rows if r["config"] == name]

        def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(r[k] for r in rs)

        print(
            f"{name:10s} {med('p50_ms'):9.1f} {med('p99_ms'):9.1f} {med('max_ms'):9.1f} "
            f"{med('flood_answered'):15.0f} {med('flood_busy'):11.0f}"
        )
    print(f"runtime {time.time() - t0:.0f} s; {meta['machine']}; numbers in {args.json}")


if __name__ == "__main__":
    main()
