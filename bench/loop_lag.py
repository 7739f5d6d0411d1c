"""Event-loop lag of an engine server under normal traffic mixed with maximum-size and oversized frames.

What is measured
----------------
A server process (this script with ``--serve``: an ``EngineServer`` around a batched ``FakeEngine``, 2 ms
steps, on uvloop) runs a **loop-lag probe** next to the server: a task that sleeps 1 ms in a loop and records
how late each wake-up was (``loop.time()`` after the sleep, minus the time asked for).  Anything that holds
the event loop (decoding a frame, building a list of ints, freeing one) shows up as lag.  The probe's
samples go to a file when the server stops; this script cuts them into the phases below by wall clock.

Traffic, from this process, in phases of ``--duration`` seconds each:

* ``normal``: a ``RolloutClient`` with ``--concurrency`` coroutines generating back to back (64-token
  prompts, 4 new tokens): the happy path;
* ``+max``: the same, plus a raw DEALER that sends maximum-size GenerateRequests (just under
  ``max_generate_bytes``, 3-byte token ids, or ``MAX_INPUT_IDS`` ids where that comes first) one after
  another, each awaited;
* ``+over``: normal traffic plus a raw DEALER sending frames just over the limit every 100 ms (libzmq
  drops them and the connection: ``MAXMSGSIZE``);
* ``mixed``: all three at once.

Two server configurations, same run, alternated: ``default`` (frames above ``offload_decode_bytes``
decoded in a worker process and their ids turned into ints in chunks) and ``on-loop`` (the same limits,
``offload_decode_bytes`` set to the limit: every frame decoded on the event loop, as before issue 15).

The probe asks for 1 ms; uvloop's timers have millisecond resolution, so up to ~1 ms of lag is the
timer's own rounding, not a stall.

Run::

    python bench/loop_lag.py                 # ~1 minute with the default 8 MiB limit
    python bench/loop_lag.py --quick         # shorter phases
    python bench/loop_lag.py --max-generate-bytes 2097152

On a shared machine the lag also holds the time the OS gave the cores to other processes; so the probe
also records the CPU time the loop thread spent between two wake-ups (``busy``: work done *on the loop*,
whoever else runs), which is what this SDK controls.

The table: per configuration and phase, probe lag p50 / p99 / max and busy p99 / max (ms), the normal client's req/s and
latency p50 / p99 (ms), and how many maximum-size requests were answered.  Every process this script
starts is stopped at the end, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path
from typing import Any

import harness
import zmq
import zmq.asyncio
from harness import ServerProcs, log, pct

ROOT = Path(__file__).resolve().parent.parent

# -- the server side ------------------------------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
    from rollout_sdk.server import EngineServer, ServerConfig

    engine = FakeEngine(FakeEngineConfig(step_base_s=0.002, max_context=1 << 24))
    engine.requests_seen = collections.deque(maxlen=0)  # keep no history (it would hold the big prompts)
    cfg = ServerConfig(
        max_generate_bytes=args.max_generate_bytes,
        offload_decode_bytes=args.offload_decode_bytes,
    )
    # the probe's samples: (when, how late the wake-up was, CPU the loop thread spent meanwhile: work on the loop)
    await harness.serve(EngineServer(engine, cfg), lag_samples=args.samples)


# -- the traffic side -----------------------------------------------------------------------------------


def _max_frame(limit: int, rid: str) -> bytes:
    """The largest GenerateRequest a server accepts: just under ``limit`` bytes (token ids in 256..65535: 3
    bytes), or ``MAX_INPUT_IDS`` ids where that comes first (the default 8 MiB: about 6 MB)."""
    from rollout_sdk.protocol import MAX_INPUT_IDS, GenerateRequest, SamplingParams, encode

    n = min((limit - 200) // 3, MAX_INPUT_IDS - 16)
    ids = [1000 + (i % 60000) for i in range(n)]
    data = encode(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=1), rid=rid))
    assert len(data) <= limit, (len(data), limit)
    return data


async def _normal(client: Any, stop: asyncio.Event, lat: list[float]) -> None:
    from rollout_sdk.protocol import SamplingParams

    sp = SamplingParams(max_new_tokens=4)
    prompt = list(range(1000, 1064))
    while not stop.is_set():
        t = time.perf_counter()
        await client.generate(prompt, sampling=sp)
        lat.append(time.perf_counter() - t)


async def _max_sender(address: str, frame: bytes, stop: asyncio.Event, answered: list[int]) -> None:
    from rollout_sdk.protocol import decode_server_message

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    i = 0
    try:
        while not stop.is_set():
            await sock.send(frame)
            while True:  # skip Pongs; one reply per frame
                msg = decode_server_message(await asyncio.wait_for(sock.recv(), 120))
                if type(msg).__name__ != "Pong":
                    break
            if type(msg).__name__ == "GenerateResult":
                answered[0] += 1
            i += 1
            await sock.send(encode_ping(i))  # stay known to the server (heartbeat)
    finally:
        sock.close(0)
        ctx.term()


def encode_ping(seq: int) -> bytes:
    from rollout_sdk.protocol import Ping, encode

    return encode(Ping(seq))


async def _over_sender(address: str, frame: bytes, stop: asyncio.Event) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # plain socket: NOBLOCK sends that may fail
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(address)
    try:
        while not stop.is_set():
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass
            await asyncio.sleep(0.1)
    finally:
        sock.close(0)
        ctx.term()


async def _run_config(
    name: str, address: str, args: argparse.Namespace, frames: dict[str, bytes]
) -> list[dict[str, Any]]:
    from rollout_sdk import RolloutClient

    rows = []
    async with RolloutClient(servers=[address], max_in_flight_per_server=256) as client:
        for phase in ("normal", "+max", "+over", "mixed"):
            stop = asyncio.Event()
            lat: list[float] = []
            answered = [0]
            tasks = [asyncio.create_task(_normal(client, stop, lat)) for _ in range(args.concurrency)]
            if phase in ("+max", "mixed"):
                tasks.append(asyncio.create_task(_max_sender(address, frames["max"], stop, answered)))
            if phase in ("+over", "mixed"):
                tasks.append(asyncio.create_task(_over_sender(address, frames["over"], stop)))
            await asyncio.sleep(args.warmup)
            lat.clear()
            t0 = time.time()
            await asyncio.sleep(args.duration)
            t1 = time.time()
            n = len(lat)
            window = list(lat)
            stop.set()
            await asyncio.gather(*tasks)
            rows.append(
                {
                    "config": name,
                    "phase": phase,
                    "t0": t0,
                    "t1": t1,
                    "req_s": n / (t1 - t0),
                    "lat_p50_ms": 1000 * pct(window, 0.5),
                    "lat_p99_ms": 1000 * pct(window, 0.99),
                    "max_answered": answered[0],
                }
            )
            log(f"{name:8s} {phase:7s} {n / (t1 - t0):8.0f} req/s  max-size answered {answered[0]}")
    return rows


async def _drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    limit = args.max_generate_bytes
    frames = {"max": _max_frame(limit, "max")}
    frames["over"] = frames["max"] + b"\x00" * (limit - len(frames["max"]) + 1024)  # over the limit
    log(f"maximum-size frame {len(frames['max']):,} bytes, oversized {len(frames['over']):,} bytes")
    rows: list[dict[str, Any]] = []
    configs = {"default": args.offload_decode_bytes, "on-loop": limit}
    with ServerProcs.session("loop_lag-", keep_logs=True) as procs:
        tmp = procs.logdir
        for rep in range(args.repeats):
            for name, offload in configs.items():
                samples = tmp / f"{name}-{rep}.json"
                proc, address = procs.spawn(
                    f"{name}-{rep}",
                    [
                        sys.executable,
                        __file__,
                        "--serve",
                        "--samples",
                        str(samples),
                        "--max-generate-bytes",
                        str(limit),
                        "--offload-decode-bytes",
                        str(offload),
                    ],
                )
                got = await _run_config(name, address, args, frames)
                procs.stop([proc])
                for row in got:
                    window, busy = harness.lag_window(samples, row["t0"], row["t1"])
                    row["probe_n"] = len(window)
                    row["lag_p50_ms"] = 1000 * pct(window, 0.5)
                    row["lag_p99_ms"] = 1000 * pct(window, 0.99)
                    row["lag_max_ms"] = 1000 * max(window, default=float("nan"))
                    row["busy_p99_ms"] = 1000 * pct(busy, 0.99)
                    row["busy_max_ms"] = 1000 * max(busy, default=float("nan"))
                rows.extend(got)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by[(r["config"], r["phase"])].append(r)
    cols = {  # column: (key, decimals)
        "lag p50": ("lag_p50_ms", 2),
        "lag p99": ("lag_p99_ms", 2),
        "lag max": ("lag_max_ms", 1),
        "busy p99": ("busy_p99_ms", 2),
        "busy max": ("busy_max_ms", 1),
        "req/s": ("req_s", 0),
        "lat p50": ("lat_p50_ms", 2),
        "lat p99": ("lat_p99_ms", 2),
        "max-size ok": ("max_answered", 0),
    }
    out = []
    for (config, phase), rs in by.items():
        m = harness.medians(rs, [k for k, _ in cols.values()])
        out.append([config, phase, *(f"{m[k]:.{d}f}" for k, d in cols.values())])
    return "(ms; medians)\n" + harness.table(["config", "phase", *cols], out, left=(0, 1))


def main() -> None:
    p = harness.parser(__doc__, quick=True, json="loop_lag")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samples", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-generate-bytes", type=int, default=8 << 20)
    p.add_argument("--offload-decode-bytes", type=int, default=256 << 10)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=None, help="measured seconds per phase (full 6, quick 3)")
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=None, help="alternating repetitions (full 2, quick 1)")
    args = p.parse_args()
    if args.serve:
        harness.loop_runner()(_serve(args))
        return
    harness.by_mode(args, duration=(6.0, 3.0), repeats=(2, 1))
    t0 = time.time()
    rows = harness.run(_drive(args))
    meta = harness.save_results(
        args.json, rows, {k: v for k, v in vars(args).items() if k not in ("serve", "samples", "json")}
    )
    print(_table(rows))
    print(f"runtime {time.time() - t0:.0f} s; {meta['machine']}; numbers in {args.json}")


if __name__ == "__main__":
    main()
