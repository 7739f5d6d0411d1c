"""An agent's KV kept through its tool waits (issue 40): the wire fields, the session book, the engines.

The mechanism in SGLang's own radix cache is tested in tests/test_sglang_pins.py (needs sglang); here the
fake engine's modelled pool (engines/fake.py) stands in for it behind real servers and a real client on
loopback.  No test depends on timing: engines step on their own, and every wait is on a condition.
"""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngineConfig
from rollout_sdk.engines.sessions import SessionBook
from rollout_sdk.errors import ConfigError, InvalidRequestError, ProtocolError
from rollout_sdk.protocol import MAX_KEEP_KV_S, SessionHint, SessionHints, decode_client_message, encode
from test_scheduler import until  # a condition polled to a deadline, never a sleep-then-assert

HANG_GUARD_S = 120.0


# -- the wire --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, MAX_KEEP_KV_S + 1])
def test_keep_kv_s_out_of_range_is_refused_naming_the_field(bad: float) -> None:
    with pytest.raises(InvalidRequestError, match="keep_kv_s"):
        GenerateRequest(input_ids=[1, 2], session_id="s", keep_kv_s=bad)


def test_keep_kv_s_needs_a_session() -> None:
    with pytest.raises(InvalidRequestError, match=r"keep_kv_s.*session_id"):
        GenerateRequest(input_ids=[1, 2], keep_kv_s=30.0)


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"session_id": ""}, "session_id"), ({"session_id": "x" * 300}, "session_id"), ({"wait_s": -1.0}, "wait_s")],
)
def test_bad_session_hints_are_refused_naming_the_field(kw: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SessionHint(**{"session_id": "s", **kw})


def test_a_hint_list_past_its_bound_is_refused_while_decoding() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "session_hints", "call_id": "c", "hints": [{"session_id": "s"}] * 5000}
    )  # the encoder does not check bounds; the decoder must, naming the field
    with pytest.raises(InvalidRequestError, match="hints"):
        decode_client_message(frame)


def test_hints_and_keep_round_trip_on_the_wire() -> None:
    msg = SessionHints("c1", [SessionHint(session_id="a", wait_s=2.5), SessionHint(session_id="b", ended=True)])
    assert decode_client_message(encode(msg)) == msg
    req = GenerateRequest(input_ids=[5, 6], session_id="a", keep_kv_s=12.0)
    assert decode_client_message(encode(req)) == req


@settings(max_examples=200, deadline=None)
@given(
    keep=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-(2**63), 2**63), st.text(max_size=3)),
    wait=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-(2**63), 2**63)),
)
def test_any_keep_or_wait_value_decodes_or_is_a_typed_error(keep: object, wait: object) -> None:
    """Whatever a peer puts in these fields, the server gets a valid message or a typed error (never a crash
    or a value out of range)."""
    frames = [
        msgspec.msgpack.encode({"type": "generate", "input_ids": [1], "session_id": "s", "keep_kv_s": keep}),
        msgspec.msgpack.encode(
            {"type": "session_hints", "call_id": "c", "hints": [{"session_id": "s", "wait_s": wait}]}
        ),
    ]
    for frame in frames:
        try:
            msg = decode_client_message(frame)
        except (InvalidRequestError, ProtocolError):
            continue
        if isinstance(msg, GenerateRequest) and msg.keep_kv_s is not None:
            assert 0 < msg.keep_kv_s <= MAX_KEEP_KV_S
        if isinstance(msg, SessionHints) and msg.hints[0].wait_s is not None:
            assert 0 <= msg.hints[0].wait_s <= MAX_KEEP_KV_S


# -- the session book (engines/sessions.py) ----------------------------------------------------------------


async def test_admission_holds_a_new_session_until_a_kept_one_ends() -> None:
    released: list[str] = []
    book = SessionBook(release=released.extend, budget_tokens=1000)
    await book.enter("a", 600)
    book.leave("a", keep_s=60.0, tokens=700, ok=True)  # a waits on its tool, keeping 700 tokens
    waiter = asyncio.create_task(book.enter("b", 600))
    await until(lambda: book.waiting == 1, "b waits for room")
    await book.enter("a", 800)  # an admitted session's next turn never waits
    book.leave("a", keep_s=60.0, tokens=800, ok=True)
    assert not waiter.done() and book.waited == 1
    book.hints([SessionHint(session_id="a", ended=True)])
    await asyncio.wait_for(waiter, HANG_GUARD_S)
    assert released == ["a"] and book.holds("b") and not book.holds("a")
    book.close()


async def test_a_session_larger_than_the_budget_still_runs_alone() -> None:
    book = SessionBook(release=lambda s: None, budget_tokens=100)
    await asyncio.wait_for(book.enter("big", 5000), HANG_GUARD_S)
    assert book.holds("big")


async def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_turn_releases_its_session() -> None:
    released: list[str] = []
    book = SessionBook(release=released.extend, budget_tokens=100)
    await book.enter("a", 90)
    waiter = asyncio.create_task(book.enter("b", 90))
    await until(lambda: book.waiting == 1, "b waits")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert book.waiting == 0 and not book.holds("b")
    book.leave("a", keep_s=60.0, tokens=95, ok=False)  # the turn was cancelled: nothing kept
    assert released == ["a"] and book.kept == 0


async def test_a_lease_runs_out_when_no_turn_follows() -> None:
    released: list[str] = []
    book = SessionBook(release=released.extend)
    await book.enter("gone", 10)
    book.leave("gone", keep_s=0.01, tokens=20, ok=True)  # the client went away: no hint, no next turn
    await until(lambda: released == ["gone"], "the lease ended")
    assert book.expired == 1 and book.kept == 0


async def test_admission_counts_sessions_at_what_ended_sessions_grew_to() -> None:
    book = SessionBook(release=lambda s: None, budget_tokens=1000)
    await book.enter("first", 100)
    book.leave("first", keep_s=60.0, tokens=400, ok=True)  # grew 4x over its turns
    book.hints([SessionHint(session_id="first", ended=True)])
    assert book.growth > 1.5
    await book.enter("x", 100)
    waiter = asyncio.create_task(book.enter("y", 600))  # as they are they fit (700); grown (160 + 960) not
    await until(lambda: book.waiting == 1, "y waits: x will grow")
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


def test_engine_configs_refuse_bad_session_settings() -> None:
    from rollout_sdk.engines.sglang import SglangEngineConfig

    for bad in (0, -0.5, 5.0, True, "0.9"):
        with pytest.raises(ConfigError, match="session_admission"):
            SglangEngineConfig(model_path="m", session_admission=bad)  # type: ignore[arg-type]
    for bad in (1.0, 0.5, 100, True):
        with pytest.raises(ConfigError, match="host_kv_ratio"):
            SglangEngineConfig(model_path="m", host_kv_ratio=bad)  # type: ignore[arg-type]
    args = SglangEngineConfig(model_path="m", host_kv_ratio=3).server_args()
    assert args["enable_hierarchical_cache"] is True and args["hicache_ratio"] == 3.0


# -- the fake engine's modelled pool behind a real server and client --------------------------------------

P = 200  # first prompt
NEW = 20  # tokens per turn


def _pool(capacity: int, **kw: object) -> FakeEngineConfig:
    return FakeEngineConfig(step_base_s=0.001, max_batch=64, prefix_cache=True, kv_capacity_tokens=capacity, **kw)


async def _turn(client: RolloutClient, sid: str, ids: list[int], keep: float | None) -> list[int]:
    r = await client.generate(
        GenerateRequest(
            input_ids=ids, session_id=sid, keep_kv_s=keep, sampling=SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        )
    )
    return r


async def test_a_waiting_sessions_prefix_survives_pressure_that_evicts_an_unpinned_one(fake_servers) -> None:
    (server,) = await fake_servers(1, _pool(capacity=3 * (P + NEW)))
    eng = server.engine
    kept = [10_000 + i for i in range(P)]
    plain = [20_000 + i for i in range(P)]
    async with RolloutClient(servers=[server.address]) as client:
        k1 = await _turn(client, "kept", kept, keep=60.0)  # waits on its tool, its KV pinned
        p1 = await _turn(client, "plain", plain, keep=None)  # more recently used, not pinned
        assert eng.pinned_sessions == ["kept"]
        # pressure: another session's long turn needs most of the pool; LRU alone would evict "kept" first
        await _turn(client, "other", [30_000 + i for i in range(2 * P)], keep=None)
        assert eng.session_cached("kept") == P + NEW - 1 and eng.session_cached("plain") == 0
        # the next turns: "kept" takes its whole context from the cache, "plain" computes it again
        k2 = await _turn(client, "kept", [*kept, *k1.output_ids, 7, 8, 9], keep=60.0)
        p2 = await _turn(client, "plain", [*plain, *p1.output_ids, 7, 8, 9], keep=None)
        assert k2.cached_tokens == P + NEW - 1
        assert p2.cached_tokens == 0
        await client.session_hints([SessionHint(session_id="kept", ended=True)])
        await until(lambda: not eng.sessions.holds("kept"), "the ended session was released")
        assert eng.pinned_sessions == []


async def test_hints_reach_the_server_holding_the_session_only(fake_servers) -> None:
    servers = await fake_servers(2, _pool(capacity=100_000))
    async with RolloutClient(servers=[s.address for s in servers]) as client:
        for i in range(6):
            await _turn(client, f"s{i}", [40_000 + 100 * i + j for j in range(P)], keep=60.0)
        holders = {f"s{i}": [s.engine.sessions.holds(f"s{i}") for s in servers] for i in range(6)}
        assert all(sum(h) == 1 for h in holders.values())  # each session kept on exactly one engine
        await client.session_hints([SessionHint(session_id=f"s{i}", ended=True) for i in range(6)])
        await until(lambda: all(s.engine.sessions.kept == 0 for s in servers), "every session released")
        await client.session_hints([SessionHint(session_id="never-placed", ended=True)])  # ignored
        with pytest.raises(InvalidRequestError, match="hints"):
            await client.session_hints([{"session_id": "s0"}])  # type: ignore[list-item]


async def test_session_admission_on_the_engine_keeps_re_prefill_low_under_a_small_pool(fake_servers) -> None:
    """Eight sessions of three turns whose working set is twice the pool: admitted all at once they evict
    each other's contexts; admitted by the pool, every resumed turn finds its context."""

    async def run(config: FakeEngineConfig) -> float:
        (server,) = await fake_servers(1, config)
        # what a job's earlier sessions taught the book (a session grows ~1.2x over three turns here): with it
        # the admitted working set fits the pool whatever the interleaving, so the result is deterministic
        server.engine.sessions.growth = 1.3
        ids0 = {f"a{i}": [50_000 + 1000 * i + j for j in range(P)] for i in range(8)}
        fractions: list[float] = []
        async with RolloutClient(servers=[server.address]) as client:

            async def session(sid: str) -> None:
                ids = ids0[sid]
                for t in range(3):
                    r = await _turn(client, sid, ids, keep=60.0)
                    if t:
                        fractions.append((r.prompt_tokens - r.cached_tokens) / r.prompt_tokens)
                    ids = [*ids, *r.output_ids, 1, 2, 3]
                await client.session_hints([SessionHint(session_id=sid, ended=True)])

            await asyncio.gather(*(session(s) for s in ids0))
        return sum(fractions) / len(fractions)

    working_set = 8 * (P + 3 * (NEW + 3))
    thrash = await run(_pool(capacity=working_set // 2))
    admitted = await run(_pool(capacity=working_set // 2, session_admission=0.9))
    assert admitted <= 0.05 < thrash
