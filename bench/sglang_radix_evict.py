"""Minimal reproduction, without rollout-sdk and without a GPU: SGLang's radix-cache eviction costs time in
proportion to the number of cached leaves, on every call (issue #30).

    python bench/sglang_radix_evict.py                    # sglang 0.5.16 importable; CPU is enough
    python bench/sglang_radix_evict.py --patched          # the same with rollout-sdk's incremental eviction

``RadixCache.evict`` (sglang 0.5.16, ``srt/mem_cache/radix_cache.py``) builds a heap of *every* evictable
leaf each time it is called: ``[(priority(node), node) for node in self.evictable_leaves]`` + ``heapify``.
Once the KV pool is full of finished requests, the scheduler calls it on every decode step that needs
slots (``evict_from_tree_cache``: ``available_size() < num_tokens``), so each step pays O(leaves) of
Python.  After a few passes of many short requests (8,192 leaves of ~80 tokens each per pass) a decode
step of 1,024 long requests spends tens of milliseconds there: the GPU idles while the scheduler sorts.

This builds SGLang's own simulated cache (``RadixCache.create_simulated``: no memory pools), inserts
``n`` finished requests of ``--tokens`` tokens each, then times ``evict(num_tokens=1024)`` calls (what one
decode step of 1,024 requests asks for), refilling what each call freed so the leaf count stays put.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from typing import Any

import harness

_TOGGLE = os.path.join(tempfile.gettempdir(), f"radix-evict-toggle-{os.getpid()}")


class _Allocator:
    """What the simulated cache needs of a KV allocator: ``free`` (counted) and ``device``."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free(self, indices: Any) -> None:
        self.freed += len(indices)


def measure(n_leaves: int, tokens: int, calls: int, patched: bool) -> dict[str, float]:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    if patched:  # rollout-sdk's eviction, switched on by a toggle file (SGLang's own while it is absent)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
        from rollout_sdk.engines.sglang import radix_patch

        radix_patch.apply(toggle=_TOGGLE)
        open(_TOGGLE, "w").close()
    elif os.path.exists(_TOGGLE):
        os.remove(_TOGGLE)
    cache = RadixCache.create_simulated(mock_allocator=_Allocator())
    rnd = random.Random(0)
    seq = 0

    def add(k: int) -> None:
        nonlocal seq
        for _ in range(k):
            ids = [rnd.randrange(1, 150_000) for _ in range(tokens)]
            value = torch.arange(seq, seq + tokens, dtype=torch.int64)
            seq += tokens
            cache.insert(InsertParams(key=RadixKey(token_ids=ids), value=value))

    add(n_leaves)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        res = cache.evict(EvictParams(num_tokens=1024))
        times.append(time.perf_counter() - t0)
        add(-(-res.num_tokens_evicted // tokens))  # keep the leaf count where it was
    return {
        "leaves": n_leaves,
        "evict_ms_median": round(1000 * harness.median(times), 3),
        "evict_ms_max": round(1000 * max(times), 3),
        "leaves_after": len(cache.evictable_leaves),
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--leaves", type=int, nargs="*", default=[1_000, 8_000, 32_000, 64_000])
    ap.add_argument("--tokens", type=int, default=80, help="tokens per cached request (a 64-in / 16-out one)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--patched", action="store_true", help="rollout-sdk's eviction (radix_patch) instead")
    ap.add_argument("--both", action="store_true", help="SGLang's and rollout-sdk's side by side")
    a = ap.parse_args()
    import sglang

    modes = [False, True] if a.both else [a.patched]
    print(f"sglang {sglang.__version__}: evict(num_tokens=1024) with n cached leaves of {a.tokens} tokens")
    print(f"{'leaves':>8s} " + " ".join(f"{'patched' if m else 'sglang':>12s} ms (max)" for m in modes))
    for n in a.leaves:
        cells = []
        for m in modes:
            r = measure(n, a.tokens, a.calls, m)
            cells.append(f"{r['evict_ms_median']:>12.3f} ({r['evict_ms_max']:.1f})")
        print(f"{n:>8d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
