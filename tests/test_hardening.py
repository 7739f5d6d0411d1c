"""Hardening, round 2 (issue 25): list bounds checked while decoding, back-pressure that never blocks the
receive loop, fair share that throwaway identities cannot dilute, poison isolation.

Every test waits on conditions (events, a gate, counters, polls whose deadline only guards against a hang),
never on a sleep or a wall-clock bound.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from rollout_sdk import (
    EngineServer,
    GenerateRequest,
    InvalidRequestError,
    PoisonRequestError,
    RolloutClient,
    SamplingParams,
    ServerConfig,
)
from rollout_sdk.engines.fake import FakeEngine
from rollout_sdk.protocol import (
    MAX_INPUT_IDS,
    MAX_STOP_TOKEN_IDS,
    MAX_TENSORS,
    Abort,
    ErrorReply,
    GenerateResult,
    Pong,
    decode_client_message,
    encode,
)
from rollout_sdk.server.frames import DecodeWorker, peek_rid
from rollout_sdk.server.peers import Peers
from test_faults import Raw, poisoned_fleet, raw_client, serving, until

# -- 2. bounds on every list, checked by msgspec while decoding -------------------------------------------


def _raw(d: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        ({"type": "generate", "rid": "r1", "input_ids": [1] * (MAX_INPUT_IDS + 1)}, "input_ids"),
        (
            {
                "type": "generate",
                "rid": "r2",
                "input_ids": [1],
                "sampling": {"stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)},
            },
            "sampling.stop_token_ids",
        ),
        (
            {"type": "update_weights_dist", "call_id": "c3", "group_name": "g", "buckets": [[]] * (MAX_TENSORS + 1)},
            "buckets",
        ),
        (
            {"type": "update_weights_dist", "call_id": "c4", "group_name": "g", "buckets": [[["w", "f32", [1] * 17]]]},
            "buckets[0][0][2]",
        ),
        (
            {"type": "update_weights_ipc", "call_id": "c5", "handles": [b"h"] * (MAX_TENSORS + 1), "buckets": []},
            "handles",
        ),
        ({"type": "release_memory", "call_id": "c6", "tags": ["weights"] * 9}, "tags"),
    ],
)
def test_every_list_on_the_wire_has_a_bound_named_by_field(msg: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_client_message(_raw(msg))
    assert info.value.field == field
    assert "length" in info.value.reason
    ids = (getattr(info.value, "rid", None), getattr(info.value, "call_id", None))
    assert msg.get("rid") in ids or msg.get("call_id") in ids
    if isinstance(info.value.value, str):  # a list over its bound is reported by its length, not echoed
        assert info.value.value.startswith("<")


def test_the_bounds_hold_for_structs_built_in_user_code_too() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    assert info.value.field == "sampling.stop_token_ids"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=[1, -2])
    assert (info.value.field, info.value.value) == ("sampling.stop_token_ids[1]", -2)
    SamplingParams(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)  # at the bound: fine


async def test_a_large_frame_with_too_many_stop_ids_is_refused_by_field_and_the_server_serves_on() -> None:
    async with serving(offload_decode_bytes=10_000) as server:
        with raw_client(server.address) as raw:
            frame = _raw(
                {
                    "type": "generate",
                    "rid": "many-stops",
                    "input_ids": [1000] * 5_000,  # above offload_decode_bytes: decoded in the worker
                    "sampling": {"stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)},
                }
            )
            await raw.send(frame)
            err = await raw.recv()
            assert isinstance(err, ErrorReply)
            assert (err.code, err.rid, err.field) == ("invalid_request", "many-stops", "sampling.stop_token_ids")
            ok = GenerateRequest(
                input_ids=[1000 + i for i in range(5_000)], sampling=SamplingParams(max_new_tokens=2), rid="ok"
            )
            await raw.send(ok)
            res = await raw.recv()
            assert isinstance(res, GenerateResult) and res.rid == "ok"
            # its ids are the server's shared ints: 8 bytes each (a pointer), not a fresh int apiece
            seen = server.engine.requests_seen[-1]  # type: ignore[attr-defined]
            table = server._ints._ints
            assert table is not None and len(table) == server.engine.limits.vocab_size
            assert all(seen.input_ids[i] is table[1000 + i] for i in range(0, 5_000, 97))


def test_the_rid_of_a_large_frame_is_read_without_its_ids() -> None:
    frame = encode(GenerateRequest(input_ids=list(range(1, 50_000)), rid="peeked"))
    assert peek_rid(frame) == "peeked"
    assert peek_rid(b"\x92\x01") is None


# -- 3. back-pressure that never blocks the receive loop ----------------------------------------------------


async def test_a_peer_flooding_large_frames_gets_busy_and_ping_and_abort_are_served_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = asyncio.Event()
    entered = asyncio.Event()
    real_decode = DecodeWorker.decode

    async def held_decode(self: DecodeWorker, payload: bytes, limits: Any) -> Any:
        entered.set()
        await release.wait()  # the worker is stuck on this peer's first frame until the test says so
        return await real_decode(self, payload, limits)

    monkeypatch.setattr(DecodeWorker, "decode", held_decode)
    big = [
        encode(GenerateRequest(input_ids=[1000] * 6_000, rid=f"f{i}", sampling=SamplingParams(max_new_tokens=1)))
        for i in range(6)
    ]
    async with serving(offload_decode_bytes=10_000, max_offloaded_decodes=2) as server:
        with (
            raw_client(server.address) as flooder,
            raw_client(server.address) as other,
            raw_client(server.address) as third,
        ):
            await flooder.send(big[0])
            await asyncio.wait_for(entered.wait(), 60)
            for frame in big[1:]:
                await flooder.send(frame)
            busy = [await flooder.recv() for _ in range(5)]  # answered at once: nothing waits for the worker
            assert all(isinstance(b, ErrorReply) and b.code == "busy" for b in busy)
            assert sorted(b.rid for b in busy) == [f"f{i}" for i in range(1, 6)]
            # another peer is served while the flooder's frame still waits for the worker
            pong = await other.ping()
            assert isinstance(pong, Pong)
            await other.send(Abort(rid="nothing-of-mine"))  # an Abort is handled too (nothing to abort)
            async with RolloutClient(servers=[server.address]) as client:  # a normal client is served
                small = await asyncio.wait_for(client.generate([5, 6], sampling=SamplingParams(max_new_tokens=1)), 60)
            assert small.finish_reason == "length"
            assert isinstance(await other.ping(), Pong)  # after the Abort, in order
            # a second peer's large frame still gets the other decode slot; a third's gets busy (2 slots)
            await other.send(big[1])
            # frames of different peers have no order between them: the third sends once the second holds a slot
            async with asyncio.timeout(60):
                while len(server._offloaded) < 2:
                    await asyncio.sleep(0.01)
            await third.send(big[2])
            over = await third.recv()
            assert isinstance(over, ErrorReply) and (over.code, over.rid) == ("busy", "f2")
            assert not release.is_set()
            release.set()
            first = await flooder.recv()
            assert isinstance(first, GenerateResult) and first.rid == "f0"
            second = await other.recv()
            assert isinstance(second, GenerateResult) and second.rid == "f1"


async def test_a_decode_that_never_finishes_does_not_hold_the_servers_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    entered = asyncio.Event()

    async def stuck_decode(self: DecodeWorker, payload: bytes, limits: Any) -> Any:
        entered.set()
        await asyncio.Event().wait()  # the worker never answers

    monkeypatch.setattr(DecodeWorker, "decode", stuck_decode)
    server = EngineServer(FakeEngine(), ServerConfig(offload_decode_bytes=10_000))
    async with server:
        with raw_client(server.address) as raw:
            await raw.send(GenerateRequest(input_ids=[1000] * 6_000, rid="stuck"))
            await asyncio.wait_for(entered.wait(), 60)
    # left the block: aclose() returned, the decode's task cancelled instead of waited for
    assert server._offloaded == set()


# -- 5. fair share that throwaway identities do not dilute ---------------------------------------------------


async def test_identities_that_only_ping_do_not_dilute_a_real_clients_share() -> None:
    gate = asyncio.Event()
    async with serving(FakeEngine(gate=gate), max_requests=8) as server:
        throwaway = [Raw(server.address) for _ in range(40)]
        try:
            for raw in throwaway:
                await raw.ping()
            with raw_client(server.address) as real:
                for i in range(8):
                    await real.send(
                        GenerateRequest(input_ids=[5, i + 1], rid=f"r{i}", sampling=SamplingParams(max_new_tokens=1))
                    )
                await until(lambda: server.stats().in_flight == 8, "all 8 of the real client's requests are admitted")
                gate.set()
                got = {(await real.recv()).rid for _ in range(8)}
                assert got == {f"r{i}" for i in range(8)}
        finally:
            for raw in throwaway:
                raw.close()


def test_tracked_identities_are_bounded_and_those_holding_requests_are_kept() -> None:
    peers = Peers("s", max_requests=4, client_timeout_s=30.0, abort_client=lambda ident: 0, max_tracked=16)
    peers.heard(b"holder", 0.0)
    peers.admit(b"holder", 0, 0.0)
    peers.accepted(b"holder")
    for i in range(10_000):
        peers.heard(f"t{i}".encode(), float(i))
    assert peers.tracked == 16
    assert peers.holds(b"holder") and b"holder" in peers._last_seen


def test_with_authentication_the_share_is_per_credential_not_per_identity() -> None:
    from rollout_sdk.errors import ServerBusyError

    peers = Peers("s", max_requests=8, client_timeout_s=30.0, abort_client=lambda ident: 0)
    # 100 identities of one credential count as one client: together they hold at most its share
    admitted = 0
    for i in range(100):
        try:
            peers.admit(f"id{i}".encode(), admitted, 0.0, b"generate")
        except ServerBusyError:
            continue
        peers.accepted(f"id{i}".encode(), b"generate")
        admitted += 1
    assert admitted == 8 and peers.counted == 1
    # another credential arrives: the shares are 8 // 2 each; the first holds 8 and is refused more
    with pytest.raises(ServerBusyError):
        peers.admit(b"x", admitted, 0.0, b"generate")
    for i in range(8):
        peers.answered(f"id{i}".encode())
    peers.admit(b"trainer", 0, 0.0, b"control")
    assert peers.counted == 2


async def test_a_client_stops_counting_for_fair_share_soon_after_its_last_request() -> None:
    from rollout_sdk.server.peers import FAIR_WINDOW_S

    peers = Peers("s", max_requests=8, client_timeout_s=30.0, abort_client=lambda ident: 0)
    for i in range(50):
        peers.admit(f"once{i}".encode(), 0, 0.0)  # refused or not, each was a client a moment
    assert peers.counted == 50
    peers.admit(b"real", 0, FAIR_WINDOW_S + 1.0)  # later: the one-shot identities no longer count
    assert peers.counted == 1


# -- 6. poison isolation ------------------------------------------------------------------------------------


async def test_a_poison_request_kills_at_most_two_engines_and_no_innocent_fails(fake_servers) -> None:
    servers = await poisoned_fleet(fake_servers, 3)
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        sp = SamplingParams(max_new_tokens=40)
        innocents = [asyncio.ensure_future(client.generate([1, 2, 3, i], sampling=sp)) for i in range(300)]
        await until(lambda: all(s.stats().in_flight > 0 for s in servers), "innocents run on every server")
        with pytest.raises(PoisonRequestError):
            await client.generate([1, 2, 666], sampling=SamplingParams(max_new_tokens=4))
        results = await asyncio.gather(*innocents, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        dead = [s for s in servers if s.engine.dead is not None]
        assert len(dead) == 2
        assert failed == []
        assert client.scheduler.poisoned == 1
        retried = [r for r in results if isinstance(r, GenerateResult) and r.lifecycle and r.lifecycle.attempts > 1]
        assert retried  # innocents were in flight at the deaths, and were retried, not failed
        assert all(len(r.output_ids) == 40 for r in results if isinstance(r, GenerateResult))
