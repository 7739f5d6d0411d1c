"""Session pins in SGLang's radix cache: an agent's KV kept through its tool waits (issue 40).

Runs inside SGLang's scheduler processes (installed by :mod:`.radix_patch`'s plugin).  The problem: while a
session waits for its tool, other sessions' work evicts its prefix (SGLang evicts the least recently used
leaf), so the next turn re-prefills the whole conversation.  The server knows which sessions will come
back; the scheduler does not.  So:

* A request whose ``sampling_params.custom_params`` carries ``{KEY: [session_id, rank]}`` *pins* its
  session when it finishes: the radix node holding its whole sequence (prompt and output) is marked with
  the session and a *rank*, the server's estimate of when the session resumes (seconds on the server's
  clock).  A later turn of the session moves the pin to its own, longer node.
* A pin is soft: pinned leaves are evicted only after every unpinned one, and among pinned ones the one
  expected back *last* goes first (Belady's order, as far as the hints know).  Pinned tokens stay in
  SGLang's ``evictable_size``, so its admission and its decode memory check never wait on a pin: running
  requests cannot starve (memory pressure demotes pins instead).
* The server changes ranks and releases pins (session ended, cancelled, lease expired) with one batched
  RPC (``Scheduler.rollout_sdk_sessions``): SGLang delivers RPCs to every tensor-parallel rank at the same
  point of its loop, and nothing here reads a clock, so every rank makes the same eviction choices (the
  KV indices of the ranks must never diverge).

The eviction order is applied through the cache's eviction strategy (:class:`PinAware` wraps SGLang's),
so it holds with SGLang's own ``evict`` and with the incremental one of :mod:`.radix_patch`; a node whose
priority drops (released) is pushed again so the incremental heap sees it at its new place.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["KEY", "PinAware", "apply_ops", "attach", "on_cached", "pinned_sessions"]

log = logging.getLogger("rollout_sdk.engines.sglang")

#: the custom_params key of a request that pins its session when it finishes: ``[session_id, rank]``
KEY = "rollout_sdk_keep"
_NODE = "_rsdk_pins"  # on a TreeNode: {session_id: rank}
_CACHE = "_rsdk_sessions"  # on the RadixCache: {session_id: node}


class PinAware:
    """SGLang's eviction strategy with pins on top: ``(0, SGLang's priority)`` for an unpinned node,
    ``(1, -soonest rank)`` for a pinned one (lower is evicted first)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_priority(self, node: Any) -> tuple[int, Any]:
        pins = node.__dict__.get(_NODE)
        if pins:
            return (1, -min(pins.values()))
        return (0, self.inner.get_priority(node))


def attach(cache: Any) -> dict[str, Any]:
    """The session table of ``cache``, wrapping its eviction strategy the first time."""
    table: dict[str, Any] | None = cache.__dict__.get(_CACHE)
    if table is None:
        table = cache.__dict__[_CACHE] = {}
        if not isinstance(cache.eviction_strategy, PinAware):
            cache.eviction_strategy = PinAware(cache.eviction_strategy)
            # radix_patch's heap holds SGLang's own priorities, which do not compare with ours: rebuilt on
            # the next eviction from the evictable leaves, under the new strategy
            cache.__dict__.pop("_rsdk_heap", None)
    return table


def _unpin(cache: Any, table: dict[str, Any], session: str) -> None:
    node = table.pop(session, None)
    if node is None:
        return
    pins = node.__dict__.get(_NODE)
    if pins is not None:
        pins.pop(session, None)
        if not pins:
            del node.__dict__[_NODE]
    _repush(cache, node)


def _repush(cache: Any, node: Any) -> None:
    """The node's priority changed: let the eviction heap (radix_patch) see it at its new place."""
    if node in cache.evictable_leaves:
        cache._update_leaf_status(node)


def _alive(cache: Any, node: Any) -> bool:
    parent = node.parent
    return parent is not None and any(child is node for child in parent.children.values())


def on_cached(cache: Any, req: Any, node: Any) -> None:
    """``req`` finished and its sequence is cached at ``node``: pin its session there (if it asked)."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(custom, dict):
        return
    spec = custom.get(KEY)
    if not isinstance(spec, list | tuple) or len(spec) != 2 or node is None or node is cache.root_node:
        return
    session, rank = spec
    if not isinstance(session, str) or not isinstance(rank, int | float):
        return
    if not req.finished() or type(req.finished_reason).__name__ == "FINISH_ABORT":
        return  # a cancelled or checkpointed part: the server decides (it releases or re-runs)
    table = attach(cache)
    _unpin(cache, table, session)
    node.__dict__.setdefault(_NODE, {})[session] = float(rank)
    table[session] = node
    _repush(cache, node)


def apply_ops(cache: Any, ops: list[Any]) -> int:
    """The server's batched changes: ``["rank", session, rank]`` or ``["release", session]``.  Pins whose
    node was evicted meanwhile are forgotten.  Returns how many sessions are pinned after."""
    table = attach(cache)
    for op in ops:
        if not isinstance(op, list | tuple) or not op or not isinstance(op[1] if len(op) > 1 else None, str):
            continue
        kind, session = op[0], op[1]
        if kind == "release":
            _unpin(cache, table, session)
        elif kind == "rank" and len(op) == 3 and isinstance(op[2], int | float):
            node = table.get(session)
            if node is not None:
                node.__dict__[_NODE][session] = float(op[2])
                _repush(cache, node)
    for session in [s for s, n in table.items() if not _alive(cache, n)]:
        table.pop(session, None)  # evicted under pressure: nothing left to release
    return len(table)


def pinned_sessions(cache: Any) -> dict[str, float]:
    """Sessions pinned in ``cache`` whose node is still in the tree, with their ranks (tests, metrics)."""
    table = cache.__dict__.get(_CACHE) or {}
    return {s: n.__dict__[_NODE][s] for s, n in table.items() if _alive(cache, n) and s in n.__dict__.get(_NODE, {})}
