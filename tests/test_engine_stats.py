"""Load and capacity as engines report them (#14 item 6, #17 item 5 / #21 item 1, engine side).

The stale-load bug: ``client.stats()`` showed ``engine_running=128`` on idle servers after a run, and the
client counted its own finished requests as other clients' load (``external``) until the next heartbeat.
Causes: the client kept the last Pong of the run (taken while busy) for a whole heartbeat interval, and
computed ``external`` from the server's ``in_flight`` of then minus its own pending count of now.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_sdk import RolloutClient
from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.protocol import GenerateRequest, SamplingParams
from rollout_sdk.server import EngineServer, ServerConfig

#: a heartbeat far longer than any wait below: nothing here may rely on the next one
SLOW_HEARTBEAT = {"heartbeat_interval_s": 60.0, "heartbeat_timeout_s": 120.0}


async def _until(cond: object, what: str, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_idle_servers_report_zero_running_after_a_run(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.001, max_batch=32))
    async with RolloutClient(servers=[server.address], **SLOW_HEARTBEAT) as client:
        conn = client.servers[0]
        sp = SamplingParams(max_new_tokens=300)
        run = [asyncio.ensure_future(client.generate(GenerateRequest(input_ids=[5], sampling=sp))) for _ in range(64)]
        # a snapshot taken while the engine is full: what the client caches
        async with asyncio.timeout(30):
            while (await conn.fetch_stats()).running < 32:
                await asyncio.sleep(0.005)
        busy = client.stats().servers[0]
        assert busy.engine_running == 32 and busy.engine_queued == 32
        assert conn.external == 0  # every request there is ours
        await asyncio.gather(*run)
        assert server.stats().running == 0
        # the client learns the server went idle without waiting for a heartbeat
        await _until(lambda: client.stats().servers[0].engine_running == 0, "idle stats")
        idle = client.stats().servers[0]
        assert (idle.engine_running, idle.engine_queued, idle.in_flight) == (0, 0, 0)
        assert conn.external == 0
        assert idle.stats_age_s is not None and idle.stats_age_s < 60


async def test_external_load_is_other_clients_requests_only(fake_servers) -> None:
    gate = asyncio.Event()
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.001), gate=gate)
    async with (
        RolloutClient(servers=[server.address], **SLOW_HEARTBEAT) as a,
        RolloutClient(servers=[server.address], **SLOW_HEARTBEAT) as b,
    ):
        sp = SamplingParams(max_new_tokens=2)
        mine = [asyncio.ensure_future(a.generate(GenerateRequest(input_ids=[1], sampling=sp))) for _ in range(3)]
        theirs = [asyncio.ensure_future(b.generate(GenerateRequest(input_ids=[1], sampling=sp))) for _ in range(5)]
        await _until(lambda: server.stats().in_flight == 8, "all held at the gate")
        stats = await a.servers[0].fetch_stats()
        assert (stats.in_flight, stats.client_in_flight) == (8, 3)
        assert a.servers[0].external == 5
        assert (await b.servers[0].fetch_stats()).client_in_flight == 5 and b.servers[0].external == 3
        gate.set()
        await asyncio.gather(*mine, *theirs)
        await a.servers[0].fetch_stats()
        assert a.servers[0].external == 0


@pytest.fixture
async def cpu_server(tiny_model: Path):
    async with EngineServer(
        CpuEngine(CpuEngineConfig(model_path=str(tiny_model), max_running=8)), ServerConfig()
    ) as server:
        yield server


async def test_cpu_engine_reports_capacity_and_zero_load_at_idle(cpu_server: EngineServer) -> None:
    engine = cpu_server.engine
    assert isinstance(engine, CpuEngine)
    idle = engine.load()
    assert (idle.running, idle.queued, idle.max_running_requests, idle.kv_used_tokens) == (0, 0, 8, 0)
    assert idle.kv_capacity_tokens is None  # the CPU engine's cache grows on demand
    async with RolloutClient(servers=[cpu_server.address], **SLOW_HEARTBEAT) as client:
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
        prompts = [[151644, 872, 198, 1000 + i] for i in range(12)]
        run = [asyncio.ensure_future(client.generate(GenerateRequest(input_ids=p, sampling=sp))) for p in prompts]
        await _until(lambda: engine.load().running == 8, "batch full", timeout=120)
        stats = await client.servers[0].fetch_stats()
        assert stats.max_running_requests == 8 and stats.running == 8 and stats.queued == 4
        assert stats.kv_used_tokens is not None and stats.kv_used_tokens >= 8 * 4
        seen = client.stats().servers[0]
        assert seen.engine_max_running == 8 and seen.engine_kv_used_tokens == stats.kv_used_tokens
        await asyncio.gather(*run)
        load = engine.load()
        assert (load.running, load.queued, load.queued_tokens, load.kv_used_tokens) == (0, 0, 0, 0)
        # the finished rows' KV cache is freed while idle, not held until the next request
        await _until(lambda: engine._runner.batch.num_rows == 0, "idle batch freed")
        await _until(lambda: client.stats().servers[0].engine_running == 0, "idle stats")
        assert client.stats().servers[0].engine_kv_used_tokens == 0
