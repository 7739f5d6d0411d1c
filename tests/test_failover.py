"""Failover at full speed (issue 36, item 1): a dead server's requests re-enter the survivors concurrently,
and a poison request still kills at most 2 engines and fails no innocent (client/scheduler.py, "Suspects")."""

from __future__ import annotations

import asyncio

import pytest

from rollout_sdk import GenerateRequest, GenerateResult, PoisonRequestError, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngineConfig
from test_faults import poisoned_fleet, until


@pytest.mark.parametrize(("clear_suspects", "paced"), [("answered", True), ("answered", False), ("finished", True)])
async def test_a_poison_request_kills_at_most_two_engines_and_fails_no_innocent(
    fake_servers, clear_suspects, paced
) -> None:
    """``paced``: the servers pace probation (Stepped); not: they cannot tell (as SGLang), probes clear."""
    servers = await poisoned_fleet(fake_servers, 3)
    for s in servers:
        s.engine.reports_steps = paced
    async with RolloutClient(servers=[s.address for s in servers], clear_suspects=clear_suspects) as client:
        sp = SamplingParams(max_new_tokens=40)
        innocents = [asyncio.ensure_future(client.generate([1, 2, 3, i], sampling=sp)) for i in range(300)]
        await until(lambda: all(s.stats().in_flight > 0 for s in servers), "innocents run on every server")
        with pytest.raises(PoisonRequestError, match="not retried again"):
            await client.generate([1, 2, 666], sampling=SamplingParams(max_new_tokens=4))
        results = await asyncio.gather(*innocents, return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert sum(1 for s in servers if s.engine.dead is not None) == 2
        assert client.scheduler.poisoned == 1
        retried = [r for r in results if isinstance(r, GenerateResult) and r.lifecycle and r.lifecycle.attempts > 1]
        assert retried  # the dead servers' innocents were retried, not failed
        assert all(len(r.output_ids) == 40 for r in results if isinstance(r, GenerateResult))
        survivor = next(s for s in servers if s.engine.dead is None)
        assert not any(666 in r.input_ids for r in survivor.engine.requests_seen)  # never sent a third time
        if clear_suspects == "answered" and paced:  # suspects cleared by Stepped, none by a probe
            assert client.scheduler.suspects_cleared > 0 and client.scheduler.probes_sent == 0
        elif clear_suspects == "answered":
            assert client.scheduler.probes_sent > 0


async def test_a_dead_servers_requests_reenter_the_survivors_together(fake_servers) -> None:
    """All of the victim's requests run on the survivors at the same time, none waiting for another to
    finish: they never finish during the test (100,000 tokens each), so only concurrent re-dispatch gets
    every one of them running.  Under issue 25's rule (one suspect per server until it finishes) at most
    2 would run and the wait below would never end."""
    held = asyncio.Event()
    (victim,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.002), gate=held)
    survivors = await fake_servers(2, FakeEngineConfig(step_base_s=0.002))
    async with RolloutClient(servers=[victim.address, *(s.address for s in survivors)]) as client:
        sp = SamplingParams(max_new_tokens=100_000)
        tasks = [asyncio.ensure_future(client.generate([1, 2, 3, i], sampling=sp)) for i in range(60)]
        conn = next(c for c in client.servers if c.address == victim.address)
        await until(lambda: sum(c.in_flight for c in client.servers) == 60, "all 60 placed")
        cohort = conn.in_flight
        assert cohort >= 2
        victim.engine.kill("killed by the test")
        sched = client.scheduler
        await until(lambda: sum(sched._suspects_running.values()) == cohort, "every suspect running at once")
        assert sched.max_suspects_running >= cohort // 2  # more than one suspect per survivor
        assert not any(t.done() for t in tasks)  # nothing failed, nothing finished
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert sched.poisoned == 0


async def test_requests_a_dead_server_already_stepped_are_retried_without_probation(fake_servers) -> None:
    """A request that its server answered a later request after went through an engine step there: not a
    poison (module docstring), so when that server dies it is retried at once, with no probation or probe."""
    (victim,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.002))
    (survivor,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.002))
    # round robin: the short requests below reach the victim within two (least load breaks ties one way)
    async with RolloutClient(servers=[victim.address, survivor.address], policy="round_robin") as client:
        sp = SamplingParams(max_new_tokens=100_000)
        tasks = [asyncio.ensure_future(client.generate([1, 2, 3, i], sampling=sp)) for i in range(20)]
        conn = next(c for c in client.servers if c.address == victim.address)
        await until(lambda: sum(c.in_flight for c in client.servers) == 20, "all 20 placed")
        on_victim = conn.in_flight
        for i in range(4):  # a short request answered by the victim, sent after the long ones
            r = await client.generate([4, 5, i], sampling=SamplingParams(max_new_tokens=1))
            if r.server_id == victim.server_id:
                break
        assert r.server_id == victim.server_id
        victim.engine.kill("killed by the test")
        sched = client.scheduler
        other = next(c for c in client.servers if c.address == survivor.address)
        await until(lambda: other.in_flight == 20, "the victim's requests all run on the survivor")
        assert on_victim > 0 and sched.retried == on_victim
        assert sched.probes_sent == 0 and not sched._probation
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_pacing_server_hands_its_engine_one_probation_request_a_step(fake_servers) -> None:
    """Every suspect of a dead server is sent to the survivor at once (probation=True); the survivor's server
    hands them to its engine one at a time, each only once the engine step that admitted the previous one
    ended (Stepped), so the engine never holds two unstepped probation requests; each Stepped clears one
    suspect in the client, with no probe (server.py, "Probation")."""
    held = asyncio.Event()  # never set: the victim's requests never go through a step
    (victim,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.002), gate=held)
    (survivor,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.002))
    engine = survivor.engine
    unstepped: set[str] = set()
    seen_unstepped: list[int] = []  # probation requests in the engine, unstepped, when the next one arrived
    real_generate, listener = engine.generate, engine.step_listener
    assert listener is not None

    async def generate(req: GenerateRequest) -> GenerateResult:
        if req.probation:
            seen_unstepped.append(len(unstepped))
            unstepped.add(req.rid)
        return await real_generate(req)

    def stepped(rids: list[str]) -> bool:
        unstepped.difference_update(rids)
        return listener(rids)

    engine.generate, engine.step_listener = generate, stepped  # type: ignore[method-assign]
    async with RolloutClient(servers=[victim.address, survivor.address]) as client:
        sp = SamplingParams(max_new_tokens=100_000)
        tasks = [asyncio.ensure_future(client.generate([1, 2, 3, i], sampling=sp)) for i in range(20)]
        conn = next(c for c in client.servers if c.address == victim.address)
        other = next(c for c in client.servers if c.address == survivor.address)
        await until(lambda: sum(c.in_flight for c in client.servers) == 20, "all 20 placed")
        cohort = conn.in_flight
        assert cohort >= 2 and other.paces_probation
        victim.engine.kill("killed by the test")
        sched = client.scheduler
        await until(lambda: sched.suspects_cleared == cohort, "every suspect stepped on the survivor")
        assert seen_unstepped == [0] * cohort  # one at a time: the previous had stepped
        assert sched.max_suspects_running == cohort  # all sent at once, none waiting in the client
        assert sched.probes_sent == 0 and not sched._paced
        assert not any(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: not survivor._lines and not survivor._flights, "the survivor holds nothing")
        assert sched.poisoned == 0
