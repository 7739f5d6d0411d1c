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
import time
from pathlib import Path
from typing import Any

import harness
import zmq
import zmq.asyncio

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
    return {
        "p50_ms": 1000 * harness.pct(lat, 0.5),
        "p99_ms": 1000 * harness.pct(lat, 0.99),
        "max_ms": 1000 * max(lat),
        "elapsed_s": elapsed,
        "flood_answered": counts.get("answered", 0),
        "flood_busy": counts.get("busy", 0),
    }


async def _drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = harness.fake_server_argv(
        "--fake-step-base-s", "0.002", "--fake-step-per-seq-s", "0.00001", "--fake-max-batch", "256"
    )
    rows = []
    cells = [("quiet", [], 0), ("admission", [], args.flood), ("no cap", ["--max-requests", "1000000000"], args.flood)]
    with harness.ServerProcs.session("flood-", keep_logs=True) as procs:
        for rep in range(args.repeats):
            for name, extra, flood in cells:
                proc, address = procs.spawn(f"{name}-{rep}".replace(" ", "_"), base + extra)
                row = await _cell(address, flood, args.samples)
                row["config"] = name
                rows.append(row)
                harness.log(
                    f"{name:9s} p50 {row['p50_ms']:9.1f} ms  p99 {row['p99_ms']:9.1f} ms  "
                    f"flood answered {row['flood_answered']}, busy {row['flood_busy']}"
                )
                procs.stop([proc])
    return rows


def main() -> None:
    p = harness.parser(__doc__, quick=True, json="flood")
    p.add_argument("--flood", type=int, default=None, help="requests the flooder sends (full 100000, quick 30000)")
    p.add_argument("--samples", type=int, default=20, help="normal-client requests per cell")
    p.add_argument("--repeats", type=int, default=None, help="alternating repetitions (full 2, quick 1)")
    args = harness.by_mode(p.parse_args(), flood=(100_000, 30_000), repeats=(2, 1))
    t0 = time.time()
    rows = harness.run(_drive(args))
    meta = harness.save_results(args.json, rows, vars(args))
    keys = ("p50_ms", "p99_ms", "max_ms", "flood_answered", "flood_busy")
    out = []
    for name in ("quiet", "admission", "no cap"):
        m = harness.medians([r for r in rows if r["config"] == name], keys)
        out.append([name, *(f"{m[k]:.1f}" for k in keys[:3]), *(f"{m[k]:.0f}" for k in keys[3:])])
    print("normal client, 4-token requests; medians over repeats")
    print(harness.table(["config", "p50 ms", "p99 ms", "max ms", "flood answered", "flood busy"], out))
    print(f"runtime {time.time() - t0:.0f} s; {meta['machine']}; numbers in {args.json}")


if __name__ == "__main__":
    main()
