"""Memory of ``client.rollouts(mode=...)`` with a consumer 10x slower than production.

What is measured
----------------
An in-process fake-engine server (real ZMQ on loopback) and a client stream over an endless source of
prompts.  First the production time of one batch is measured with a consumer that takes batches at
once (median of ``--warmup`` batches).  Then, for ``--seconds`` seconds, the consumer sleeps 10x that
after every batch.  Every ``--every`` seconds the script records the process RSS (psutil), the Python
heap (tracemalloc) and the stream's slots (``stream.statistics()``: groups held, finished-but-not-taken).

Before #15 item 6, async mode freed a group's slot when the group *finished*, so a slow consumer let
finished groups pile up without bound (+51 MB in 15 s in the issue's probe).  Now a slot is freed when
the group is *consumed*, so ``held <= capacity`` always and memory is flat.

    python bench/stream_memory.py             # 60 s per mode
    python bench/stream_memory.py --quick     # 10 s, async mode only
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
import tracemalloc
from typing import Any

import harness
import psutil

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.server import EngineServer, ServerConfig


def prompts(tokens: int) -> Any:
    for i in itertools.count():
        yield GenerateRequest(input_ids=[7, 1000 + i % 5000] * 8, sampling=SamplingParams(max_new_tokens=tokens))


async def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, float]]:
    proc = psutil.Process()
    engine = FakeEngine(FakeEngineConfig(step_base_s=0.001, step_per_seq_s=0.00001, max_batch=256))
    async with (
        EngineServer(engine, ServerConfig(server_id="mem")) as server,
        RolloutClient(servers=[server.address]) as client,
        client.rollouts(
            prompts(args.tokens), group_size=args.group_size, batch_groups=args.batch_groups, mode=mode
        ) as stream,
    ):
        it = aiter(stream)
        times = []
        for _ in range(args.warmup):
            t0 = time.perf_counter()
            await anext(it)
            times.append(time.perf_counter() - t0)
        produce_s = statistics.median(times)
        consume_s = 10 * produce_s
        rows: list[dict[str, float]] = []
        batches = 0
        start = time.perf_counter()

        async def sample() -> None:
            while True:
                stats = stream.statistics()
                rows.append(
                    {
                        "t_s": time.perf_counter() - start,
                        "rss_mb": proc.memory_info().rss / 2**20,
                        "heap_mb": tracemalloc.get_traced_memory()[0] / 2**20,
                        "held": stats.held,
                        "buffered": stats.buffered,
                        "capacity": stats.capacity,
                        "batches": batches,
                        "produce_s": produce_s,
                        "consume_s": consume_s,
                    }
                )
                await asyncio.sleep(args.every)

        async def consume() -> None:
            nonlocal batches
            while True:
                await anext(it)
                batches += 1
                await asyncio.sleep(consume_s)  # the slow consumer ("training")

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(sample()), tg.create_task(consume())]
            await asyncio.sleep(args.seconds)
            for t in tasks:
                t.cancel()
    return rows


def main() -> None:
    p = harness.parser(__doc__, quick=True)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--modes", nargs="*", default=["async", "partial", "sync"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if args.quick:
        args.seconds, args.every, args.modes = 10.0, 2.0, ["async"]
    tracemalloc.start()
    samples, summary = [], []
    for mode in args.modes:
        rows = harness.run(run_mode(mode, args), uvloop=False)
        samples += [
            [
                mode,
                f"{r['t_s']:.0f}",
                f"{r['rss_mb']:.1f}",
                f"{r['heap_mb']:.2f}",
                f"{r['held']:.0f} / {r['capacity']:.0f}",
                f"{r['buffered']:.0f}",
                f"{r['batches']:.0f}",
            ]
            for r in rows
        ]
        half = len(rows) // 2
        first = harness.median(r["heap_mb"] for r in rows[1 : max(2, half)])
        last = harness.median(r["heap_mb"] for r in rows[half:])
        held = max(r["held"] for r in rows)
        summary.append([mode, f"{rows[0]['produce_s']:.3f}", f"{rows[0]['consume_s']:.3f}"])
        summary[-1] += [f"{first:.2f}", f"{last:.2f}", f"{held:.0f}"]
    header = ["mode", "t (s)", "RSS (MB)", "Python heap (MB)", "groups held / capacity", "finished, not taken"]
    print(harness.markdown([*header, "batches"], samples))
    print()
    header = ["mode", "batch produced in (s, median)", "consumer per batch (s)", "heap 1st half (MB)"]
    print(harness.markdown([*header, "heap 2nd half (MB)", "max groups held"], summary))


if __name__ == "__main__":
    main()
