"""Lifecycles: the caller's cancellation always propagates; a closed stream refuses reuse; streams are bounded."""

from __future__ import annotations

import asyncio

import pytest

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk._aio import cancel_and_wait
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.errors import ClientStateError


def stubborn_coro():
    """A coroutine that takes its time to unwind when cancelled: until ``release`` is set."""
    unwinding, release = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            unwinding.set()
            await release.wait()
            raise

    return run(), unwinding, release


def stubborn_task() -> tuple[asyncio.Task[None], asyncio.Event, asyncio.Event]:
    coro, unwinding, release = stubborn_coro()
    return asyncio.get_running_loop().create_task(coro), unwinding, release


async def test_cancel_and_wait_lets_the_callers_cancellation_propagate() -> None:
    child, unwinding, release = stubborn_task()
    await asyncio.sleep(0)  # let it start
    closer = asyncio.get_running_loop().create_task(cancel_and_wait(child))
    await unwinding.wait()
    closer.cancel()  # the caller of cancel_and_wait is cancelled while it waits
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closer
    assert closer.cancelled()
    await asyncio.wait([child])
    assert child.cancelled()


async def test_cancel_and_wait_returns_when_only_the_child_was_cancelled() -> None:
    child, _, release = stubborn_task()
    await asyncio.sleep(0)
    release.set()
    await cancel_and_wait(child)  # no CancelledError: the child's own cancellation is expected
    assert child.cancelled()


async def test_client_close_lets_the_callers_cancellation_propagate(fake_servers) -> None:
    servers = await fake_servers(1, FakeEngineConfig())
    client = RolloutClient(servers=[s.address for s in servers])
    await client.open()
    coro, unwinding, release = stubborn_coro()
    stubborn = client._own(coro, name="stubborn")  # an owned task that is slow to unwind
    await asyncio.sleep(0)
    closer = asyncio.get_running_loop().create_task(client.aclose())
    try:
        await unwinding.wait()
        closer.cancel()
    finally:
        release.set()
    with pytest.raises(asyncio.CancelledError):
        await closer
    await asyncio.wait([stubborn])
    await client.aclose()  # idempotent afterwards
    with pytest.raises(ClientStateError):
        await client.generate([1, 2])


PROMPTS = [GenerateRequest(input_ids=[3, i], sampling=SamplingParams(max_new_tokens=4)) for i in range(50)]


@pytest.mark.parametrize("kind", ["generate_many", "rollouts"])
async def test_a_closed_stream_refuses_to_be_iterated_again(fake_servers, kind) -> None:
    servers = await fake_servers(1, FakeEngineConfig())
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        stream = client.generate_many(PROMPTS) if kind == "generate_many" else client.rollouts(PROMPTS, batch_groups=2)
        async with stream:
            async for _ in stream:
                break
        sent = client.stats().completed + client.stats().aborted + client.stats().in_flight
        with pytest.raises(ClientStateError, match="closed"):
            async for _ in stream:
                pass
        with pytest.raises(ClientStateError, match="closed"):
            async with stream:
                pass
        # nothing was restarted in the background
        assert client.stats().in_flight == 0
        assert client.stats().completed + client.stats().aborted <= sent


@pytest.mark.parametrize("mode", ["async", "partial", "sync"])
async def test_rollouts_hold_a_bounded_number_of_groups_for_a_slow_consumer(fake_servers, mode) -> None:
    """A slot is freed when its group is consumed, not when it finishes: with a consumer that stops
    taking batches, the producer stops pulling samples once every slot holds a group."""
    servers = await fake_servers(1, FakeEngineConfig(max_batch=64))
    pulled = 0

    def source():
        nonlocal pulled
        for p in PROMPTS * 20:
            pulled += 1
            yield p

    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.rollouts(source(), batch_groups=4, over_provision=1.5, mode=mode) as stream:
            it = aiter(stream)
            await anext(it)  # one batch consumed, then the consumer stalls
            stats = stream.statistics()
            assert stats.capacity == (4 if mode == "sync" else 6)
            if mode == "partial":  # paused between batches: nothing new starts until the next batch is asked for
                assert stats.held <= stats.capacity and pulled <= 4 + stats.capacity
                await anext(it)
                assert stream.statistics().held <= stats.capacity and pulled <= 8 + stats.capacity
                return
            deadline = asyncio.get_running_loop().time() + 60
            slots = stream._producer._slots  # type: ignore[attr-defined]
            while True:  # wait (on a condition, with a deadline) until the producer has filled every slot
                stats = stream.statistics()  # and waits for one more: it pulls a sample only after its slot,
                if stats.in_flight == 0 and stats.buffered == stats.capacity and slots._waiters:  # so it would
                    break  # have pulled by now if the bound let it (a condition, not a few yields)
                assert asyncio.get_running_loop().time() < deadline, stats
                await asyncio.sleep(0.01)
            assert pulled == 4 + stats.capacity
            assert stream.statistics() == stats
            batch = await anext(it)  # taking a batch frees its slots and the producer refills
            assert len(batch.groups) == 4


async def test_generate_many_holds_at_most_concurrency_samples(fake_servers) -> None:
    servers = await fake_servers(1, FakeEngineConfig(max_batch=64))
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        async with client.generate_many(PROMPTS * 4, group_size=2, concurrency=10) as stream:
            it = aiter(stream)
            await anext(it)
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                stats = stream.statistics()
                if stats.in_flight == 0 and stats.buffered == stats.capacity:
                    break
                assert asyncio.get_running_loop().time() < deadline, stats
                await asyncio.sleep(0.01)
            assert stats.capacity == 5  # groups of 2 samples: 10 samples
