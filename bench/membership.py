"""How fast a fleet change takes effect: ``add_server`` until the newcomer has served a request, and a
same-port restart until the new process is serving again, while a loaded server keeps working.

    python bench/membership.py [--reps 7] [--quick]

Servers are in-process fake engines with a decode-step cost (real ZMQ on loopback); the client keeps
64 requests in flight on the first server throughout.  Prints a table of medians and min-max.
"""

from __future__ import annotations

import asyncio
import time

import harness

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.server import EngineServer, ServerConfig

CFG = FakeEngineConfig(step_base_s=0.002, max_batch=256)


def _req(i: int, n: int) -> GenerateRequest:
    return GenerateRequest(input_ids=[1, 2, 3, i % 1000], sampling=SamplingParams(max_new_tokens=n))


async def _load(client: RolloutClient, stop: asyncio.Event) -> None:
    async def one(i: int) -> None:
        while not stop.is_set():
            await client.generate(_req(i, 64))

    async with asyncio.TaskGroup() as tg:
        for i in range(64):
            tg.create_task(one(i))


async def add_to_first_result() -> float:
    a = EngineServer(FakeEngine(CFG))
    b = EngineServer(FakeEngine(CFG))
    async with a, b, RolloutClient(servers=[a.address]) as client:
        stop = asyncio.Event()
        load = asyncio.create_task(_load(client, stop))
        while client.stats().servers[0].in_flight < 64:
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await client.add_server(b.address)
        while b.stats().completed == 0:
            await client.generate(_req(0, 4))
        dt = time.perf_counter() - t0
        stop.set()
        await load
    return dt


async def same_port_restart_to_serving() -> float:
    a = EngineServer(FakeEngine(CFG))
    async with a:
        first = EngineServer(FakeEngine(CFG))
        await first.__aenter__()
        port = int(first.address.rsplit(":", 1)[1])
        async with RolloutClient(servers=[a.address, first.address], heartbeat_interval_s=0.1) as client:
            stop = asyncio.Event()
            load = asyncio.create_task(_load(client, stop))
            await first.aclose()
            second = EngineServer(FakeEngine(CFG), ServerConfig(port=port))
            t0 = time.perf_counter()
            await second.__aenter__()
            while second.stats().completed == 0:
                await asyncio.sleep(0.005)
            dt = time.perf_counter() - t0
            stop.set()
            await load
            await second.aclose()
    return dt


async def main() -> None:
    args = harness.parser(__doc__, reps=7, quick=True).parse_args()
    reps = 2 if args.quick else args.reps
    rows = []
    for name, fn in (
        ("add_server -> first result on it", add_to_first_result),
        ("same-port restart -> serving again", same_port_restart_to_serving),
    ):
        xs = []
        for _ in range(reps):
            xs.append(await fn())
            harness.log(f"{name}: {xs[-1] * 1000:.1f} ms")
        rows.append([name, *(f"{v * 1000:.1f}" for v in harness.spread(xs))])
    print(f"\n(reps={reps})\n" + harness.table(["what", "median ms", "min", "max"], rows))


if __name__ == "__main__":
    harness.run(main(), uvloop=False)
