"""RolloutClient's lifecycle and its many-requests API."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rollout_sdk import (
    ClientStateError,
    ConfigError,
    GenerateRequest,
    RolloutClient,
    SamplingParams,
    ServerUnavailableError,
)
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.rollouts.seeds import sample_seed


def _req(i: int, n: int = 4, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=[5, i], sampling=SamplingParams(max_new_tokens=n, seed=seed))


async def test_lifecycle_open_once_close_idempotent(fake_servers) -> None:
    (server,) = await fake_servers(1)
    client = RolloutClient(servers=[server.address])
    with pytest.raises(ClientStateError, match="unopened"):
        await client.generate(_req(1))
    async with client:
        assert (await client.generate(_req(1))).output_ids
        with pytest.raises(ClientStateError, match="opens once"):
            await client.open()
    await client.aclose()
    await client.aclose()
    with pytest.raises(ClientStateError, match="closed"):
        await client.generate(_req(1))
    with pytest.raises(ClientStateError, match="opens once"):
        async with client:
            pass


async def test_close_fails_waiting_callers_with_a_clear_error(fake_servers) -> None:
    gate = asyncio.Event()
    (server,) = await fake_servers(1, gate=gate)
    client = RolloutClient(servers=[server.address])
    await client.open()
    task = asyncio.create_task(client.generate(_req(1)))
    while server.stats().in_flight < 1:  # a condition, not a sleep: the request is on the server
        await asyncio.sleep(0.005)
    await client.aclose()
    with pytest.raises(ClientStateError, match="closed"):
        await task
    while server.stats().in_flight:  # the close aborted it on the server too
        await asyncio.sleep(0.01)
    assert server.engine.aborted_rids  # type: ignore[attr-defined]


def test_bad_options_are_refused_with_names() -> None:
    with pytest.raises(TypeError, match="max_inflight"):
        RolloutClient(servers=["tcp://127.0.0.1:1"], max_inflight=3)
    with pytest.raises(ConfigError, match="retries=-1"):
        RolloutClient(servers=["tcp://127.0.0.1:1"], retries=-1)
    with pytest.raises(ConfigError, match="max_in_flight_per_server=0"):
        RolloutClient(servers=["tcp://127.0.0.1:1"], max_in_flight_per_server=0)
    with pytest.raises(ConfigError, match="policy"):
        RolloutClient(servers=["tcp://127.0.0.1:1"], policy="fastest")
    with pytest.raises(ConfigError, match="tcp://host:port"):
        RolloutClient(servers=["localhost:5555"])


async def test_open_fails_clearly_when_no_server_answers() -> None:
    client = RolloutClient(servers=["tcp://127.0.0.1:9"], connect_timeout_s=0.5)
    with pytest.raises(ServerUnavailableError, match="no server answered"):
        await client.open()
    with pytest.raises(ClientStateError):
        await client.generate(_req(1))


# -- the pytest-asyncio fixture pattern users write (setup and teardown run in different tasks) -------


@pytest_asyncio.fixture
async def client_fixture(fake_servers) -> AsyncIterator[RolloutClient]:
    servers = await fake_servers(2)
    async with RolloutClient(servers=[s.address for s in servers]) as c:
        yield c


async def test_client_inside_a_pytest_asyncio_fixture(client_fixture: RolloutClient) -> None:
    results = await asyncio.gather(*(client_fixture.generate(_req(i)) for i in range(20)))
    assert len({r.server_id for r in results}) == 2


async def test_client_fixture_again(client_fixture: RolloutClient) -> None:
    # a second test: the first fixture's teardown (another task) closed everything cleanly
    assert (await client_fixture.generate(_req(3))).finish_reason == "length"


def test_client_under_plain_asyncio_run_with_embedded_default(sdk_home, tiny_model) -> None:
    """`RolloutClient()` with no arguments, in a fresh interpreter under asyncio.run (no uvloop)."""
    code = (
        "import asyncio\n"
        "from rollout_sdk import RolloutClient, SamplingParams\n"
        "async def main():\n"
        "    async with RolloutClient() as c:\n"
        "        r = await c.generate([151644, 872, 198], sampling=SamplingParams(max_new_tokens=5, seed=1))\n"
        "        print('OK', r.finish_reason, len(r.output_ids), c.servers[0].server_id)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK length 5 embedded-0" in out.stdout


# -- many requests -------------------------------------------------------------------------------------


async def test_generate_many_keeps_groups_together(fake_servers) -> None:
    servers = await fake_servers(3, FakeEngineConfig(step_base_s=0.001))
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        prompts = [_req(i, n=3 + i % 5, seed=100 * i) for i in range(40)]
        seen = []
        async with client.generate_many(prompts, group_size=4) as stream:
            async for group in stream:
                seen.append(group.index)
                assert len(group.results) == 4
                assert group.ok
                assert all(len(r.output_ids) == group.request.sampling.max_new_tokens for r in group.results)
        assert sorted(seen) == list(range(40))
        engines = [s.engine for s in servers]
        seeds = sorted(r.sampling.seed for e in engines for r in e.requests_seen)  # type: ignore[attr-defined]
        assert seeds == sorted(sample_seed(100 * i, member=k) for i in range(40) for k in range(4))


async def test_generate_many_bounds_what_it_holds(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.001))
    async with RolloutClient(servers=[server.address]) as client:
        pulled = 0

        def prompts():
            nonlocal pulled
            for i in range(1000):
                pulled += 1
                yield _req(i, n=2)

        stream = client.generate_many(prompts(), group_size=2, concurrency=8)
        first = await stream.__anext__()
        # a slow consumer: the producer must stop pulling.  Wait until everything it holds is answered and
        # nothing is in flight: an unbounded producer would have pulled on by then (a condition, not a sleep)
        while client.stats().in_flight or server.stats().completed < 2 + 8:
            await asyncio.sleep(0.005)
        # 4 groups held (8 permits / n=2) + the one taken + the one pulled and waiting for permits
        assert pulled <= 8 // 2 + 2
        assert first.results
        rest = [g async for g in stream]
        assert len(rest) == 999


async def test_generate_many_errors(fake_servers) -> None:
    (server,) = await fake_servers(1)
    async with RolloutClient(servers=[server.address]) as client:
        bad = [_req(1), GenerateRequest(input_ids=[5, 999_999])]
        from rollout_sdk import InvalidRequestError

        with pytest.raises(InvalidRequestError):
            await client.generate_many(bad).collect()
        groups = await client.generate_many(bad, return_exceptions=True).collect()
        assert groups[0].ok
        assert not groups[1].ok
        assert isinstance(groups[1].errors[0], InvalidRequestError)


async def test_breaking_out_cancels_the_rest(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.01))
    async with RolloutClient(servers=[server.address]) as client:
        prompts = [_req(i, n=10 if i == 0 else 100_000) for i in range(20)]
        async with client.generate_many(prompts) as stream:
            async for _group in stream:
                break
        while server.stats().in_flight:
            await asyncio.sleep(0.01)
        assert client.stats().in_flight == 0


async def test_stats_report_per_server_counters(fake_servers) -> None:
    servers = await fake_servers(2)
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        await asyncio.gather(*(client.generate(_req(i)) for i in range(30)))
        st = client.stats()
    assert st.completed == 30
    assert sum(s.completed for s in st.servers) == 30
    assert all(s.alive for s in st.servers)
    assert st.latency_p50_s is not None and st.latency_p99_s >= st.latency_p50_s


async def test_client_memory_is_flat_over_10k_requests(spawn_server) -> None:
    server = spawn_server("--engine", "fake")  # its own process: only the client's objects are counted
    async with RolloutClient(servers=[server.address]) as client:
        await asyncio.gather(*(client.generate(_req(i, n=1)) for i in range(1000)))
        gc.collect()
        base = len(gc.get_objects())
        for _ in range(9):
            await asyncio.gather(*(client.generate(_req(i, n=1)) for i in range(1000)))
        gc.collect()
        grown = len(gc.get_objects()) - base
        assert all(not c._pending for c in client.servers)
    assert grown < 2000, grown  # a leak would keep >= 1 object per request (9,000)


def test_a_client_used_from_another_event_loop_raises_instead_of_hanging() -> None:
    """Its tasks live on the loop that opened it; awaiting it from another loop would wait forever
    (pytest-asyncio with a session-scoped client fixture and function-scoped tests does exactly this)."""
    from rollout_sdk import EngineServer, ServerConfig
    from rollout_sdk.engines.fake import FakeEngine

    first = asyncio.new_event_loop()
    server = EngineServer(FakeEngine(), ServerConfig(server_id="fake-0"))  # type: ignore[arg-type]
    first.run_until_complete(server.__aenter__())
    client = RolloutClient(servers=[server.address])
    first.run_until_complete(client.open())
    try:

        async def use() -> None:
            await client.generate([1, 2], sampling=SamplingParams(max_new_tokens=2))

        with pytest.raises(ClientStateError, match="another event loop"):
            asyncio.run(use())
        first.run_until_complete(use())  # still fine on its own loop
    finally:
        first.run_until_complete(client.aclose())
        first.run_until_complete(server.aclose())
        first.close()
