"""The CPU engine's prefix cache (engines/cpu/prefix_cache.py, issues 40 and 41).

The cache alone on fake tensors (longest prefix against a brute force, LRU, pins, namespaces), then on the
real tiny model: a hit computes only the uncached suffix and decodes exactly as a cold run; a lookup never
crosses namespaces (``shared_prefix_pair``, reusable for the weight-version tests of issue 41); an agent
session kept with ``keep_kv_s`` keeps its context through pressure that evicts an unpinned session's.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig
from rollout_sdk.engines.cpu.prefix_cache import BLOCK_TOKENS, PrefixCache
from rollout_sdk.errors import ConfigError
from rollout_sdk.protocol import GenerateRequest, GenerateResult, SamplingParams, SessionHint

# -- the cache alone ----------------------------------------------------------------------------------


def _kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of [1, 1, n, 1] K/V whose values are the tokens (so a slice says which tokens it holds)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t.clone(), -t.clone()), (t + 0.5, t - 0.5)]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=3 * BLOCK_TOKENS + 5)


@settings(max_examples=150, deadline=None)
@given(
    entries=st.lists(st.tuples(st.sampled_from(["", "w1"]), _tokens), min_size=1, max_size=12),
    queries=st.lists(st.tuples(st.sampled_from(["", "w1", "w2"]), _tokens), min_size=1, max_size=8),
)
def test_lookup_is_the_longest_cached_prefix_in_its_namespace(
    entries: list[tuple[str, list[int]]], queries: list[tuple[str, list[int]]]
) -> None:
    """Against a brute force over every entry: the longest common prefix with an entry of the same
    namespace, of all but the query's last token, and the KV of exactly those tokens."""
    cache = PrefixCache(10_000)
    for ns, toks in entries:
        assert cache.insert(ns, toks, _kv(toks))
    for ns, q in queries:
        want = max([_common(toks, q[:-1]) for e_ns, toks in entries if e_ns == ns], default=0)
        hit = cache.lookup(ns, q)
        if want == 0:
            assert hit is None
            continue
        assert hit is not None
        assert hit.num_tokens == want
        k0, v0 = hit.kv[0]
        assert k0.flatten().tolist() == [float(t) for t in q[:want]]
        assert v0.flatten().tolist() == [-float(t) for t in q[:want]]
        assert hit.kv[1][0].shape == (1, 1, want, 1)


def test_lru_evicts_the_least_recently_used_entry() -> None:
    cache = PrefixCache(100)
    a, b, c = ([i] * 40 for i in (1, 2, 3))
    for t in (a, b):
        cache.insert("", t, _kv(t))
    assert cache.lookup("", [*a, 9]) is not None  # a is now the most recently used
    cache.insert("", c, _kv(c))
    assert cache.num_tokens == 80 and cache.evictions == 1
    assert cache.cached("", b) == 0
    assert cache.cached("", a) == 40 and cache.cached("", c) == 40


def test_pins_go_last_and_by_latest_expected_resume() -> None:
    cache = PrefixCache(120)
    s1, s2, x, y = ([i] * 40 for i in (1, 2, 3, 4))
    cache.keep("s1", 10.0)
    cache.keep("s2", 20.0)
    cache.insert("", s1, _kv(s1), session="s1")
    cache.insert("", s2, _kv(s2), session="s2")
    assert cache.pinned_sessions == ["s1", "s2"]
    # unpinned work passes through the room the pins leave, least recently used first ...
    assert cache.insert("", x, _kv(x))
    assert cache.insert("", y, _kv(y))
    assert cache.cached("", x) == 0 and cache.cached("", y) == 40
    # ... and an unpinned entry that fits only by evicting a pin is not kept
    wide = [6] * 41
    assert not cache.insert("", wide, _kv(wide))
    assert cache.cached("", y) == 0 and cache.cached("", s1) == 40 and cache.cached("", s2) == 40
    # a third pin that does not fit evicts the pin expected back latest (s2, until a hint moves s1 past it)
    cache.rerank("s1", 30.0)
    cache.keep("s3", 5.0)
    s3 = [7] * 41
    assert cache.insert("", s3, _kv(s3), session="s3")
    assert cache.pinned_sessions == ["s2", "s3"]
    # released: the first to go, before older unpinned entries
    z = [5] * 30
    assert cache.insert("", z, _kv(z))
    cache.release(["s3"])
    assert cache.pinned_sessions == ["s2"]
    u = [8] * 35
    assert cache.insert("", u, _kv(u))
    assert cache.cached("", s3) == 0 and cache.cached("", z) == 30 and cache.cached("", u) == 35


def test_a_session_turn_supersedes_its_previous_context() -> None:
    cache = PrefixCache(1000)
    cache.keep("s", 1.0)
    turn1 = list(range(30))
    cache.insert("", turn1, _kv(turn1), session="s")
    hit = cache.lookup("", [*turn1, 99, 100])
    assert hit is not None and hit.num_tokens == 30
    turn2 = [*turn1, 99, 100, 101]
    cache.insert("", turn2, _kv(turn2), session="s", replaces=hit.entry_id)
    assert cache.num_entries == 1 and cache.num_tokens == 33 and cache.pinned_sessions == ["s"]


def test_off_and_bad_capacity() -> None:
    off = PrefixCache(0)
    assert not off.insert("", [1, 2, 3], _kv([1, 2, 3]))
    assert off.lookup("", [1, 2, 3, 4]) is None
    big = PrefixCache(10)
    assert not big.insert("", list(range(11)), _kv(list(range(11))))  # larger than the cache
    for bad in (-1, "many", 1.5):
        with pytest.raises(ConfigError, match="prefix_cache_tokens"):
            CpuEngineConfig(prefix_cache_tokens=bad)  # type: ignore[arg-type]
    assert CpuEngineConfig(prefix_cache_tokens=None).prefix_cache_tokens is None


# -- on the tiny model --------------------------------------------------------------------------------

pytestmark_engine = pytest.mark.asyncio(loop_scope="module")
SAMPLING = {"temperature": 0, "presence_penalty": 2.0}  # greedy, spread (a random model repeats one token)
CAP = 320


def _prompts(n: int, seed: int, length: int = 40) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(100, 150000) for _ in range(length)] for _ in range(n)]


def _req(ids: list[int], rid: str, max_new_tokens: int = 8, **kw: object) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=max_new_tokens, **SAMPLING)  # type: ignore[arg-type]
    return GenerateRequest(input_ids=ids, rid=rid, sampling=sp, return_logprobs=True, **kw)  # type: ignore[arg-type]


async def settled(engine: CpuEngine) -> None:
    """Until the worker has dropped every finished row (and so cached it): a condition, not a sleep."""
    while engine._runner.batch.num_rows or engine.load().running:
        await asyncio.sleep(0.005)


async def shared_prefix_pair(
    engine: CpuEngine, between: Callable[[], Awaitable[object]], *, seed: int = 0, rid: str = "pair"
) -> tuple[GenerateResult, GenerateResult]:
    """Two requests sharing a prefix, ``between()`` awaited between them (a namespace switch, a weight
    update): the first's result and the second's.  With nothing between, the second takes the first's
    context (prompt and output but its last token) from the cache; after a switch of namespace, nothing."""
    prompt = _prompts(1, seed)[0]
    first = await engine.generate(_req(prompt, f"{rid}-1"))
    await settled(engine)
    await between()
    second = await engine.generate(_req([*prompt, *first.output_ids, 7, 8], f"{rid}-2"))
    return first, second


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[CpuEngine]:
    e = CpuEngine(CpuEngineConfig(model_path=str(tiny_model), prefix_cache_tokens=CAP))
    await e.start()
    yield e
    await e.close()


@pytestmark_engine
async def test_a_hit_computes_the_suffix_and_decodes_as_a_cold_run(engine: CpuEngine) -> None:
    await engine.flush_cache()
    x, y, z, w = _prompts(4, seed=1)
    rx, ry = await asyncio.gather(engine.generate(_req(x, "x")), engine.generate(_req(y, "y")))
    assert rx.cached_tokens == ry.cached_tokens == 0
    x2 = [*x, *rx.output_ids, 11, 12]
    y2 = [*y[:37], 13, 14, 15]  # a prefix ending inside a block
    # hits prefilled alone, misses batched, all in one step
    hot = await asyncio.gather(*(engine.generate(_req(p, f"hot{i}")) for i, p in enumerate((x2, y2, z, w))))
    assert [r.cached_tokens for r in hot] == [len(x) + len(rx.output_ids) - 1, 37, 0, 0]
    await settled(engine)
    await engine.flush_cache()
    cold = await asyncio.gather(*(engine.generate(_req(p, f"cold{i}")) for i, p in enumerate((x2, y2))))
    assert [r.cached_tokens for r in cold] == [0, 0]
    for h, c in zip(hot, cold, strict=False):
        assert h.output_ids == c.output_ids
        assert h.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    cache = engine._runner.prefix_cache
    assert cache.num_tokens <= CAP


@pytestmark_engine
async def test_a_lookup_never_crosses_namespaces(engine: CpuEngine) -> None:
    """The namespace is the weight version a row is prefilled on (issue 41): a new version, no flush."""
    await engine.flush_cache()

    async def nothing() -> None:
        return None

    first, second = await shared_prefix_pair(engine, nothing, seed=2, rid="same")
    assert second.cached_tokens == first.prompt_tokens + len(first.output_ids) - 1

    async def switch() -> None:
        await engine.set_weight_version(engine.weight_version + 1)

    first, second = await shared_prefix_pair(engine, switch, seed=3, rid="switched")
    assert second.cached_tokens == 0
    third = await engine.generate(_req([*_prompts(1, 3)[0], *first.output_ids, 7, 8, 9], "again"))
    assert third.cached_tokens == second.prompt_tokens  # its own namespace's entry: the second's


@pytestmark_engine
async def test_a_weight_update_serves_no_stale_kv(engine: CpuEngine) -> None:
    await engine.flush_cache()
    named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()][:1]

    async def update() -> None:
        await engine.update_weights(named)

    _, second = await shared_prefix_pair(engine, update, seed=4, rid="upd")
    assert second.cached_tokens == 0


@pytestmark_engine
async def test_a_waiting_sessions_prefix_survives_pressure_that_evicts_an_unpinned_one(engine: CpuEngine) -> None:
    """Issue 40: session A's turn ended with ``keep_kv_s`` (it waits on a tool), session B's without;
    other requests then overflow the cache many times.  B's context is evicted, A's is kept: A's next
    turn takes its whole prior context but one token from the cache, B's takes nothing.  Once A's end is
    hinted, the same pressure evicts it too."""
    await engine.flush_cache()
    cache = engine._runner.prefix_cache
    pa, pb = _prompts(2, seed=5)
    a1 = await engine.generate(_req(pa, "a1", session_id="A", keep_kv_s=600.0))
    b1 = await engine.generate(_req(pb, "b1", session_id="B"))
    await settled(engine)
    assert cache.pinned_sessions == ["A"]

    async def pressure(tag: str, seed: int) -> None:
        fillers = _prompts(2 * CAP // 40, seed=seed)
        for i, p in enumerate(fillers):  # one after another: each finished row is cached, evicting
            r = await engine.generate(_req(p, f"{tag}{i}"))
            assert r.finish_reason == "length"  # pins never hold up a running request
        await settled(engine)

    evicted = cache.evictions
    await pressure("fill", 50)
    assert cache.evictions - evicted >= 10  # 17 unpinned entries of 47 tokens through 320 - 47 of room
    assert cache.pinned_sessions == ["A"]
    a_ctx = [*pa, *a1.output_ids]
    b_ctx = [*pb, *b1.output_ids]
    assert cache.cached(engine._runner.cache_ns, a_ctx) == len(a_ctx) - 1
    assert cache.cached(engine._runner.cache_ns, b_ctx) == 0

    tool = [21, 22, 23]
    a2 = await engine.generate(_req([*a_ctx, *tool], "a2", session_id="A", keep_kv_s=600.0))
    b2 = await engine.generate(_req([*b_ctx, *tool], "b2", session_id="B"))
    assert a2.cached_tokens == len(a_ctx) - 1
    assert b2.cached_tokens == 0
    await settled(engine)
    assert cache.pinned_sessions == ["A"]  # the pin moved to A's latest context

    engine.session_hints([SessionHint(session_id="A", ended=True)])
    assert cache.pinned_sessions == []
    await pressure("after", 51)
    a_ctx2 = [*a_ctx, *tool, *a2.output_ids]
    a3 = await engine.generate(_req([*a_ctx2, *tool], "a3", session_id="A"))
    assert a3.cached_tokens == 0


@pytestmark_engine
async def test_an_aborted_turn_releases_its_session(engine: CpuEngine) -> None:
    await engine.flush_cache()
    cache = engine._runner.prefix_cache
    (p,) = _prompts(1, seed=6)
    await engine.generate(_req(p, "k1", session_id="K", keep_kv_s=600.0))
    await settled(engine)
    assert cache.pinned_sessions == ["K"]
    engine.abort("nothing")  # unknown: ignored
    task = asyncio.create_task(engine.generate(_req([*p, 1, 2], "k2", 10_000, session_id="K", keep_kv_s=600.0)))
    while not engine.load().running:
        await asyncio.sleep(0.005)
    engine.abort("k2")
    r = await task
    assert r.finish_reason == "abort"
    await settled(engine)
    assert cache.pinned_sessions == []
    assert not engine.sessions.holds("K")
