"""Agent sessions an engine keeps KV for: leases, resume ranks and session-level admission (issue 40).

A request with ``keep_kv_s`` (and a ``session_id``) asks the engine to keep its session's KV after it ends,
because another turn follows a tool call.  This book is the server's side of that promise, engine-agnostic
(the SGLang engine turns it into pins in its radix cache, engines/sglang/pins.py; the fake engine into its
modelled cache):

* **leases**: a session is *kept* from its first turn until a :class:`~rollout_sdk.protocol.SessionHint`
  says it ended, a turn of it is cancelled, or ``keep_kv_s`` passes after its last turn ended with no new
  turn (the client went away).  Then ``release([...])`` is called: the engine unpins it.
* **ranks**: when a session's tool wait is hinted (``wait_s``), its expected resume time is passed to
  ``rerank(session, rank)``; kept KV expected back *later* is demoted first under memory pressure.  A turn's
  own pin starts with rank ``now + keep_kv_s`` (nothing better is known when it is submitted).
* **admission** (``budget_tokens``; None: off): a *new* session's first turn waits while the kept
  sessions' working set (each session's latest context, prompt plus budgeted output) and its own would
  exceed the budget, instead of every session starting and evicting each other's prefixes (thrashing:
  every resumed turn re-prefills its whole context).  A session grows turn by turn, so each is counted at
  what sessions that ended grew to (their last context over their first turn's, a running mean) times its
  first turn, or its current context if larger.  Turns of admitted sessions never wait here.  With nothing
  kept a session is always admitted, so one larger than the budget still runs.

Everything runs on the engine's event loop; expiry is one timer handle at the earliest lease end (no task).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..protocol import SessionHint

__all__ = ["SessionBook"]

log = logging.getLogger("rollout_sdk.engines")


@dataclass
class _Session:
    tokens: int  # its working set estimate: latest context (prompt + budgeted output)
    first: int = 0  # its first turn's
    running: int = 0  # turns in flight (no lease runs out while one is)
    lease_until: float | None = None


class SessionBook:
    """See the module docstring."""

    def __init__(
        self,
        *,
        release: Callable[[list[str]], None],
        rerank: Callable[[str, float], None] | None = None,
        budget_tokens: int | None = None,
    ) -> None:
        self._release = release
        self._rerank = rerank
        self.budget_tokens = budget_tokens
        self._kept: dict[str, _Session] = {}
        self._waiters: collections.deque[tuple[str, int, asyncio.Future[None]]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        #: counters (metrics, benches): sessions admitted, first turns that waited, leases that ran out
        self.admitted = 0
        self.waited = 0
        self.expired = 0
        #: how much sessions grow from their first turn to their last (a running mean over ended sessions)
        self.growth = 1.0

    # -- what the engine calls ----------------------------------------------------------------------------

    @property
    def kept_tokens(self) -> int:
        """The kept sessions' working set as admission counts it (module docstring)."""
        g = self.growth
        return sum(max(s.tokens, int(s.first * g)) for s in self._kept.values())

    def holds(self, session: str) -> bool:
        return session in self._kept

    @property
    def kept(self) -> int:
        return len(self._kept)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def rank(self, keep_s: float) -> float:
        """The rank a turn's pin starts with (module docstring)."""
        return asyncio.get_running_loop().time() + keep_s

    async def enter(self, session: str, tokens: int) -> None:
        """A turn of ``session`` (``tokens``: its prompt plus budgeted output) starts: a new session waits
        for room (admission); an admitted one passes.  Cancellable while waiting."""
        s = self._kept.get(session)
        if s is None:
            if self._waiters or not self._fits(tokens):
                self.waited += 1
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                entry = (session, tokens, fut)
                self._waiters.append(entry)
                try:
                    await fut
                except BaseException:
                    if entry in self._waiters:
                        self._waiters.remove(entry)
                    elif fut.done() and not fut.cancelled():  # admitted just as it was cancelled: undo
                        self._drop([session], release=False)
                    raise
                s = self._kept[session]
            else:
                s = self._kept[session] = _Session(tokens, tokens)
                self.admitted += 1
        s.tokens = max(s.tokens, tokens)
        s.running += 1
        s.lease_until = None

    def leave(self, session: str, *, keep_s: float | None, tokens: int, ok: bool) -> None:
        """A turn ended: with ``ok`` and ``keep_s`` the lease starts (``tokens``: the context the engine now
        keeps); otherwise (cancelled, failed, or no lease asked) the session is released."""
        s = self._kept.get(session)
        if s is None:
            return
        s.running = max(0, s.running - 1)
        if not ok or keep_s is None:
            if s.running == 0:
                self._drop([session])
            return
        s.tokens = tokens
        if s.running == 0:
            s.lease_until = asyncio.get_running_loop().time() + keep_s
            self._arm(s.lease_until)
        self._admit_waiters()

    def hints(self, hints: Sequence[SessionHint]) -> None:
        now = asyncio.get_running_loop().time()
        ended: list[str] = []
        for h in hints:
            s = self._kept.get(h.session_id)
            if s is None:
                continue
            if h.ended and s.running == 0:
                ended.append(h.session_id)
                if s.first:  # what a whole session grows to: the next sessions are counted at it
                    self.growth += 0.2 * (max(1.0, s.tokens / s.first) - self.growth)
            elif h.wait_s is not None and self._rerank is not None:
                self._rerank(h.session_id, now + h.wait_s)
        if ended:
            self._drop(ended)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        self._waiters.clear()

    # -- inside ---------------------------------------------------------------------------------------

    def _fits(self, tokens: int) -> bool:
        if self.budget_tokens is None or not self._kept:
            return True
        return self.kept_tokens + int(tokens * self.growth) <= self.budget_tokens

    def _drop(self, sessions: list[str], *, release: bool = True) -> None:
        gone = [s for s in sessions if self._kept.pop(s, None) is not None]
        if gone and release:
            try:
                self._release(gone)
            except Exception:  # advisory: a failed unpin costs memory until pressure demotes it
                log.warning("releasing kept sessions failed", exc_info=True)
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._waiters:
            session, tokens, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if session not in self._kept:
                if not self._fits(tokens):
                    return
                self._kept[session] = _Session(tokens, tokens)
                self.admitted += 1
            self._waiters.popleft()
            fut.set_result(None)

    def _arm(self, at: float) -> None:
        if at >= self._timer_at and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._expire)

    def _expire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        now = asyncio.get_running_loop().time()
        gone = [k for k, s in self._kept.items() if not s.running and (s.lease_until or now + 1) <= now]
        self.expired += len(gone)
        if gone:
            self._drop(gone)
        later = [s.lease_until for s in self._kept.values() if s.running == 0 and s.lease_until is not None]
        if later:
            self._arm(min(later))
