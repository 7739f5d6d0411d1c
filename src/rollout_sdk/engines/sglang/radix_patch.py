"""Incremental eviction for SGLang's radix cache: the fix for the long-run stall (issue #30, docs/benchmarks.md).

The trap (sglang 0.5.16, ``srt/mem_cache/radix_cache.py``): ``RadixCache.evict`` builds a heap of *every*
evictable leaf on each call, ``[(priority(node), node) for node in self.evictable_leaves]`` + ``heapify``.
Once the KV pool is full of finished requests the scheduler calls it on every decode step that needs slots,
so each step pays O(leaves) of Python while the GPU waits.  A few passes of many short requests leave tens
of thousands of leaves; a following pass of 1,024 long requests then decodes several times slower
(``bench/sglang_radix_evict.py`` reproduces it without rollout-sdk or a GPU).

The fix keeps a heap of the evictable leaves up to date as the tree changes instead of rebuilding it:

* every time SGLang re-evaluates a node (``_update_leaf_status``, the one place that adds nodes to
  ``evictable_leaves``) and the node is an evictable leaf, ``(priority, seq, node)`` is pushed;
* ``evict`` pops: an entry whose node is no longer an evictable leaf is dropped; one whose priority changed
  since it was pushed (a cache hit moved its ``last_access_time``) is pushed again with the new one;
  otherwise the leaf is evicted exactly as SGLang does (free its slots, delete it, record the event);
* the heap is rebuilt from ``evictable_leaves`` when stale entries outnumber live ones (amortised O(1)).

So each call costs O((evicted + stale) log n) instead of O(n log n), and the victims are the same leaves in
the same order as SGLang's (lowest priority first: LRU by default); ``tests/test_sglang_radix_patch.py``
checks that against SGLang's own ``evict`` on random workloads.

How it gets into SGLang's processes: SGLang loads the general plugins named by the ``sglang.srt.plugins``
entry point group in every process it starts (``sglang.srt.plugins.load_plugins``); rollout-sdk's entry
point is :func:`plugin`, which patches only when ``ROLLOUT_SDK_SGLANG_RADIX_PATCH`` is set, and
:class:`~rollout_sdk.engines.sglang.SglangEngine` sets it (``SglangEngineConfig.incremental_eviction``) for
the processes of the engines it starts.  Plain SGLang use in the same environment is untouched.  The patch
checks that the class has what it relies on and otherwise leaves SGLang as it is (a warning, once).

For benchmarks only, ``ROLLOUT_SDK_SGLANG_RADIX_PATCH=toggle:<path>`` keeps the heap but uses SGLang's
own ``evict`` while ``<path>`` does not exist, so one engine start can show the stall and the fix.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import time
from typing import Any

from . import inplace, pins

__all__ = ["ENV", "apply", "plugin"]

log = logging.getLogger("rollout_sdk.engines.sglang")

#: the environment variable that turns the patch on in SGLang's processes ("1", or "toggle:<path>")
ENV = "ROLLOUT_SDK_SGLANG_RADIX_PATCH"
_NEEDS = ("evict", "_update_leaf_status", "_delete_leaf", "reset", "_record_remove_event", "update_eviction_metrics")
_applied = False
_toggle: str | None = None  # benchmarks only: SGLang's own evict while this path does not exist


def plugin() -> None:
    """SGLang's general-plugin entry point (``sglang.srt.plugins``): patch when rollout-sdk asked for it."""
    value = os.environ.get(ENV, "")
    if value:
        apply(toggle=value[len("toggle:") :] if value.startswith("toggle:") else None)


def apply(*, toggle: str | None = None) -> bool:
    """Patch ``sglang.srt.mem_cache.radix_cache.RadixCache`` in this process (idempotent).  Returns whether
    the patch is in place.  ``toggle``: benchmarks only (see the module docstring); a later call sets it anew."""
    global _applied, _toggle
    _toggle = toggle
    if _applied:
        return True
    from sglang.srt.mem_cache.radix_cache import RadixCache  # optional: sglang

    _apply_pins(RadixCache)
    _apply_inplace()
    missing = [name for name in _NEEDS if not hasattr(RadixCache, name)]
    if missing:
        log.warning("not patching SGLang's radix cache eviction: RadixCache lacks %s", ", ".join(missing))
        return False
    original_evict = RadixCache.evict
    original_update = RadixCache._update_leaf_status
    original_reset = RadixCache.reset
    seq = itertools.count()

    def _heap(self: Any) -> list[tuple[Any, int, Any]]:
        heap: list[tuple[Any, int, Any]] | None = self.__dict__.get("_rsdk_heap")
        if heap is None:
            heap = self._rsdk_heap = []
            for node in self.evictable_leaves:  # leaves made before the patch (none in a fresh cache)
                heap.append((self.eviction_strategy.get_priority(node), next(seq), node))
            heapq.heapify(heap)
        return heap

    def _update_leaf_status(self: Any, node: Any) -> None:
        original_update(self, node)
        if node in self.evictable_leaves and "_rsdk_heap" in self.__dict__:
            heapq.heappush(self._rsdk_heap, (self.eviction_strategy.get_priority(node), next(seq), node))

    def reset(self: Any) -> None:
        original_reset(self)
        self.__dict__.pop("_rsdk_heap", None)

    def evict(self: Any, params: Any) -> Any:
        if self.disable or type(self)._update_leaf_status is not _update_leaf_status:
            return original_evict(self, params)  # a subclass with its own leaf bookkeeping: SGLang's way
        if _toggle is not None and not os.path.exists(_toggle):
            _heap(self)  # keep it up to date, so switching on mid-run is exact
            return original_evict(self, params)
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult  # optional: sglang

        start_time = time.perf_counter()
        heap = _heap(self)
        live = self.evictable_leaves
        priority = self.eviction_strategy.get_priority
        num_tokens = params.num_tokens
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            prio, _, x = heapq.heappop(heap)
            if x not in live:
                continue  # stale: locked, evicted, or no longer a leaf since it was pushed
            now = priority(x)
            if now != prio:
                heapq.heappush(heap, (now, next(seq), x))  # touched since: back in at its new place
                continue
            self.token_to_kv_pool_allocator.free(x.value)
            num_evicted += len(x.value)
            self._delete_leaf(x)  # re-evaluates the parent: pushed by _update_leaf_status if now a leaf
            self._record_remove_event(x)
        if len(heap) > 2 * len(live) + 4096:  # mostly stale entries: rebuild (amortised by the pushes)
            self.__dict__.pop("_rsdk_heap", None)
            _heap(self)
        self.update_eviction_metrics(num_evicted, start_time)
        return EvictResult(num_tokens_evicted=num_evicted)

    RadixCache._update_leaf_status = _update_leaf_status
    RadixCache.reset = reset
    RadixCache.evict = evict
    _applied = True
    log.info("SGLang radix cache: incremental eviction in process %d%s", os.getpid(), " (toggle)" if _toggle else "")
    return True


def _apply_inplace() -> None:
    """In-place weight updates with exact split points (:mod:`.inplace`): patches SGLang's scheduler."""
    try:
        from sglang.srt.managers.scheduler import Scheduler  # optional: sglang
    except Exception as exc:  # an SGLang without the scheduler module we know
        log.warning("no in-place weight updates: %s", exc)
        return

    inplace.apply(Scheduler)


_pins_applied = False


def _apply_pins(radix_cache: Any) -> None:
    """Session pins (:mod:`.pins`): a finished request that asked pins its session at the node SGLang cached
    it at (``_tag_session_leaf``, called with that node), and the scheduler answers the server's batched
    RPC ``rollout_sdk_sessions(ops)``.  Missing hooks: a warning, no pins (SGLang as it is)."""
    global _pins_applied
    if _pins_applied:
        return

    original_tag = getattr(radix_cache, "_tag_session_leaf", None)
    try:
        from sglang.srt.managers.scheduler import Scheduler  # optional: sglang
    except Exception as exc:  # an SGLang without the scheduler module we know
        log.warning("no session pins: %s", exc)
        return
    if original_tag is None:
        log.warning("no session pins: RadixCache lacks _tag_session_leaf")
        return

    failed: list[BaseException] = []  # pins are advisory: one failure turns them off, never the scheduler

    def _tag_session_leaf(self: Any, req: Any, radix_key: Any, node: Any = None) -> None:
        original_tag(self, req, radix_key, node=node)
        if node is not None and not failed:
            try:
                pins.on_cached(self, req, node)
            except Exception as exc:
                failed.append(exc)
                log.exception("session pins failed; turned off in this scheduler")

    def rollout_sdk_sessions(self: Any, ops: list[Any]) -> None:
        cache = getattr(self, "tree_cache", None)
        if cache is not None and hasattr(cache, "evictable_leaves") and not failed:
            try:
                pins.apply_ops(cache, ops)
            except Exception as exc:
                failed.append(exc)
                log.exception("session pins failed; turned off in this scheduler")

    radix_cache._tag_session_leaf = _tag_session_leaf
    Scheduler.rollout_sdk_sessions = rollout_sdk_sessions
    _pins_applied = True
