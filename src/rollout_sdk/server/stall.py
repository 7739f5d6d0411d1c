"""The stall detector: notices when an engine's progress collapses while requests run (issue #30).

A healthy engine with requests inside it makes progress at a rate that depends on how many it runs: the
*per-request decode rate* (tokens per second per running request) of a batch of 1,024 is lower than of a
batch of 8, but steady while the batch stays.  A stall is that rate falling far below what a batch of about
the same size made a moment ago (SGLang's radix-cache eviction going O(leaves) per step, a scheduler
starved of CPU), or the server's own event loop not turning (its tick arrives seconds late).

:class:`StallDetector` is the rule, fed one :class:`Sample` per tick and nothing else (no clock of its own,
so tests drive it with made-up samples).  The server (server.py) owns the ticker task: every
``ServerConfig.stall_window_s / 10`` it samples the engine's ``progress()`` counter and load, and measures
how late the tick itself came.  A transition logs one line; ``stats()`` carries ``stalled`` and ``stalls``,
and the Prometheus metrics ``rollout_server_engine_stalled`` / ``rollout_server_engine_stalls``.

The rule, with W = ``window_s``:

* the *current* per-request rate is the progress of the last W seconds over W and the mean running count
  in that window, computed only while every sample of the window had requests running;
* the *reference* is the best per-request rate of an earlier window of the last ``history_s`` (the server
  keeps 15 minutes) whose mean running count was within 2x of the current one (the same batch, give or take)
  and, for engines that count their prefilled tokens (``prefill_progress()``), whose *prefill share* (the
  prefilled tokens' share of the window's tokens) is within ``MIX_SLACK`` of the current one (the same
  work: on the CPU engine a window that prefills 128 second turns decodes ~5x fewer tokens per second than
  a decode-only one, and the demo was reported stalled at each such burst, issue 37);
* stalled when the current rate is below ``ratio`` x the reference; clear again at half the reference, or
  when nothing runs.  A tick later than ``loop_lag_s`` is a stall of the loop itself.

Engines whose ``progress()`` is None are judged by the loop rule alone.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["MIX_SLACK", "Sample", "StallDetector"]

#: two windows are the same work when their prefill shares differ by at most this much
MIX_SLACK = 0.25


@dataclass(frozen=True, slots=True)
class Sample:
    """One tick: ``t`` seconds (any monotonic clock), the engine's progress counter (None: not known),
    requests running in it, and how late the tick came."""

    t: float
    progress: int | None
    running: int
    lag_s: float = 0.0
    #: the engine's prefilled-token counter (None: not counted)
    prefilled: int | None = None


class StallDetector:
    """See the module docstring.  :meth:`observe` returns a line to log when the state changes."""

    def __init__(
        self, *, window_s: float = 10.0, ratio: float = 0.25, loop_lag_s: float = 2.0, history_s: float = 120.0
    ) -> None:
        if not window_s > 0 or not 0 < ratio < 1 or not loop_lag_s > 0 or not history_s >= 2 * window_s:
            raise ValueError("stall detector: window_s > 0, 0 < ratio < 1, loop_lag_s > 0, history_s >= 2 window_s")
        self.window_s = window_s
        self.ratio = ratio
        self.loop_lag_s = loop_lag_s
        self.history_s = history_s
        self._samples: collections.deque[Sample] = collections.deque()
        #: (t, running, rate, prefill share or None) of each past window
        self._rates: collections.deque[tuple[float, float, float, float | None]] = collections.deque()
        self.stalled = False
        self._loop_stall = False  # the current stall is the loop's (it clears with the next timely tick)
        #: stalls seen since start
        self.stalls = 0
        #: why the current (or last) stall was declared
        self.reason = ""

    def observe(self, s: Sample) -> str | None:
        self._samples.append(s)
        while self._samples and self._samples[0].t < s.t - self.history_s:
            self._samples.popleft()
        if s.lag_s > self.loop_lag_s:
            line = self._set(True, f"the event loop was blocked for {s.lag_s:.1f}s")
            self._loop_stall = self._loop_stall or line is not None
            return line
        if self._loop_stall:
            self._loop_stall = False
            return self._set(False, f"the event loop turns again (tick {s.lag_s:.2f}s late)")
        now = self._current(s)
        if now is None:
            if s.running == 0 and self.stalled:
                return self._set(False, "no request running")
            return None
        running, rate, mix = now
        earlier = (
            r
            for t, n, r, m in self._rates
            if t <= s.t - self.window_s
            and 0.5 * running <= n <= 2 * running
            and (m is None or mix is None or abs(m - mix) <= MIX_SLACK)
        )
        ref = max(earlier, default=None)
        self._rates.append((s.t, running, rate, mix))
        while self._rates and self._rates[0][0] < s.t - self.history_s:
            self._rates.popleft()
        if ref is None or ref <= 0:
            return None
        if not self.stalled and rate < self.ratio * ref:
            return self._set(
                True,
                f"engine progress collapsed: {rate:.2f} tokens/s per running request over the last "
                f"{self.window_s:.0f}s against {ref:.2f} a moment ago ({running:.0f} running)",
            )
        if self.stalled and rate >= 0.5 * ref:
            return self._set(False, f"progress back to {rate:.2f} tokens/s per running request (of {ref:.2f})")
        return None

    def _current(self, s: Sample) -> tuple[float, float, float | None] | None:
        """(mean running, per-request rate, prefill share) over the last window, if requests ran in all of
        it; the share is None when the engine does not count its prefills."""
        if s.progress is None:
            return None
        start = None
        for old in self._samples:
            if old.t >= s.t - self.window_s:
                break
            start = old
        if start is None or start.progress is None:
            return None
        window = [x for x in self._samples if x.t >= start.t]
        if any(x.running <= 0 or x.progress is None for x in window):
            return None
        running = sum(x.running for x in window) / len(window)
        dt = s.t - start.t
        decoded = max(0, s.progress - start.progress)
        mix = None
        if s.prefilled is not None and start.prefilled is not None:
            prefilled = max(0, s.prefilled - start.prefilled)
            mix = prefilled / (prefilled + decoded) if prefilled + decoded else 0.0
        return running, decoded / dt / running, mix

    def _set(self, stalled: bool, reason: str) -> str | None:
        if stalled == self.stalled:
            return None
        self.stalled = stalled
        if stalled:
            self.stalls += 1
            self.reason = reason
            return f"stall: {reason}"
        return f"stall over: {reason}"
