"""The incremental radix-cache eviction (rollout_sdk.engines.sglang.radix_patch) against SGLang's own.

Needs sglang importable (CPU is enough: SGLang's simulated cache has no memory pools); skipped elsewhere.
Two simulated caches get the same random workload -- inserts sharing prefixes, prefix matches (which move
access times), locks held and released like running requests, evictions of random sizes -- one evicting
the SGLang way, one the patched way; every eviction must free the same tokens, and the trees must stay
identical.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from rollout_sdk.engines.sglang import radix_patch


class _Allocator:
    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, indices: torch.Tensor) -> None:
        self.freed.extend(int(i) for i in indices)


def _tree(cache: RadixCache) -> list[tuple[tuple[int, ...], int]]:
    out, stack = [], [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            key = (*prefix, *child.key.token_ids)
            out.append((key, child.lock_ref))
            stack.append((child, key))
    return sorted(out)


@pytest.fixture
def toggle(tmp_path: Path) -> Path:
    path = tmp_path / "patched"
    assert radix_patch.apply(toggle=str(path))
    return path


@pytest.mark.parametrize("seed", range(6))
def test_patched_eviction_frees_what_sglangs_frees(toggle: Path, seed: int) -> None:
    rnd = random.Random(seed)
    caches = [RadixCache.create_simulated(mock_allocator=_Allocator()) for _ in range(2)]
    prefixes = [[rnd.randrange(1, 50) for _ in range(rnd.randrange(1, 6))] for _ in range(8)]
    locked: list[list] = [[], []]
    seq = 0

    def both(op, *args) -> list:
        """Run ``op`` on the SGLang-evicting cache (toggle file absent), then on the patched one."""
        out = []
        for i, cache in enumerate(caches):
            if i == 1:
                toggle.touch()
            try:
                out.append(op(i, cache, *args))
            finally:
                toggle.unlink(missing_ok=True)
        return out

    for _ in range(600):
        r = rnd.random()
        if r < 0.45:
            ids = rnd.choice(prefixes) + [rnd.randrange(1, 50) for _ in range(rnd.randrange(1, 12))]
            value = torch.arange(seq, seq + len(ids), dtype=torch.int64)
            seq += len(ids)
            both(lambda i, c, k=ids, v=value: c.insert(InsertParams(key=RadixKey(token_ids=list(k)), value=v)))
        elif r < 0.65:
            ids = rnd.choice(prefixes) + [rnd.randrange(1, 50) for _ in range(rnd.randrange(0, 4))]

            def match(i, c, k=ids, hold=rnd.random() < 0.5):
                node = c.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=list(k)))).last_device_node
                if hold and node is not c.root_node:
                    c.inc_lock_ref(node)
                    locked[i].append(node)

            both(match)
        elif r < 0.75 and locked[0]:
            j = rnd.randrange(len(locked[0]))
            both(lambda i, c, j=j: c.dec_lock_ref(locked[i].pop(j)))
        else:
            n = rnd.randrange(1, 40)
            evicted = both(lambda i, c, n=n: c.evict(EvictParams(num_tokens=n)).num_tokens_evicted)
            assert evicted[0] == evicted[1]
            assert caches[0].token_to_kv_pool_allocator.freed == caches[1].token_to_kv_pool_allocator.freed
        assert caches[0].evictable_size() == caches[1].evictable_size()
    assert _tree(caches[0]) == _tree(caches[1])
    assert caches[1].token_to_kv_pool_allocator.freed  # the workload did evict


def test_patched_eviction_cost_does_not_grow_with_the_leaves(toggle: Path) -> None:
    """Counted, not timed: how many heap entries one eviction touches with 200 vs 20,000 cached leaves."""
    toggle.touch()
    touched = []
    for leaves in (200, 20_000):
        cache = RadixCache.create_simulated(mock_allocator=_Allocator())
        rnd = random.Random(leaves)
        for k in range(leaves):
            ids = [rnd.randrange(1, 150_000) for _ in range(8)]
            cache.insert(InsertParams(key=RadixKey(token_ids=ids), value=torch.arange(8 * k, 8 * k + 8)))
        cache.evict(EvictParams(num_tokens=8))  # builds the heap once
        before = len(cache._rsdk_heap)
        cache.evict(EvictParams(num_tokens=64))
        touched.append(before - len(cache._rsdk_heap))
    assert touched == [8, 8]  # 64 tokens = 8 leaves of 8, whatever the size of the cache


def test_the_plugin_patches_sglangs_scheduler_for_in_place_updates(toggle: Path) -> None:
    """The same plugin that fixes eviction gives SGLang 0.5.16's real ``Scheduler`` the in-place hooks
    (engines/sglang/inplace.py): what it wraps exists there and is wrapped, once."""
    from sglang.srt.managers.scheduler import Scheduler

    from rollout_sdk.engines.sglang import inplace

    assert Scheduler.__dict__.get("_rollout_sdk_inplace") is True
    for name in ("pause_generation", "process_batch_result", "get_internal_state"):
        assert getattr(Scheduler, name).__module__ == inplace.__name__, name
    assert inplace.apply(Scheduler)  # idempotent: wrapped once
    assert Scheduler.pause_generation.__module__ == inplace.__name__
