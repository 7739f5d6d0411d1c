"""Faults (issue 15): poison requests, rid reuse, bounded wire, admission, shutdown, orphans, paused fleets.

Every test waits on conditions (events, a gate, polls with a deadline that only guards against a hang),
never on a sleep or a wall-clock bound, so it passes on a loaded machine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from rollout_sdk import (
    ConfigError,
    DuplicateRequestError,
    EngineServer,
    GenerateRequest,
    InvalidRequestError,
    MessageTooLargeError,
    PoisonRequestError,
    RequestTimeoutError,
    RolloutClient,
    SamplingParams,
    ServerConfig,
)
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.errors import ServerBusyError, error_from_reply
from rollout_sdk.protocol import (
    MAX_TIMEOUT_S,
    Abort,
    ControlReply,
    ErrorReply,
    GenerateResult,
    InitWeightGroup,
    Ping,
    Pong,
    ReleaseMemory,
    decode_client_message,
    decode_server_message,
    encode,
    is_generate_frame,
)

HANG_GUARD_S = 60.0  # only against a hang: no assertion depends on it


class Raw:
    """A bare DEALER socket for the wire-level tests."""

    def __init__(self, address: str, routing_id: bytes | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:  # a known identity: the server's replies to it can be addressed by hand
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(address)

    async def send(self, msg: msgspec.Struct | bytes) -> None:
        await self.sock.send(msg if isinstance(msg, bytes) else encode(msg))

    async def recv(self, timeout: float = HANG_GUARD_S) -> Any:
        return decode_server_message(await asyncio.wait_for(self.sock.recv(), timeout))

    async def ping(self) -> Pong:
        await self.send(Ping(1))
        while True:
            msg = await self.recv()
            if isinstance(msg, Pong):
                return msg

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine | None = None, **cfg: Any) -> AsyncIterator[EngineServer]:
    server = EngineServer(engine or FakeEngine(), ServerConfig(**cfg))
    async with server:
        yield server


@contextlib.contextmanager
def raw_client(address: str) -> Any:
    raw = Raw(address)
    try:
        yield raw
    finally:
        raw.close()


async def until(cond: Callable[[], bool], what: str) -> None:
    """Poll a condition; the deadline is a hang guard, not a timing assertion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_GUARD_S
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


def _req(i: int = 0, n: int = 4, rid: str = "") -> GenerateRequest:
    return GenerateRequest(input_ids=[5, 6, 7, 100 + i], sampling=SamplingParams(max_new_tokens=n), rid=rid)


# -- 2. poison requests ---------------------------------------------------------------------------------


async def poisoned_fleet(fake_servers, n: int) -> list[EngineServer]:
    """``n`` fake servers whose engine dies (once scheduled) on any request holding token 666."""
    servers = await fake_servers(n, FakeEngineConfig(step_base_s=0.002))
    loop = asyncio.get_running_loop()
    for s in servers:
        engine = s.engine
        assert isinstance(engine, FakeEngine)

        def responder(req: GenerateRequest, engine: FakeEngine = engine) -> list[int]:
            if 666 in req.input_ids:
                loop.call_soon(engine.kill, "poisoned by request 666")
            return [9] * req.sampling.max_new_tokens

        engine.responder = responder
    return servers


async def test_a_request_that_kills_two_servers_is_poison_and_the_third_survives(fake_servers) -> None:
    servers = await poisoned_fleet(fake_servers, 3)
    async with RolloutClient(servers=[s.address for s in servers], retries=5) as client:
        with pytest.raises(PoisonRequestError, match="not retried again"):
            await client.generate([1, 2, 666], sampling=SamplingParams(max_new_tokens=4))
        dead = [s for s in servers if s.engine.dead is not None]
        assert len(dead) == 2  # retried once, then never again, although retries=5 allowed more
        survivor = next(s for s in servers if s.engine.dead is None)
        result = await client.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=4))
        assert result.server_id == survivor.server_id
        assert client.scheduler.poisoned == 1
        assert sum(1 for r in survivor.engine.requests_seen if 666 in r.input_ids) == 0


async def test_poison_request_error_crosses_the_wire_with_its_code() -> None:
    err = error_from_reply("poison_request", "boom")
    assert isinstance(err, PoisonRequestError)
    dup = error_from_reply("duplicate_rid", "in flight", "rid", "r1")
    assert isinstance(dup, DuplicateRequestError) and (dup.field, dup.value) == ("rid", "r1")
    assert isinstance(error_from_reply("busy", "full"), ServerBusyError)
    assert isinstance(error_from_reply("too_large", "big", "message", "<9 bytes>"), MessageTooLargeError)


# -- 3. rid reuse ---------------------------------------------------------------------------------------


async def test_reused_rid_in_the_client_fails_the_second_and_the_first_gets_its_result() -> None:
    gate = asyncio.Event()
    async with serving(FakeEngine(gate=gate)) as server, RolloutClient(servers=[server.address]) as client:
        first = asyncio.create_task(client.generate(_req(1, rid="mine")))
        await until(lambda: server.stats().in_flight == 1, "the first request is on the server")
        with pytest.raises(DuplicateRequestError) as info:
            await client.generate(_req(2, rid="mine"))
        assert (info.value.field, info.value.value) == ("rid", "mine")
        gate.set()
        result = await asyncio.wait_for(first, HANG_GUARD_S)
        assert (result.rid, result.finish_reason, result.prompt_tokens) == ("mine", "length", 4)
        assert result.output_ids == [101 + 1 + i for i in range(4)]
        # the rid is free again once the first finished
        again = await client.generate(_req(3, rid="mine"))
        assert again.rid == "mine"


async def test_reused_rid_on_the_wire_gets_a_typed_error_and_the_first_is_answered() -> None:
    gate = asyncio.Event()
    async with serving(FakeEngine(gate=gate)) as server:
        with raw_client(server.address) as raw:
            await raw.send(_req(1, rid="dup"))
            await raw.send(_req(2, rid="dup"))
            reply = await raw.recv()
            assert isinstance(reply, ErrorReply)
            assert (reply.code, reply.field, reply.rid) == ("duplicate_rid", "rid", "dup")
            gate.set()
            done = await raw.recv()
            assert isinstance(done, GenerateResult)
            assert (done.rid, done.finish_reason, done.output_ids[0]) == ("dup", "length", 102)
            assert server.stats().in_flight == 0


async def test_an_abort_handled_before_its_request_reached_the_engine_still_aborts_it() -> None:
    """A request and its Abort in one recv batch: the Abort is handled before the request's task first runs,
    when the engine has not seen the request.  It must still end as ``abort`` (it used to be lost: the request
    then ran to its end, or here, behind a closed gate, forever).  Driven through the server's message handler
    directly, both in one loop step, so the order is certain rather than likely."""
    gate = asyncio.Event()  # never opened: a request that reaches the engine never finishes
    engine = FakeEngine(gate=gate)
    ident = b"early-abort-client"
    async with serving(engine) as server:
        raw = Raw(server.address, routing_id=ident)
        try:
            await raw.ping()  # connected and heard from: replies can reach it
            server._handle(ident, encode(_req(1, rid="early")))
            server._handle(ident, encode(Abort("early")))  # same loop step: the request's task has not run
            done = await raw.recv()
            while isinstance(done, Pong):  # a heartbeat answer may come first
                done = await raw.recv()
            assert isinstance(done, GenerateResult)
            assert (done.rid, done.finish_reason, done.output_ids) == ("early", "abort", [])
            assert not any(r.rid.endswith(":early") for r in engine.requests_seen)  # the engine never ran it
            assert server.stats().in_flight == 0
        finally:
            raw.close()


# -- 4. bounded wire --------------------------------------------------------------------------------------


def _big_request(num_tokens: int, rid: str) -> bytes:
    return encode(GenerateRequest(input_ids=[1000 + i % 5000 for i in range(num_tokens)], rid=rid))


async def test_frames_over_the_limits_are_refused_before_decoding_and_the_server_keeps_serving() -> None:
    cfg = {"max_generate_bytes": 200_000, "max_control_bytes": 2_000, "offload_decode_bytes": 20_000}
    async with serving(**cfg) as server:
        with raw_client(server.address) as raw:
            # a control-sized limit for anything that is not a GenerateRequest
            await raw.send(encode({"type": "pause", "call_id": "c" * 5000}))
            reply = await raw.recv()
            assert isinstance(reply, ErrorReply)
            assert (reply.code, reply.field) == ("too_large", "message")
            assert "2000" in reply.message
            # a GenerateRequest above the offload threshold: decoded off the loop, answered in full
            await raw.send(_big_request(30_000, "big"))
            big = await raw.recv()
            assert isinstance(big, GenerateResult)
            assert (big.rid, big.prompt_tokens) == ("big", 30_000)
            seen = server.engine.requests_seen[-1]  # type: ignore[attr-defined]
            assert seen.input_ids[:3] == [1000, 1001, 1002] and len(seen.input_ids) == 30_000
            # a bad token id in a large frame is still a typed error naming the field, with the rid
            bad = encode(GenerateRequest(input_ids=[1] * 20_000 + [10**9], rid="bad-big"))
            await raw.send(bad)
            err = await raw.recv()
            assert isinstance(err, ErrorReply)
            assert (err.code, err.rid, err.field) == ("invalid_request", "bad-big", "input_ids[20000]")
            assert (await raw.ping()).stats.errors == 2
        # over the largest limit: libzmq drops the frame (and that peer's connection) before Python sees it
        with raw_client(server.address) as attacker:
            await attacker.send(_big_request(80_000, "huge"))
            with raw_client(server.address) as other:
                for i in range(3):
                    await other.send(_req(i, rid=f"ok{i}"))
                    ok = await other.recv()
                    assert isinstance(ok, GenerateResult) and ok.rid == f"ok{i}"
        assert all(r.rid.split(":")[-1] != "huge" for r in server.engine.requests_seen)  # type: ignore[attr-defined]


async def test_the_client_refuses_a_request_larger_than_the_server_accepts() -> None:
    async with serving(max_generate_bytes=50_000, max_control_bytes=2_000) as server:
        async with RolloutClient(servers=[server.address]) as client:
            assert client.server_info()[0].max_generate_bytes == 50_000
            with pytest.raises(MessageTooLargeError) as info:
                await client.generate([1000] * 20_000)
            assert info.value.field == "input_ids"
            ok = await client.generate([7] * 100, sampling=SamplingParams(max_new_tokens=2))
            assert ok.prompt_tokens == 100
        assert server.stats().errors == 0  # refused in the client: nothing was sent


def test_generate_frames_are_recognised_without_decoding() -> None:
    assert is_generate_frame(encode(_req()))
    assert not is_generate_frame(encode(Ping(3)))
    assert not is_generate_frame(b"")
    # keys in another order: treated as control (the smaller limit), never as a larger generate frame
    reordered = msgspec.msgpack.encode({"input_ids": [1], "type": "generate"})
    assert not is_generate_frame(reordered)
    assert isinstance(decode_client_message(reordered), GenerateRequest)


# -- 5. admission ------------------------------------------------------------------------------------------


async def test_admission_cap_and_fair_share_answer_busy_on_the_wire() -> None:
    gate = asyncio.Event()
    async with serving(FakeEngine(gate=gate), max_requests=8) as server:
        with raw_client(server.address) as flooder, raw_client(server.address) as polite:
            await polite.send(_req(0, rid="p0"))  # two clients with requests: each one's share is 8 // 2 = 4
            await until(lambda: server.stats().in_flight == 1, "the polite client's first request is admitted")
            for i in range(20):
                await flooder.send(_req(i, rid=f"f{i}"))
            busy = [await flooder.recv() for _ in range(16)]
            assert all(isinstance(b, ErrorReply) and b.code == "busy" for b in busy)
            assert sorted(int(b.rid[1:]) for b in busy) == list(range(4, 20))
            for i in range(1, 4):
                await polite.send(_req(i, rid=f"p{i}"))
            await until(lambda: server.stats().in_flight == 8, "the polite client's share is admitted")
            await polite.send(_req(9, rid="p9"))  # over the cap now
            over = await polite.recv()
            assert isinstance(over, ErrorReply) and (over.code, over.rid) == ("busy", "p9")
            gate.set()
            got = {(await polite.recv()).rid for _ in range(4)} | {(await flooder.recv()).rid for _ in range(4)}
            assert got == {f"p{i}" for i in range(4)} | {f"f{i}" for i in range(4)}
            assert (await polite.ping()).stats.errors == 0  # busy is back-pressure, not an error


async def test_the_client_treats_busy_as_back_pressure_and_every_request_completes() -> None:
    async with serving(FakeEngine(FakeEngineConfig(step_base_s=0.002)), max_requests=3) as server:
        async with RolloutClient(servers=[server.address], max_in_flight_per_server=64) as client:
            results = await asyncio.wait_for(
                asyncio.gather(*(client.generate(_req(i)) for i in range(40))), HANG_GUARD_S
            )
            assert all(r.finish_reason == "length" for r in results)
            conn = client.servers[0]
            assert conn.busy_replies > 0
            stats = client.stats()
            assert (stats.completed, stats.errors, stats.retried) == (40, 0, 0)


# -- 7. shutdown and timeout bounds ----------------------------------------------------------------------


class _StuckEngine(FakeEngine):
    """An engine whose close() never returns and whose release_memory waits forever."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.never = asyncio.Event()

    async def close(self) -> None:
        await super().close()
        await self.never.wait()


async def test_stop_cancels_pending_control_calls_with_a_typed_error_and_returns_within_its_bound() -> None:
    gate = asyncio.Event()
    engine = _StuckEngine(gate=gate)
    server = EngineServer(engine, ServerConfig(drain_timeout_s=0.2, shutdown_timeout_s=1.0))
    await server.__aenter__()
    with raw_client(server.address) as raw:
        await raw.send(_req(1, rid="held"))
        await until(lambda: server.stats().in_flight == 1, "the request is in flight")
        await raw.send(ReleaseMemory("c1", wait=True))  # waits for idle: never, the request is gated
        await until(lambda: len(server._controls) == 1, "the control call is pending")
        # stop() must come back although the engine's close() never does and a control call is pending
        await asyncio.wait_for(server.aclose(), HANG_GUARD_S)
        replies = [await raw.recv() for _ in range(2)]
    by_kind = {type(r).__name__: r for r in replies}
    ctrl = by_kind["ErrorReply"]
    assert (ctrl.code, ctrl.call_id) == ("shutting_down", "c1")
    assert by_kind["GenerateResult"].finish_reason == "abort"


def test_every_timeout_is_bounded_at_validation() -> None:
    with pytest.raises(InvalidRequestError) as info:
        InitWeightGroup(
            call_id="c", master_address="h", master_port=1, rank_offset=1, world_size=2, timeout_s=MAX_TIMEOUT_S * 2
        )
    assert info.value.field == "timeout_s"
    with pytest.raises(InvalidRequestError):
        InitWeightGroup(call_id="c", master_address="h", master_port=1, rank_offset=1, world_size=2, timeout_s=0.0)
    for bad in (
        {"drain_timeout_s": 20.0},  # must stay inside the shutdown bound (10 s)
        {"shutdown_timeout_s": MAX_TIMEOUT_S + 1},
        {"client_timeout_s": float("nan")},
        {"control_timeout_s": 0.0},
        {"max_requests": 0},
    ):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)
    assert ServerConfig().shutdown_timeout_s <= 10.0


async def test_an_unbounded_timeout_on_the_wire_is_refused_with_its_field() -> None:
    async with serving() as server:
        with raw_client(server.address) as raw:
            await raw.send(
                encode(
                    {
                        "type": "init_weight_group",
                        "call_id": "c9",
                        "master_address": "127.0.0.1",
                        "master_port": 1,
                        "rank_offset": 1,
                        "world_size": 2,
                        "timeout_s": 1e9,
                    }
                )
            )
            reply = await raw.recv()
            assert isinstance(reply, ErrorReply)
            assert (reply.code, reply.field, reply.call_id) == ("invalid_request", "timeout_s", "c9")


# -- 8. orphans --------------------------------------------------------------------------------------------


async def test_a_silent_client_keeps_its_requests_while_connected_and_loses_them_once_gone() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(gate=gate)
    async with serving(engine, client_timeout_s=0.3) as server:
        raw = Raw(server.address)
        try:
            await raw.send(_req(1, rid="orphan"))
            await until(lambda: server.stats().in_flight == 1, "the request is in flight")
            # no Ping follows: after client_timeout_s the server probes this client (a Pong with seq 0);
            # the connection is up (a trainer whose event loop is blocked looks like this), so it stays
            probe = await raw.recv()
            assert isinstance(probe, Pong) and probe.seq == 0
            assert server.stats().in_flight == 1 and not engine.aborted_rids
        finally:
            raw.close()  # now the client is gone: the next probe fails and its request is aborted
        await until(lambda: server.stats().in_flight == 0, "the gone client's request is aborted")
        assert any(r.endswith(":orphan") for r in engine.aborted_rids)


async def test_after_a_failover_the_old_server_is_told_to_abort_and_its_answer_is_dropped() -> None:
    gate = asyncio.Event()
    old_engine = FakeEngine(gate=gate)
    async with serving(old_engine) as old, serving() as new:
        async with RolloutClient(servers=[old.address, new.address], policy="round_robin") as client:
            old_conn = next(c for c in client.servers if c.address == old.address)
            task = asyncio.create_task(client.generate(_req(1, rid="r1")))
            await until(lambda: old.stats().in_flight == 1 or new.stats().completed == 1, "placed")
            if new.stats().completed == 1:  # round robin started on the other server: place again
                await task
                task = asyncio.create_task(client.generate(_req(2, rid="r2")))
                await until(lambda: old.stats().in_flight == 1, "placed on the old server")
            # the client stops hearing the old server (a missed heartbeat): the request fails over
            old_conn.mark_dead("no heartbeat (test)")
            result = await asyncio.wait_for(task, HANG_GUARD_S)
            assert result.server_id == new.server_id and result.finish_reason == "length"
            # and the old server, still reachable, was told to abort it
            await until(lambda: bool(old_engine.aborted_rids), "the old server aborts the orphan")
            await until(lambda: old.stats().in_flight == 0, "the orphan is gone on the old server")
            await until(lambda: old_conn.alive, "the old server answers heartbeats again")
            stats = client.stats()
            assert stats.aborted == 0 and stats.errors == 1  # the old server's abort result was dropped
            assert old_conn.num_orphans == 0


# -- 9. paused and released fleets ---------------------------------------------------------------------


async def test_requests_for_a_paused_fleet_wait_in_the_client_bounded_by_their_timeout() -> None:
    engine = FakeEngine()
    async with serving(engine) as server, RolloutClient(servers=[server.address]) as client:
        await client.pause()
        with pytest.raises(RequestTimeoutError):
            await client.generate(_req(1), timeout=0.2)  # waited in the client, never sent
        task = asyncio.create_task(client.generate(_req(2)))  # the default: wait until resumed
        await until(lambda: client.stats().waiting == 1, "the request waits in the client")
        assert len(engine.requests_seen) == 0
        await client.resume()
        result = await asyncio.wait_for(task, HANG_GUARD_S)
        assert result.finish_reason == "length"
        assert len(engine.requests_seen) == 1


async def test_requests_for_a_released_fleet_wait_until_memory_is_back() -> None:
    engine = FakeEngine()
    async with serving(engine) as server, RolloutClient(servers=[server.address]) as client:
        await client.release_memory()
        task = asyncio.create_task(client.generate(_req(3)))
        await until(lambda: client.stats().waiting == 1, "the request waits in the client")
        assert len(engine.requests_seen) == 0
        await client.resume_memory()
        assert (await asyncio.wait_for(task, HANG_GUARD_S)).finish_reason == "length"


async def test_a_pause_by_another_client_is_learned_from_heartbeats() -> None:
    engine = FakeEngine()
    async with serving(engine) as server:
        async with (
            RolloutClient(servers=[server.address], heartbeat_interval_s=0.05) as user,
            RolloutClient(servers=[server.address]) as trainer,
        ):
            await trainer.pause()
            await until(lambda: user.servers[0].held, "the user's client learns of the pause")
            task = asyncio.create_task(user.generate(_req(4)))
            await until(lambda: user.stats().waiting == 1, "the request waits in the user's client")
            await trainer.resume()
            assert (await asyncio.wait_for(task, HANG_GUARD_S)).finish_reason == "length"


async def test_control_reply_types_are_unchanged() -> None:
    # a control call still answers with ControlReply (the new bounds do not change the happy path)
    async with serving() as server:
        with raw_client(server.address) as raw:
            await raw.send(encode({"type": "flush_cache", "call_id": "f1"}))
            reply = await raw.recv()
            assert isinstance(reply, ControlReply) and reply.call_id == "f1"
            await raw.send(Abort("nothing"))  # an unknown rid: ignored, no reply
            assert isinstance(await raw.ping(), Pong)
