"""Fleet membership: servers join and leave while a client runs; a restarted server is a new member that
takes requests only once it serves the fleet's weights (issue 17).

In-process fake servers cover the client's bookkeeping; real server processes (CPU engine, gloo weight
sync) cover restarts on a new and on the same port.  Nothing here waits on a sleep: every wait is on a
condition with a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable

import pytest

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.errors import ConfigError
from rollout_sdk.server import EngineServer, ServerConfig

SLOW = FakeEngineConfig(step_base_s=0.002, max_batch=64)


def _req(i: int, n: int = 4, session: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[151644, 872, 198, 1000 + i], sampling=SamplingParams(max_new_tokens=n), session_id=session
    )


async def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` on the event loop until it holds (a deadline, not a timing assumption)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)
    assert cond(), what


async def test_added_server_takes_the_next_request(fake_servers) -> None:
    gate = asyncio.Event()  # a's requests stay in flight until the end, however slow add_server is
    (a,) = await fake_servers(1, SLOW, gate=gate)
    (b,) = await fake_servers(1, SLOW)
    async with RolloutClient(servers=[a.address]) as client:
        busy = [asyncio.create_task(client.generate(_req(i, n=200))) for i in range(8)]
        await until(lambda: client.stats().servers[0].in_flight == 8, "8 requests in flight on a")
        status = await client.add_server(b.address)
        assert status.admitted and status.alive and status.incarnation == b.incarnation
        # least load: the first request placed after add_server returns goes to the idle newcomer
        r = await client.generate(_req(99, n=2))
        assert r.server_id == b.server_id and r.incarnation == b.incarnation
        assert (await client.add_server(b.address)).incarnation == b.incarnation  # idempotent
        assert len(client.servers) == 2
        gate.set()
        await asyncio.gather(*busy)


async def test_remove_server_with_drain_loses_nothing(fake_servers) -> None:
    a, b = await fake_servers(2, SLOW)
    async with RolloutClient(servers=[a.address, b.address]) as client:
        tasks = [asyncio.create_task(client.generate(_req(i, n=50))) for i in range(100)]
        await until(lambda: client.stats().servers[0].in_flight > 0, "requests on a")
        await client.remove_server(a.address, drain=True)
        results = await asyncio.gather(*tasks)
        assert [r.finish_reason for r in results] == ["length"] * 100
        assert [len(r.output_ids) for r in results] == [50] * 100
        st = client.stats()
        assert [s.address for s in st.servers] == [b.address]
        assert [s.address for s in st.retired] == [a.address] and not st.retired[0].alive
        assert st.retired[0].completed > 0  # a's work stays a's
        assert st.retried == 0  # drained: nothing had to move
        after = await asyncio.gather(*(client.generate(_req(i)) for i in range(10)))
        assert {r.server_id for r in after} == {b.server_id}
        with pytest.raises(ConfigError, match="address"):
            await client.remove_server(a.address)


async def test_remove_server_without_drain_moves_its_requests(fake_servers) -> None:
    # a's requests wait at a gate that never opens: they are all still in flight there when a is removed,
    # however slow the machine (long requests raced a's decoding: 400 tokens each, and the moved ones run
    # one at a time on b as suspects, 16 s of the suite)
    held = asyncio.Event()
    (a,) = await fake_servers(1, SLOW, gate=held)
    (b,) = await fake_servers(1, SLOW)
    async with RolloutClient(servers=[a.address, b.address], retries=1) as client:
        tasks = [asyncio.create_task(client.generate(_req(i, n=20))) for i in range(40)]
        await until(lambda: client.stats().servers[0].in_flight > 0, "requests on a")
        moved = client.stats().servers[0].in_flight
        await client.remove_server(a.address, drain=False)
        results = await asyncio.gather(*tasks)
        assert all(r.finish_reason == "length" and len(r.output_ids) == 20 for r in results)
        assert {r.server_id for r in results} == {b.server_id}  # the moved ones finished on b
        assert client.stats().retried == moved
        # nothing of this client keeps running on the removed server
        await until(lambda: not a.engine.running_rids(), "a's engine idle")


async def test_sessions_on_a_removed_server_move_once(fake_servers) -> None:
    a, b = await fake_servers(2)
    async with RolloutClient(servers=[a.address, b.address]) as client:
        first = {f"s{i}": await client.generate(_req(i, session=f"s{i}")) for i in range(10)}
        on_a = [sid for sid, r in first.items() if r.server_id == a.server_id]
        assert on_a, "least load spreads sessions over both servers"
        await client.remove_server(a.address)
        for _ in range(3):
            again = [await client.generate(_req(i, session=f"s{i}")) for i in range(10)]
            assert {r.server_id for r in again} == {b.server_id}
        st = client.stats()
        assert st.sessions_moved == len(on_a)  # once each, not at every request
        assert st.prefix_tokens_lost == 4 * len(on_a)


async def test_same_port_restart_is_a_new_member(fake_servers) -> None:
    """A server restarted on its old port is told apart by its incarnation: new identity, fresh counters,
    and admitted only at the fleet's weight version."""
    (a,) = await fake_servers(1)
    first = EngineServer(FakeEngine(), ServerConfig(server_id="slot", port=_free_port()))
    await first.__aenter__()
    async with RolloutClient(servers=[a.address, first.address], heartbeat_interval_s=0.05) as client:
        await asyncio.gather(*(client.generate(_req(i)) for i in range(20)))
        await client.set_weight_version(7)
        old = next(c for c in client.servers if c.address == first.address)
        old_completed, old_inc = old.completed, old.incarnation
        assert old_completed > 0
        port = int(first.address.rsplit(":", 1)[1])
        await first.aclose()
        second = EngineServer(FakeEngine(), ServerConfig(server_id="slot", port=port))
        await second.__aenter__()
        try:
            await until(
                lambda: any(c.address == first.address and c.incarnation == second.incarnation for c in client.servers),
                "the restarted server rejoins as a new member",
            )
            new = next(c for c in client.servers if c.address == first.address)
            assert new is not old and new.completed == 0
            assert not new.admitted and "version 0" in new.admission  # it serves version 0; the fleet is at 7
            assert [s.incarnation for s in client.stats().retired] == [old_inc]
            assert client.stats().retired[0].completed == old_completed
            results = await asyncio.gather(*(client.generate(_req(i)) for i in range(30)))
            assert {r.incarnation for r in results} == {a.incarnation}
            assert {r.weight_version for r in results} == {7}
            # the newcomer reports the fleet's version (here: a label pushed straight to it) -> admitted
            await second.engine.set_weight_version(7)
            await until(lambda: new.admitted, "admitted once it serves version 7")
            results = await asyncio.gather(*(client.generate(_req(i)) for i in range(30)))
            assert second.incarnation in {r.incarnation for r in results}
            assert {r.weight_version for r in results} == {7}
        finally:
            await second.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- real server processes, weights over gloo --------------------------------------------------------


@pytest.fixture
def cpu_serve(spawn_server, tiny_model):
    args = ("--engine", "cpu", "--cpu-model-path", str(tiny_model), "--cpu-max-running", "16")

    def start(*extra: str):
        return spawn_server(*args, *extra)

    start.many = lambda n: spawn_server.many(n, *args)
    return start


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_restarted_servers_serve_only_after_the_weights_reach_them(cpu_serve, tiny_model) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    g = torch.Generator().manual_seed(0)

    def weights(scale: float) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.detach() + scale * torch.randn(t.shape, generator=g)) for n, t in model.named_parameters()]

    # two: one is killed and restarted on a new port, the other on its old one (a third server, started
    # and never killed, took part in nothing the test looks at and cost a CPU-engine start-up)
    procs = cpu_serve.many(2)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0)
    async with RolloutClient(servers=[p.address for p in procs], heartbeat_interval_s=0.1) as client:
        await client.init_weight_sync(backend="gloo")
        await client.update_weights(weights(0.01), version=1, bucket_bytes=8 << 20)
        running = [asyncio.create_task(client.generate([151644, 872, 198, i], sampling=sp)) for i in range(30)]
        await until(lambda: client.stats().servers[0].in_flight > 0, "requests on server 0")

        # 1. killed mid-run, restarted on a new port, added by the user
        procs[0].kill()
        for r in await asyncio.gather(*running):
            assert r.weight_version == 1
        fresh = await asyncio.to_thread(cpu_serve)  # the client's loop (heartbeats) runs meanwhile
        status = await client.add_server(fresh.address)
        assert status.alive and not status.admitted and "weight version 0" in status.admission
        assert procs[0].address in [s.address for s in client.stats().retired] or not any(
            c.address == procs[0].address and c.alive for c in client.servers
        )
        results = await asyncio.gather(*(client.generate([151644, 872, 198, i], sampling=sp) for i in range(24)))
        assert status.incarnation not in {r.incarnation for r in results}
        assert {r.weight_version for r in results} == {1}

        # the next update re-forms the weight group with the newcomer: then it serves
        await client.update_weights(weights(0.01), version=2, bucket_bytes=8 << 20)
        new = next(c for c in client.servers if c.address == fresh.address)
        assert new.admitted and new.reported_version == 2
        results = await asyncio.gather(*(client.generate([151644, 872, 198, i], sampling=sp) for i in range(48)))
        assert status.incarnation in {r.incarnation for r in results}
        assert {r.weight_version for r in results} == {2}

        # 2. killed and restarted on the same port: found by its new incarnation, no call needed
        victim = procs[1]
        port = victim.address.rsplit(":", 1)[1]
        old_inc = next(c.incarnation for c in client.servers if c.address == victim.address)
        victim.kill()
        again = await asyncio.to_thread(cpu_serve, "--port", port)
        await until(
            lambda: any(c.address == victim.address and c.alive and c.incarnation != old_inc for c in client.servers),
            "the same-port restart rejoins",
        )
        rejoined = next(c for c in client.servers if c.address == victim.address)
        assert not rejoined.admitted
        results = await asyncio.gather(*(client.generate([151644, 872, 198, i], sampling=sp) for i in range(24)))
        assert rejoined.incarnation not in {r.incarnation for r in results}
        await client.update_weights(weights(0.01), version=3, bucket_bytes=8 << 20)
        assert rejoined.admitted
        results = await asyncio.gather(*(client.generate([151644, 872, 198, i], sampling=sp) for i in range(48)))
        assert rejoined.incarnation in {r.incarnation for r in results}
        assert {r.weight_version for r in results} == {3}
        counts = collections.Counter(s.incarnation for s in client.stats().retired)
        assert old_inc in counts
        del again


KILLS = 8


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_random_kills_and_restarts_under_load(spawn_server) -> None:
    """Chaos: SIGKILL a random server and restart it (same port or a new one) 8 times, each after 50 more
    requests succeeded, while workers keep requests in flight.  Every request ends exactly once: a full
    result, or a typed error; none hangs (every call has a timeout, and none may hit it).  A count of kills,
    not 60 s of wall time: the same coverage on any machine, and a fraction of the CPU on a loaded one."""
    import random

    from rollout_sdk.errors import RequestTimeoutError, RolloutError

    rng = random.Random(17)
    args = ("--engine", "fake", "--fake-step-base-s", "0.002", "--fake-max-batch", "64")
    procs = [await asyncio.to_thread(spawn_server, *args) for _ in range(3)]
    outcomes: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()
    async with RolloutClient(servers=[p.address for p in procs], heartbeat_interval_s=0.2, retries=2) as client:

        async def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    r = await client.generate(_req((w * 97 + i) % 1000, n=16), timeout=60)
                except RequestTimeoutError:
                    outcomes["hung"] += 1
                except RolloutError as exc:
                    outcomes[type(exc).__name__] += 1
                    if not client.stats().servers or not any(s.alive for s in client.stats().servers):
                        await until(lambda: any(s.admitted and s.alive for s in client.stats().servers), "a server")
                else:
                    assert r.finish_reason == "length" and len(r.output_ids) == 16
                    outcomes["ok"] += 1

        async def chaos() -> None:
            while kills[0] < KILLS:
                await until(lambda: outcomes["ok"] >= 50 * (kills[0] + 1), "progress between kills")
                victim = rng.randrange(len(procs))
                old = procs[victim]
                old.kill()
                kills[0] += 1
                if rng.random() < 0.5:
                    port = old.address.rsplit(":", 1)[1]
                    procs[victim] = await asyncio.to_thread(spawn_server, *args, "--port", port)
                    await until(lambda a=old.address: any(c.address == a and c.alive for c in client.servers), "rejoin")
                else:
                    procs[victim] = await asyncio.to_thread(spawn_server, *args)
                    await client.add_server(procs[victim].address)
                    await client.remove_server(old.address, drain=False)
            await until(lambda: outcomes["ok"] > 50 * KILLS, "progress after the last kill")
            stop.set()

        kills = [0]
        async with asyncio.TaskGroup() as tg:
            for w in range(16):
                tg.create_task(worker(w))
            tg.create_task(chaos())
        st = client.stats()
    assert outcomes["hung"] == 0, outcomes
    assert kills[0] == KILLS and outcomes["ok"] > 50 * kills[0], (kills, outcomes)
    assert set(outcomes) <= {"ok", "ServerUnavailableError", "EngineDeadError", "NoServersError", "PoisonRequestError"}
    assert len(st.retired) >= kills[0]  # every killed process left the fleet as its own member
