"""The client's scheduler against several real servers on loopback (fake engines, real ZMQ)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import Callable

import pytest

from rollout_sdk import (
    GenerateRequest,
    NoServersError,
    QueueFullError,
    RequestTimeoutError,
    RolloutClient,
    SamplingParams,
    ServerUnavailableError,
)
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.errors import EngineDeadError


def _req(i: int, n: int = 8, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=[1, 2, 3, i % 1000], sampling=SamplingParams(max_new_tokens=n), session_id=session)


HANG_GUARD_S = 120.0  # only against a hang: no assertion depends on it


async def until(cond: Callable[[], bool], what: str) -> None:
    """Poll a condition; the deadline is a hang guard, not a timing assertion."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


async def _server_in_flight(client: RolloutClient) -> list[int]:
    """Ask every server for its live in-flight count (a fresh heartbeat round trip)."""
    return [(await conn.fetch_stats()).in_flight for conn in client.servers]


async def test_equal_servers_share_500_requests_evenly(fake_servers) -> None:
    servers = await fake_servers(4, FakeEngineConfig(step_base_s=0.002, step_per_seq_s=0.0001))
    async with RolloutClient(servers=[s.address for s in servers], max_in_flight_per_server=64) as client:
        results = await asyncio.gather(*(client.generate(_req(i, n=5)) for i in range(500)))
    counts = collections.Counter(r.server_id for r in results)
    share = 500 / 4
    assert len(counts) == 4
    assert max(counts.values()) <= share * 1.10, counts


async def test_slow_server_receives_proportionally_less(fake_servers) -> None:
    fast = await fake_servers(2, FakeEngineConfig(step_base_s=0.002))
    # 50x slower steps: a ratio that survives a loaded machine, where every sleep runs late
    slow = await fake_servers(1, FakeEngineConfig(step_base_s=0.1))
    addrs = [s.address for s in fast + slow]
    async with RolloutClient(servers=addrs) as client:
        sem = asyncio.Semaphore(24)  # a closed loop: 24 requests in flight at any time

        async def one(i: int) -> str:
            async with sem:
                return (await client.generate(_req(i, n=6))).server_id

        served = await asyncio.gather(*(one(i) for i in range(600)))
    counts = collections.Counter(served)
    slow_id = slow[0].server_id
    fast_counts = [counts[s.server_id] for s in fast]
    # much slower steps: the slow server must get far less than a fast one
    assert counts[slow_id] < 0.5 * min(fast_counts), counts
    assert counts[slow_id] > 0


async def test_session_affinity_holds_across_five_turns(fake_servers) -> None:
    # one server is slower: it holds more requests than the others at any moment, so least-load placement
    # alone would move its sessions away turn after turn; affinity keeps them
    servers = await fake_servers(2, FakeEngineConfig(step_base_s=0.001))
    servers += await fake_servers(1, FakeEngineConfig(step_base_s=0.02))
    # 30 sessions on 3 servers keep ~10 requests on each; the rule moves a session whose server carries more
    # than (1 + margin) x the least loaded one + slack, and on a loaded machine a server's whole batch can
    # finish at once (load 0 there for a moment) while another still holds 10 > the default slack of 8: the
    # documented rule then moves a session (issue 37: seen once under a CPU burner).  A slack of 30 (every
    # session at once) takes the interleaving out of the test.
    async with RolloutClient(servers=[s.address for s in servers], affinity_slack=30) as client:

        async def session(k: int) -> set[str]:
            where = set()
            ids = [7, k]
            for _turn in range(5):
                r = await client.generate(ids, sampling=SamplingParams(max_new_tokens=4), session_id=f"s{k}")
                where.add(r.server_id)
                ids = ids + r.output_ids + [11]
            return where

        placements = await asyncio.gather(*(session(k) for k in range(30)))
        assert client.scheduler.sessions_moved == 0
    assert all(len(p) == 1 for p in placements)
    used = collections.Counter(next(iter(p)) for p in placements)
    assert len(used) == 3  # sessions themselves are spread


async def test_session_moves_when_its_server_is_overloaded(fake_servers) -> None:
    gate, free_gate = asyncio.Event(), asyncio.Event()
    (busy,) = await fake_servers(1, FakeEngineConfig(), gate=gate)
    (free,) = await fake_servers(1, FakeEngineConfig(), gate=free_gate)
    async with RolloutClient(servers=[busy.address, free.address], affinity_margin=0.5, affinity_slack=2) as client:
        busy_conn = next(c for c in client.servers if c.address == busy.address)
        client.scheduler._sessions["s"] = busy_conn
        # both servers hold what they get, so the 20 spread over both whatever the machine's speed; then the
        # free one finishes its share and the busy one is left overloaded
        held = [asyncio.create_task(client.generate(_req(i), session_id=f"x{i}")) for i in range(20)]
        await until(lambda: len(busy.engine.requests_seen) >= 8, "the busy server holds 8")  # type: ignore[attr-defined]
        free_gate.set()
        free_conn = next(c for c in client.servers if c.address == free.address)
        await until(lambda: free_conn.in_flight == 0, "the free server's share done")
        r = await client.generate(_req(99), session_id="s")
        assert r.server_id == free.server_id
        assert client.scheduler.session_server("s").address == free.address
        gate.set()
        await asyncio.gather(*held)


async def test_cancelling_100_in_flight_leaves_every_server_idle(fake_servers) -> None:
    servers = await fake_servers(3, FakeEngineConfig(step_base_s=0.01))
    async with RolloutClient(
        servers=[s.address for s in servers], heartbeat_interval_s=0.1, heartbeat_timeout_s=5
    ) as c:
        tasks = [asyncio.create_task(c.generate(_req(i, n=100_000))) for i in range(100)]
        await until(lambda: sum(s.stats().in_flight for s in servers) == 100, "all 100 in flight")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: not any(s.stats().in_flight for s in servers), "every server idle")
        assert [s.stats().in_flight for s in servers] == [0, 0, 0]
        assert await _server_in_flight(c) == [0, 0, 0]
        assert all(conn.in_flight == 0 for conn in c.servers)
    aborted = sum(len(s.engine.aborted_rids) for s in servers)  # type: ignore[attr-defined]
    assert aborted == 100


async def test_back_pressure_caps_in_flight_per_server(fake_servers) -> None:
    gate = asyncio.Event()
    servers = await fake_servers(2, FakeEngineConfig(step_base_s=0.002), gate=gate)
    peak = [0, 0]

    async def sample() -> None:
        while True:
            for i, s in enumerate(servers):
                peak[i] = max(peak[i], s.stats().in_flight)
            await asyncio.sleep(0.001)

    async with RolloutClient(servers=[s.address for s in servers], max_in_flight_per_server=4) as client:
        sampler = asyncio.create_task(sample())
        tasks = [asyncio.create_task(client.generate(_req(i, n=3))) for i in range(60)]
        await until(lambda: client.scheduler.num_waiting == 52, "52 requests wait in the client")
        await until(lambda: sum(len(s.engine.running_rids()) for s in servers) == 8, "8 reach the engines")
        assert [len(s.engine.running_rids()) for s in servers] == [4, 4]
        assert client.scheduler.num_waiting == 52  # the rest wait in the client, not in the engines
        assert client.stats().waiting == 52
        gate.set()
        assert len(await asyncio.gather(*tasks)) == 60
        sampler.cancel()
    assert peak == [4, 4]


async def test_waiting_queue_is_bounded(fake_servers) -> None:
    gate = asyncio.Event()
    (server,) = await fake_servers(1, gate=gate)
    async with RolloutClient(servers=[server.address], max_in_flight_per_server=2, max_waiting=3) as client:
        tasks = [asyncio.create_task(client.generate(_req(i))) for i in range(5)]
        await until(lambda: client.scheduler.num_waiting == 3, "3 requests wait")
        with pytest.raises(QueueFullError, match="max_waiting=3"):
            await client.generate(_req(9))
        gate.set()
        assert len(await asyncio.gather(*tasks)) == 5


async def test_timeout_aborts_the_request_on_its_server(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.01))
    async with RolloutClient(servers=[server.address]) as client:
        with pytest.raises(RequestTimeoutError, match=r"timed out after 0\.2s"):
            await client.generate(_req(1, n=100_000), timeout=0.2)
        await until(lambda: bool(server.engine.aborted_rids), "the server aborts it")  # type: ignore[attr-defined]
        assert client.servers[0].in_flight == 0
        ok = await client.generate(_req(2, n=3), timeout=5)
        assert ok.finish_reason == "length"


async def test_round_robin_policy_rotates(fake_servers) -> None:
    servers = await fake_servers(3)
    async with RolloutClient(servers=[s.address for s in servers], policy="round_robin") as client:
        order = [(await client.generate(_req(i, n=1))).server_id for i in range(9)]
    assert order[:3] != order[3:3] and len(set(order[:3])) == 3
    assert order[:3] * 3 == order


async def test_killing_one_of_three_servers_loses_no_request(spawn_server) -> None:
    fake = ("--engine", "fake", "--fake-max-batch", "64")
    survivors = spawn_server.many(2, *fake, "--fake-step-base-s", "0.005")
    # the victim steps once a second: its requests are all still in flight when it is killed, however slow
    # the machine (60-token requests raced its decoding, and the ones it held, retried one at a time per
    # survivor as suspects, made 15 s of the suite); 12 tokens are a full result all the same
    victim = spawn_server(*fake, "--fake-step-base-s", "1.0")
    procs = [survivors[0], victim, survivors[1]]
    async with RolloutClient(servers=[p.address for p in procs], retries=2) as client:
        tasks = [asyncio.create_task(client.generate(_req(i, n=12))) for i in range(300)]
        victim_conn = next(c for c in client.servers if c.address == victim.address)
        await until(lambda: victim_conn.in_flight > 0, "the victim is serving")
        os.kill(victim.proc.pid, signal.SIGKILL)
        done, pending = await asyncio.wait(tasks, timeout=HANG_GUARD_S)
        assert not pending, "a request hung after its server died"
        outcomes = collections.Counter()
        for t in done:
            exc = t.exception()
            if exc is None:
                outcomes["ok"] += 1
            else:
                assert isinstance(exc, ServerUnavailableError | EngineDeadError | NoServersError), exc
                outcomes["typed_error"] += 1
        assert outcomes["ok"] + outcomes["typed_error"] == 300
        assert outcomes["ok"] == 300  # with retries every request completed elsewhere
        dead = [c for c in client.servers if c.address == victim.address][0]
        assert not dead.alive
        assert dead.failed_over > 0
        # new work goes to the survivors
        again = await asyncio.gather(*(client.generate(_req(i, n=2)) for i in range(30)))
        assert {r.server_id for r in again} <= {c.server_id for c in client.servers if c.alive}


async def test_without_retries_a_dead_server_fails_its_requests_fast(spawn_server) -> None:
    procs = spawn_server.many(2, "--engine", "fake", "--fake-step-base-s", "0.005")
    async with RolloutClient(servers=[p.address for p in procs], retries=0) as client:
        tasks = [asyncio.create_task(client.generate(_req(i, n=10_000))) for i in range(40)]
        victim = [c for c in client.servers if c.address == procs[0].address][0]
        await until(lambda: sum(c.in_flight for c in client.servers) == 40, "all 40 placed")
        on_victim = victim.in_flight
        assert on_victim > 0
        procs[0].kill()
        pending = set(tasks)
        while len(pending) > 40 - on_victim:
            _, pending = await asyncio.wait(pending, timeout=HANG_GUARD_S, return_when=asyncio.FIRST_COMPLETED)
        failed = [t.exception() for t in tasks if t.done()]
        assert len(failed) == on_victim  # exactly the dead server's requests ended, and fast
        assert all(isinstance(e, ServerUnavailableError) for e in failed)
        assert len(pending) == 40 - on_victim  # the survivor's requests are still running
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def test_the_clients_own_loop_lag_does_not_count_as_server_silence(fake_servers) -> None:
    """A saturated client loop wakes its heartbeat late: that lag is the client's, not the server's silence
    (a 500-session test under a CPU burner lost a live server to it); a loop that keeps time still finds
    the silence after the timeout.  Ticks are driven with a synthetic clock (ServerConnection._on_tick); the
    real heartbeat never fires (a 1-hour interval)."""
    (server,) = await fake_servers(1)
    async with RolloutClient(
        servers=[server.address], heartbeat_interval_s=3600.0, heartbeat_timeout_s=36_000.0
    ) as client:
        conn = client.servers[0]
        interval, timeout = 1.0, 10.0
        conn._hb_interval, conn._hb_timeout = interval, timeout
        t = conn._last_pong = 1_000.0
        for _ in range(8):  # each tick 1.4 s late (a saturated loop, not one blocked outright): 19.2 s
            conn._on_tick(t, t + interval + 1.4)  # without a Pong by the wall clock, 8 s of it responsive
            t += interval + 1.4
        assert conn.alive  # before: marked dead at the 5th tick (12 s > 10 s)
        for _ in range(2):  # the loop keeps time again: 10 s of responsive silence, not yet more
            conn._on_tick(t, t + interval)
            t += interval
        assert conn.alive
        conn._on_tick(t, t + interval)  # 11 s: the server is silent, whatever the client's lag was
        assert not conn.alive and "no heartbeat" in conn.dead_reason


async def test_silent_server_is_marked_dead_by_heartbeat(spawn_server) -> None:
    procs = spawn_server.many(2, "--engine", "fake", "--fake-step-base-s", "0.005")
    async with RolloutClient(
        servers=[p.address for p in procs], heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6, retries=1
    ) as client:
        hung = procs[0]
        os.kill(hung.proc.pid, signal.SIGSTOP)
        try:
            conn = [c for c in client.servers if c.address == hung.address][0]
            await until(lambda: not conn.alive, "the stopped server is marked dead")
            assert "heartbeat" in conn.dead_reason
            r = await client.generate(_req(1, n=3), timeout=5)
            assert r.server_id == [c for c in client.servers if c.alive][0].server_id
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
        await until(lambda: conn.alive, "the server is taken back")
        assert conn.alive  # it answers heartbeats again: taken back


async def test_no_live_server_fails_at_once(fake_servers) -> None:
    (server,) = await fake_servers(1)
    async with RolloutClient(servers=[server.address], retries=0) as client:
        client.servers[0].mark_dead("test")
        with pytest.raises(NoServersError, match="test"):
            await asyncio.wait_for(client.generate(_req(1)), 2)
