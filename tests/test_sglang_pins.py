"""Session pins (rollout_sdk.engines.sglang.pins) in SGLang's own radix cache, on a CPU.

Needs sglang importable (its simulated cache has no memory pools); skipped elsewhere.  Each test builds the
situation of issue 40: sessions whose turns finished are cached, some wait on a tool (pinned), and memory
pressure evicts; the question is always which tokens survive.  Both eviction paths are checked: SGLang's
own ``evict`` and the incremental one of radix_patch (the pins work through the eviction strategy).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from rollout_sdk.engines.sglang import pins, radix_patch


class _Allocator:
    device = "cpu"

    def free(self, indices: torch.Tensor) -> None:
        pass


class _Reason:
    pass


class FINISH_ABORT:  # SGLang's class name is what on_cached checks
    pass


def _req(session: str | None, rank: float, *, aborted: bool = False) -> SimpleNamespace:
    custom = {pins.KEY: [session, rank]} if session is not None else None
    return SimpleNamespace(
        sampling_params=SimpleNamespace(custom_params=custom),
        finished=lambda: True,
        finished_reason=FINISH_ABORT() if aborted else _Reason(),
    )


@pytest.fixture(params=["sglang", "incremental"])
def cache(request: pytest.FixtureRequest, tmp_path: Path) -> RadixCache:
    toggle = tmp_path / "on"
    assert radix_patch.apply(toggle=str(toggle))
    if request.param == "incremental":
        toggle.touch()
    return RadixCache.create_simulated(mock_allocator=_Allocator())


class Sim:
    """Finished requests cached the way ``cache_finished_req`` does: insert, then the session hook."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.next_value = 0

    def finish(self, ids: list[int], session: str | None = None, rank: float = 0.0, **kw: bool) -> None:
        value = torch.arange(self.next_value, self.next_value + len(ids), dtype=torch.int64)
        self.next_value += len(ids)
        result = self.cache.insert(InsertParams(key=RadixKey(token_ids=list(ids)), value=value))
        pins.on_cached(self.cache, _req(session, rank, **kw), result.last_device_node)

    def cached(self, ids: list[int]) -> int:
        return len(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=list(ids)))).device_indices)

    def evict(self, n: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted


def _ids(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(1, 30000) for _ in range(n)]


def test_a_waiting_sessions_prefix_survives_pressure_that_evicts_an_unpinned_one(cache: RadixCache) -> None:
    rnd = random.Random(0)
    sim = Sim(cache)
    waiting = _ids(rnd, 200)  # finished first (least recently used), waits on its tool: pinned
    other = _ids(rnd, 200)  # finished later, not pinned
    sim.finish(waiting, "s-wait", rank=10.0)
    sim.finish(other)
    assert sim.evict(150) >= 150  # pressure: SGLang's LRU would take `waiting` first
    assert sim.cached(waiting) == 200
    assert sim.cached(other) == 0
    assert pins.pinned_sessions(cache) == {"s-wait": 10.0}


def test_pins_arriving_after_evictions_began_keep_the_eviction_heap_consistent(cache: RadixCache) -> None:
    """The H200 run's crash: the incremental heap held SGLang's float priorities when the first pin
    arrived; the pin-aware tuples must never be compared with them."""
    rnd = random.Random(9)
    sim = Sim(cache)
    old = [_ids(rnd, 50) for _ in range(4)]
    for ids in old:
        sim.finish(ids)
    assert sim.evict(50) == 50  # the heap exists now, with SGLang's priorities
    waiting = _ids(rnd, 80)
    sim.finish(waiting, "s", rank=1.0)
    sim.finish(_ids(rnd, 30))
    assert sim.evict(180) == 180  # every unpinned leaf, without a TypeError
    assert sim.cached(waiting) == 80


def test_the_same_pressure_evicts_the_older_session_without_a_pin(cache: RadixCache) -> None:
    """The control: with no pin, SGLang's LRU evicts the session waiting on its tool."""
    rnd = random.Random(0)
    sim = Sim(cache)
    waiting, other = _ids(rnd, 200), _ids(rnd, 200)
    sim.finish(waiting)
    sim.finish(other)
    sim.evict(150)
    assert sim.cached(waiting) == 0
    assert sim.cached(other) == 200


def test_pins_are_demoted_latest_resume_first_and_never_block_eviction(cache: RadixCache) -> None:
    rnd = random.Random(1)
    sim = Sim(cache)
    soon, late = _ids(rnd, 100), _ids(rnd, 100)
    sim.finish(late, "late", rank=50.0)
    sim.finish(soon, "soon", rank=5.0)
    assert sim.evict(100) == 100  # only pinned KV left: memory pressure wins, the later resume goes
    assert sim.cached(soon) == 100 and sim.cached(late) == 0
    assert sim.evict(100) == 100  # and then the last one: a pin never makes eviction fail
    assert sim.cached(soon) == 0
    assert pins.apply_ops(cache, []) == 0  # evicted pins are forgotten


def test_a_hint_reorders_pins(cache: RadixCache) -> None:
    rnd = random.Random(2)
    sim = Sim(cache)
    a, b = _ids(rnd, 100), _ids(rnd, 100)
    sim.finish(a, "a", rank=5.0)
    sim.finish(b, "b", rank=9.0)
    pins.apply_ops(cache, [["rank", "a", 100.0]])  # a's tool will take long: a goes first now
    sim.evict(100)
    assert sim.cached(a) == 0 and sim.cached(b) == 100


def test_release_makes_a_session_an_ordinary_lru_leaf_again(cache: RadixCache) -> None:
    rnd = random.Random(3)
    sim = Sim(cache)
    ended, newer = _ids(rnd, 100), _ids(rnd, 100)
    sim.finish(newer)
    sim.finish(ended, "ended", rank=1.0)
    assert pins.apply_ops(cache, [["release", "ended"], ["release", "unknown"], ["bogus"], "x", ["rank", 3]]) == 0
    # released and more recently used than `newer`: LRU keeps it; the pin no longer does anything
    sim.evict(100)
    assert sim.cached(newer) == 0 and sim.cached(ended) == 100
    sim.evict(100)
    assert sim.cached(ended) == 0


def test_a_sessions_next_turn_moves_its_pin_and_an_abort_pins_nothing(cache: RadixCache) -> None:
    rnd = random.Random(4)
    sim = Sim(cache)
    turn1 = _ids(rnd, 100)
    sim.finish(turn1, "s", rank=1.0)
    turn2 = turn1 + _ids(rnd, 50)  # the next turn: the context grew; it finished and pinned again
    sim.finish(turn2, "s", rank=2.0)
    other = _ids(rnd, 100)
    sim.finish(other, "t", rank=3.0, aborted=True)  # a cancelled request: no pin
    assert pins.pinned_sessions(cache) == {"s": 2.0}
    sim.evict(100)
    assert sim.cached(turn2) == 150 and sim.cached(other) == 0


def test_random_workloads_never_lose_a_pinned_session_while_unpinned_tokens_remain(cache: RadixCache) -> None:
    """Property: whatever the interleaving, eviction takes every unpinned leaf before any pinned token."""
    rnd = random.Random(5)
    sim = Sim(cache)
    contexts: dict[str, list[int]] = {}
    for step in range(400):
        r = rnd.random()
        if r < 0.5:
            s = f"s{rnd.randrange(12)}"
            ctx = contexts.get(s, _ids(rnd, rnd.randrange(5, 40))) + _ids(rnd, rnd.randrange(1, 20))
            contexts[s] = ctx
            sim.finish(ctx, s, rank=float(step))
        elif r < 0.7:
            sim.finish(_ids(rnd, rnd.randrange(5, 40)))
        elif r < 0.8 and contexts:
            s = rnd.choice(sorted(contexts))
            pins.apply_ops(cache, [["release", s]])
            contexts.pop(s)
        else:
            sim.evict(rnd.randrange(1, 60))
            live = pins.pinned_sessions(cache)
            unpinned_leaves = [
                n for n in cache.evictable_leaves if not n.__dict__.get("_rsdk_pins")
            ]  # every pinned session fully cached unless no unpinned leaf was left
            for s in live:
                if unpinned_leaves:
                    assert sim.cached(contexts[s]) == len(contexts[s]), (step, s)
