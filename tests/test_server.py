"""The engine server over real ZMQ on loopback, with the CPU engine in its own process."""

from __future__ import annotations

import asyncio
import signal

import msgspec
import pytest
import zmq
import zmq.asyncio

from rollout_sdk import (
    EngineBusyError,
    EngineDeadError,
    GenerateRequest,
    InvalidRequestError,
    RolloutClient,
    SamplingParams,
)
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.protocol import (
    Abort,
    ControlReply,
    ErrorReply,
    GenerateResult,
    PauseGeneration,
    Ping,
    Pong,
    ResumeGeneration,
    decode_server_message,
    encode,
)


class RawClient:
    """A bare DEALER socket: sends exactly the bytes a test wants, reads replies."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def send_raw(self, *frames: bytes) -> None:
        await self.sock.send_multipart(list(frames))

    async def send_obj(self, obj: dict) -> None:
        await self.sock.send(msgspec.msgpack.encode(obj))

    async def recv(self, timeout: float = 30) -> msgspec.Struct:
        data = await asyncio.wait_for(self.sock.recv(), timeout)
        return decode_server_message(data)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


CPU_SERVER = ("--engine", "cpu", "--cpu-max-running", "64")


@pytest.fixture(scope="module")
def shared_cpu_server(module_spawn_server, tiny_model):
    """One server for the tests that leave it as they found it (each asserts on its own rids only; those
    that pause it or release its memory resume it, failed or not: a CPU-engine start costs seconds of CPU)."""
    return module_spawn_server(*CPU_SERVER, "--cpu-model-path", str(tiny_model))


def _gen(i: int, **sp: object) -> GenerateRequest:
    return GenerateRequest(input_ids=[151644, 872, 198, 1000 + i], sampling=SamplingParams(**sp))  # type: ignore[arg-type]


async def test_200_concurrent_requests_answered_with_their_own_rid(shared_cpu_server) -> None:
    async with RolloutClient(servers=[shared_cpu_server.address]) as client:
        reqs = [msgspec.structs.replace(_gen(i, max_new_tokens=8), rid=f"mine-{i}") for i in range(200)]
        results = await asyncio.gather(*(client.generate(r) for r in reqs))
    assert [r.rid for r in results] == [f"mine-{i}" for i in range(200)]
    assert all(r.finish_reason in ("length", "stop") and r.output_ids for r in results)
    assert all(len(r.logprobs or []) == len(r.output_ids) for r in results)


async def test_abort_mid_generation_returns_tokens_so_far(shared_cpu_server) -> None:
    raw = RawClient(shared_cpu_server.address)
    try:
        await raw.sock.send(encode(msgspec.structs.replace(_gen(0, max_new_tokens=3000, ignore_eos=True), rid="long")))
        # a condition, not a sleep: a 1-token request sent after it has finished, so "long" (batched with it
        # from its first step) has made at least one token
        await raw.sock.send(encode(msgspec.structs.replace(_gen(1, max_new_tokens=1), rid="probe")))
        probe = await raw.recv(60)
        assert isinstance(probe, GenerateResult) and probe.rid == "probe"
        await raw.sock.send(encode(Abort("long")))
        msg = await raw.recv(30)
        assert isinstance(msg, GenerateResult)
        assert (msg.rid, msg.finish_reason) == ("long", "abort")
        assert 0 < len(msg.output_ids) < 3000
    finally:
        raw.close()


async def test_seeded_requests_reproduce_over_the_wire(shared_cpu_server) -> None:
    async with RolloutClient(servers=[shared_cpu_server.address]) as client:
        a = await client.generate(_gen(1, seed=123, max_new_tokens=16))
        others = [client.generate(_gen(i, max_new_tokens=16)) for i in range(10)]
        b, *_ = await asyncio.gather(client.generate(_gen(1, seed=123, max_new_tokens=16)), *others)
    assert a.output_ids == b.output_ids


BAD = [
    ({"type": "generate", "rid": "e1", "input_ids": []}, "input_ids"),
    ({"type": "generate", "rid": "e2", "input_ids": [1, 999_999]}, "input_ids[1]"),
    ({"type": "generate", "rid": "e3", "input_ids": [1] * 5000}, "input_ids"),
    ({"type": "generate", "rid": "e4", "input_ids": [1], "sampling": {"max_new_tokens": 0}}, "sampling.max_new_tokens"),
    (
        {"type": "generate", "rid": "e5", "input_ids": [1], "sampling": {"max_new_tokens": -3}},
        "sampling.max_new_tokens",
    ),
    ({"type": "generate", "rid": "e6", "input_ids": [1], "sampling": {"temperature": -1.0}}, "sampling.temperature"),
    ({"type": "generate", "rid": "e7", "input_ids": [1, "a"]}, "input_ids[1]"),
    ({"type": "generate", "rid": "e8", "input_ids": [1], "sampling": {"top_p": "high"}}, "sampling.top_p"),
]


async def test_bad_input_gets_typed_errors_and_the_server_keeps_serving(shared_cpu_server) -> None:
    raw = RawClient(shared_cpu_server.address)
    try:
        async with RolloutClient(servers=[shared_cpu_server.address]) as client:
            good = [
                asyncio.create_task(client.generate(_gen(i, max_new_tokens=64, ignore_eos=True))) for i in range(20)
            ]
            async with asyncio.timeout(60):  # the bad input arrives while good requests run (a condition, not a sleep)
                while (await client.servers[0].fetch_stats()).running < 1:
                    await asyncio.sleep(0.005)
            for obj, field in BAD:
                await raw.send_obj(obj)
                reply = await raw.recv()
                assert isinstance(reply, ErrorReply), obj
                assert (reply.code, reply.rid, reply.field) == ("invalid_request", obj["rid"], field), reply
                assert reply.message
            await raw.send_obj({"type": "teleport", "rid": "x"})
            reply = await raw.recv()
            assert isinstance(reply, ErrorReply)
            assert reply.code == "protocol"
            assert "teleport" in reply.message
            await raw.send_raw(b"\x00\xffnot msgpack at all")
            reply = await raw.recv()
            assert isinstance(reply, ErrorReply)
            assert reply.code == "protocol"
            await raw.send_raw(b"two", b"frames")
            reply = await raw.recv()
            assert isinstance(reply, ErrorReply)
            assert reply.code == "protocol"
            # the typed error reaches a RolloutClient user with field and value
            with pytest.raises(InvalidRequestError) as info:
                await client.generate(GenerateRequest(input_ids=[1, 200_000]))
            assert (info.value.field, info.value.value) == ("input_ids[1]", 200_000)
            results = await asyncio.gather(*good)
            assert all(r.finish_reason == "length" and len(r.output_ids) == 64 for r in results)
            await raw.sock.send(encode(Ping(1)))
            pong = await raw.recv()
            assert isinstance(pong, Pong)
            assert pong.stats.errors >= len(BAD) + 3
            assert pong.stats.completed >= 20
    finally:
        raw.close()


async def test_duplicate_rid_in_flight_is_refused(shared_cpu_server) -> None:
    raw = RawClient(shared_cpu_server.address)
    try:
        # a paused engine holds requests: the first stays in flight however fast the engine or slow this test
        # process is (it once finished all its tokens before the Abort below reached a loaded machine's server)
        await raw.sock.send(encode(PauseGeneration(call_id="hold", mode="in_place")))
        assert isinstance(await raw.recv(), ControlReply)
        req = msgspec.structs.replace(_gen(0, max_new_tokens=500, ignore_eos=True), rid="dup")
        await raw.sock.send(encode(req))
        await raw.sock.send(encode(req))
        reply = await raw.recv()
        assert isinstance(reply, ErrorReply)
        assert (reply.code, reply.field, reply.rid) == ("duplicate_rid", "rid", "dup")
        await raw.sock.send(encode(Abort("dup")))
        done = await raw.recv()
        assert isinstance(done, GenerateResult)
        assert done.finish_reason == "abort"
    finally:
        try:
            await raw.sock.send(encode(ResumeGeneration(call_id="resume")))
            assert isinstance(await raw.recv(), ControlReply)
        finally:
            raw.close()


async def test_sigterm_answers_every_request_then_exits_zero(spawn_server, tiny_model) -> None:
    srv = spawn_server("--engine", "cpu", "--cpu-model-path", str(tiny_model), "--drain-timeout-s", "0.5")
    raw = RawClient(srv.address)
    try:
        for i in range(10):
            req = msgspec.structs.replace(_gen(i, max_new_tokens=3000, ignore_eos=True), rid=f"t{i}")
            await raw.sock.send(encode(req))
        await raw.sock.send(encode(Ping(1)))  # answered after the 10 were accepted (same socket, in order)
        pong = await raw.recv(60)
        assert isinstance(pong, Pong) and pong.stats.in_flight == 10
        srv.proc.send_signal(signal.SIGTERM)
        got = {}
        for _ in range(10):
            msg = await raw.recv(15)
            assert isinstance(msg, GenerateResult)
            got[msg.rid] = msg.finish_reason
        assert got == {f"t{i}": "abort" for i in range(10)}
        assert await asyncio.to_thread(srv.proc.wait, 30) == 0
    finally:
        raw.close()


async def test_dead_engine_fails_in_flight_fast_and_new_requests_too(fake_servers) -> None:
    (server,) = await fake_servers(1, FakeEngineConfig(step_base_s=0.01))
    async with RolloutClient(servers=[server.address], retries=0) as client:
        tasks = [asyncio.create_task(client.generate(_gen(i, max_new_tokens=10_000))) for i in range(5)]
        while server.stats().in_flight < 5:  # a condition, not a sleep
            await asyncio.sleep(0.005)
        server.engine.kill("simulated crash")  # type: ignore[attr-defined]
        for t in tasks:  # 10,000 tokens at 10 ms a step: only the death can end them
            with pytest.raises(EngineDeadError, match="simulated crash"):
                await asyncio.wait_for(t, 60)
    raw = RawClient(server.address)
    try:
        await raw.sock.send(encode(msgspec.structs.replace(_gen(0), rid="late")))
        reply = await raw.recv(5)
        assert isinstance(reply, ErrorReply)
        assert (reply.code, reply.rid) == ("engine_dead", "late")
    finally:
        raw.close()


async def test_release_memory_with_requests_held_by_a_pause(shared_cpu_server) -> None:
    """Colocated training: in-flight requests are held, memory released, then woken and continued."""
    # 160 tokens: enough to be mid-flight at the pause (a few round trips after they run), short enough
    # for a loaded 2-core machine
    async with RolloutClient(servers=[shared_cpu_server.address]) as client:
        sp = SamplingParams(max_new_tokens=160, ignore_eos=True)
        tasks = [asyncio.ensure_future(client.generate([5, 6, 7, 8 + i], sampling=sp)) for i in range(4)]
        try:
            while (await client.servers[0].fetch_stats()).running < 4:  # a condition, not a sleep
                await asyncio.sleep(0.01)
            assert not any(t.done() for t in tasks)
            with pytest.raises(EngineBusyError):
                await client.release_memory()  # running requests: refused, nothing stops
            await client.pause("hold")
            await client.release_memory()
            await client.resume()
            st = await client.servers[0].fetch_stats()  # after the resume: held, none running
            assert not st.paused and st.running == 0 and st.in_flight >= 4, st
            assert not any(t.done() for t in tasks)  # the weights are gone: still held
        finally:  # the shared server as it was, whatever failed
            await client.resume()
            await client.resume_memory()
        results = await asyncio.gather(*tasks)
    assert all(len(r.output_ids) == 160 and r.finish_reason == "length" for r in results)


def test_a_gone_client_is_forgotten_once_not_once_per_undeliverable_abort(caplog) -> None:
    """Aborting a gone client's requests makes each answer ``abort`` to nobody: that must not abort (and
    log) the client again per reply; a client heard from again can be forgotten again."""
    import logging

    from rollout_sdk.server.peers import Peers

    running: dict[bytes, int] = {b"c1": 0}
    calls: list[bytes] = []

    def abort_client(ident: bytes) -> int:
        calls.append(ident)
        return running[ident]

    peers = Peers("s0", max_requests=64, client_timeout_s=30.0, abort_client=abort_client)
    peers.heard(b"c1", 0.0)
    for _ in range(5):
        peers.accepted(b"c1")
    running[b"c1"] = 5
    with caplog.at_level(logging.WARNING, logger="rollout_sdk.server"):
        peers.forget(b"c1", "it disconnected")
        for left in range(4, -1, -1):  # each aborted request's reply is undeliverable in turn
            running[b"c1"] = left
            peers.answered(b"c1")
            peers.forget(b"c1", "it disconnected")
    assert calls == [b"c1"]
    assert [r.getMessage() for r in caplog.records] == ["server s0: aborted 5 request(s) of a client: it disconnected"]
    # the client comes back (same routing id) and leaves again: forgotten again
    peers.heard(b"c1", 1.0)
    peers.accepted(b"c1")
    running[b"c1"] = 1
    peers.forget(b"c1", "it disconnected")
    assert calls == [b"c1", b"c1"]


@pytest.fixture
def gc_threshold():
    """The interpreter's collector thresholds, put back after the test whatever it did."""
    import gc

    saved = gc.get_threshold()
    yield gc
    gc.set_threshold(*saved)


async def test_serving_raises_the_gc_threshold_and_stop_puts_it_back(gc_threshold) -> None:
    """A server raises the young-generation threshold while it serves (thousands of requests in flight
    would run a collection every few dozen requests) and puts the old one back when it stops."""
    from rollout_sdk import EngineServer, ServerConfig
    from rollout_sdk.engines.fake import FakeEngine

    gc_threshold.set_threshold(700, 10, 10)
    async with EngineServer(FakeEngine(), ServerConfig(gc_threshold=12_345)) as server:
        assert gc_threshold.get_threshold() == (12_345, 10, 10)
        async with RolloutClient(servers=[server.address]) as client:
            r = await client.generate([5, 6, 7], sampling=SamplingParams(max_new_tokens=2))
        assert r.output_ids == [8, 9]
    assert gc_threshold.get_threshold() == (700, 10, 10)


def test_the_gc_threshold_is_only_raised_and_a_disabled_or_changed_one_is_left_alone(gc_threshold) -> None:
    from rollout_sdk import ConfigError, ServerConfig
    from rollout_sdk.server.server import raise_gc_threshold, restore_gc_threshold

    gc_threshold.set_threshold(50_000, 10, 10)
    assert raise_gc_threshold(10_000) is None  # never lowered
    assert gc_threshold.get_threshold() == (50_000, 10, 10)
    gc_threshold.set_threshold(0, 10, 10)  # the user disabled automatic collection: stays disabled
    assert raise_gc_threshold(10_000) is None
    assert gc_threshold.get_threshold()[0] == 0
    gc_threshold.set_threshold(700, 10, 10)
    assert raise_gc_threshold(None) is None
    saved = raise_gc_threshold(10_000)
    assert saved == (700, 10, 10) and gc_threshold.get_threshold()[0] == 10_000
    gc_threshold.set_threshold(20_000, 10, 10)  # someone else changed it meanwhile: theirs stays
    restore_gc_threshold(saved, 10_000)
    assert gc_threshold.get_threshold()[0] == 20_000
    with pytest.raises(ConfigError, match="gc_threshold"):
        ServerConfig(gc_threshold=0)
