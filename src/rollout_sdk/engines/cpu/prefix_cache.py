"""The CPU engine's prefix cache: the KV of finished rows, found again by token prefix (issues 40, 41).

A real engine keeps the KV of what it has computed (SGLang's radix cache, vLLM's block hashes) so that a
request sharing a prefix with an earlier one computes only the rest.  This is that, for the CPU engine::

    entry      a finished row's KV: per layer K/V [1, H, T, D] for its tokens (prompt + output but the last
               token, which was never fed forward), under a namespace (``Sequence.cache_ns``)
    index      chain hash of every full 16-token block prefix of every entry -> the entries holding it
               (the root key, the namespace alone, holds all of its entries)
    lookup     walk a row's blocks down the index (one dict probe per block), then extend past the last
               full block token by token against the most recent holders: work proportional to the row;
               the best candidate's tokens are compared to the row's, so a hash collision is a miss
    eviction   by tokens (``capacity_tokens``): least recently used unpinned entry first; pinned ones only
               when nothing unpinned is left, the one expected back latest first
    pins       a kept agent session's (``keep_kv_s``, engines/sessions.py) latest entry; the session book
               keeps, re-ranks and releases sessions (``keep`` / ``rerank`` / ``release``)

A lookup never crosses namespaces: the namespace is hashed into every key and compared on the hit, so KV
computed under one weight version is never served to a request of another (issue 41).

Nothing running waits on this cache: running rows hold their KV in the batch, and the cache only decides
what it keeps of finished ones, so a pin can cost another entry its place but never a request its turn.

Threads: lookups, inserts and evictions run on the engine's worker thread; ``keep``, ``rerank`` and
``release`` come from the event loop (the session book).  One lock guards the dicts and is held for dict
work only; the tensors an insert stores are cut out of the batch before it is taken.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["BLOCK_TOKENS", "Hit", "PrefixCache"]

#: tokens per indexed block (SGLang's page size, vLLM's block size)
BLOCK_TOKENS = 16
#: entries sharing a row's last matched block that a lookup compares past it (a bound on its work: with
#: more holders than this, a hit may miss up to BLOCK_TOKENS - 1 tokens it could have taken)
MAX_CANDIDATES = 16

KV = list[tuple[torch.Tensor, torch.Tensor]]


class Hit(NamedTuple):
    """What a lookup found: the KV of the row's first ``num_tokens`` tokens (views of the entry's)."""

    num_tokens: int
    kv: KV
    entry_id: int


@dataclass(eq=False)
class _Entry:
    id: int
    ns: str
    tokens: tuple[int, ...]
    kv: KV
    keys: list[int]
    session: str | None = None
    pinned: bool = field(default=False)


class PrefixCache:
    """See the module docstring.  ``capacity_tokens`` 0: off (every lookup misses, nothing is kept)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._index: dict[int, dict[int, _Entry]] = {}
        self._unpinned: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # LRU first
        self._pinned: dict[int, _Entry] = {}
        self._sessions: dict[str, _Entry] = {}  # each kept session's latest entry
        self._kept: dict[str, float] = {}  # sessions the session book keeps -> expected resume time
        self._used = 0
        #: counters (tests, stats): lookups that hit, tokens they took, entries evicted
        self.hits = 0
        self.hit_tokens = 0
        self.evictions = 0

    # -- state ------------------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def disable(self) -> None:
        """Off for good (a model whose cache layers are not plain full-attention ones)."""
        self.clear()
        self.capacity_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._used

    @property
    def num_entries(self) -> int:
        return len(self._unpinned) + len(self._pinned)

    @property
    def pinned_sessions(self) -> list[str]:
        with self._lock:
            return sorted(e.session for e in self._pinned.values() if e.session is not None)

    def cached(self, ns: str, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (all of them may match) a lookup would take now; touches nothing."""
        with self._lock:
            found = self._find(ns, tokens, len(tokens))
        return 0 if found is None else found[1]

    # -- the worker's side ------------------------------------------------------------------------------

    def lookup(self, ns: str, tokens: Sequence[int]) -> Hit | None:
        """The longest cached prefix of ``tokens[:-1]`` in namespace ``ns`` (the last token is always fed
        forward: its logits are the next token's), or None.  A hit is the most recently used entry."""
        limit = len(tokens) - 1
        if not self.enabled or limit < 1:
            return None
        with self._lock:
            found = self._find(ns, tokens, limit)
            if found is None:
                return None
            e, n = found
            if not e.pinned:
                self._unpinned.move_to_end(e.id)
            self.hits += 1
            self.hit_tokens += n
            return Hit(n, [(k[:, :, :n], v[:, :, :n]) for k, v in e.kv], e.id)

    def insert(
        self, ns: str, tokens: Sequence[int], kv: KV, *, session: str | None = None, replaces: int | None = None
    ) -> bool:
        """Keep ``kv`` (per layer [1, H, len(tokens), D], owned by the cache from now on) for ``tokens``;
        the entry ``replaces`` (the one the row hit) goes if it is a prefix of these tokens and no other
        session's pin, and so does an entry with exactly these tokens.  ``session``: a turn with
        ``keep_kv_s``; its entry is pinned while the session is kept.  Returns whether the entry stayed
        (one larger than the cache, or unpinned with only pins left to evict, does not)."""
        toks = tuple(tokens)
        n = len(toks)
        if not self.enabled or n == 0 or n > self.capacity_tokens:
            return False
        with self._lock:
            old = self._entry(replaces) if replaces is not None else None
            if old is not None and self._superseded(old, ns, toks, session):
                self._remove(old)
            for dup in [e for e in self._holders(ns, toks) if e.tokens == toks]:
                if self._superseded(dup, ns, toks, session):
                    self._remove(dup)
            e = _Entry(next(self._ids), ns, toks, kv, _chain(ns, toks, n // BLOCK_TOKENS))
            for key in e.keys:
                self._index.setdefault(key, {})[e.id] = e
            self._used += n
            if session is not None and session in self._kept:
                e.session = session
                prev = self._sessions.get(session)
                self._sessions[session] = e
                if prev is not None:
                    self._place(prev, stale=True)  # the session's older context: no longer its pin
            self._place(e)
            self._evict()
            return e.id in self._unpinned or e.id in self._pinned

    def clear(self) -> None:
        """Drop every entry (flush_cache, a weight change, released KV memory).  Kept sessions stay kept:
        their next finished turn is pinned again."""
        with self._lock:
            self._index.clear()
            self._unpinned.clear()
            self._pinned.clear()
            self._sessions.clear()
            self._used = 0

    # -- the session book's side (event loop) --------------------------------------------------------------

    def keep(self, session: str, rank: float) -> None:
        """``session`` is kept, expected back at ``rank`` (loop time): its latest entry is pinned."""
        with self._lock:
            self._kept[session] = rank
            e = self._sessions.get(session)
            if e is not None:
                self._place(e)

    def rerank(self, session: str, rank: float) -> None:
        with self._lock:
            if session in self._kept:
                self._kept[session] = rank

    def release(self, sessions: Iterable[str]) -> None:
        """These sessions are no longer kept: their entries become the first unpinned ones to go."""
        with self._lock:
            for s in sessions:
                self._kept.pop(s, None)
                e = self._sessions.pop(s, None)
                if e is not None:
                    e.session = None
                    self._place(e, stale=True)

    # -- inside (lock held) ----------------------------------------------------------------------------

    def _entry(self, entry_id: int) -> _Entry | None:
        return self._unpinned.get(entry_id) or self._pinned.get(entry_id)

    def _holders(self, ns: str, toks: tuple[int, ...]) -> list[_Entry]:
        """Entries sharing every full block of ``toks`` (at most MAX_CANDIDATES, most recent first)."""
        keys = _chain(ns, toks, len(toks) // BLOCK_TOKENS)
        holders = self._index.get(keys[-1], {})
        return list(itertools.islice(reversed(holders.values()), MAX_CANDIDATES))

    def _find(self, ns: str, tokens: Sequence[int], limit: int) -> tuple[_Entry, int] | None:
        h = _root(ns)
        holders = self._index.get(h)
        if not holders:
            return None
        depth = 0
        for b in range(limit // BLOCK_TOKENS):
            h = hash((h, tuple(tokens[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS])))
            deeper = self._index.get(h)
            if not deeper:
                break
            holders, depth = deeper, (b + 1) * BLOCK_TOKENS
        best: _Entry | None = None
        best_n = 0
        for e in itertools.islice(reversed(holders.values()), MAX_CANDIDATES):
            n = depth
            end = min(limit, len(e.tokens), depth + BLOCK_TOKENS)  # the walk above matched every full block
            while n < end and e.tokens[n] == tokens[n]:
                n += 1
            if n > best_n:
                best, best_n = e, n
        if best is None or best.ns != ns or best.tokens[:depth] != tuple(tokens[:depth]):
            return None  # nothing, or a hash collision
        return best, best_n

    def _superseded(self, e: _Entry, ns: str, toks: tuple[int, ...], session: str | None) -> bool:
        """``e`` is a prefix of ``toks`` in ``ns`` whose pin (if any) is ``session``'s."""
        if e.ns != ns or len(e.tokens) > len(toks) or toks[: len(e.tokens)] != e.tokens:
            return False
        return not e.pinned or e.session == session

    def _place(self, e: _Entry, *, stale: bool = False) -> None:
        """File ``e`` as pinned (its session is kept and this is its latest entry) or unpinned (most
        recently used, or ``stale``: least)."""
        self._unpinned.pop(e.id, None)
        self._pinned.pop(e.id, None)
        s = e.session
        e.pinned = s is not None and s in self._kept and self._sessions.get(s) is e
        if e.pinned:
            self._pinned[e.id] = e
        else:
            self._unpinned[e.id] = e
            if stale:
                self._unpinned.move_to_end(e.id, last=False)

    def _remove(self, e: _Entry) -> None:
        if self._unpinned.pop(e.id, None) is None and self._pinned.pop(e.id, None) is None:
            return
        self._used -= len(e.tokens)
        for key in e.keys:
            holders = self._index.get(key)
            if holders is not None:
                holders.pop(e.id, None)
                if not holders:
                    del self._index[key]
        if e.session is not None and self._sessions.get(e.session) is e:
            del self._sessions[e.session]

    def _evict(self) -> None:
        while self._used > self.capacity_tokens:
            if self._unpinned:
                victim = next(iter(self._unpinned.values()))
            else:  # only pins left: the session expected back latest
                victim = max(self._pinned.values(), key=lambda e: self._kept.get(e.session or "", 0.0))
            self._remove(victim)
            self.evictions += 1


def _root(ns: str) -> int:
    return hash(("rollout-sdk-prefix", ns))


def _chain(ns: str, toks: Sequence[int], blocks: int) -> list[int]:
    """The root key of ``ns`` and the chain hash of each of the first ``blocks`` full blocks of ``toks``."""
    keys = [_root(ns)]
    for b in range(blocks):
        keys.append(hash((keys[-1], tuple(toks[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS]))))
    return keys
