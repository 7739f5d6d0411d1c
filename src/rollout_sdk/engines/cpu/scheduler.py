"""Which sequences the CPU engine runs next: the waiting queue and the admission rule.

Each step admits waiting sequences in FIFO order while the batch has room (``max_running`` rows) and the
padded prefill stays within ``max_prefill_tokens`` (the first one is always admitted, however long).
Touched only on the event loop.
"""

from __future__ import annotations

import collections

from ...protocol.engine_config import CpuEngineConfig
from ..base import EngineLoad
from .sequence import Sequence

__all__ = ["Scheduler"]


class Scheduler:
    """Every sequence the engine holds (by rid) and the FIFO of those waiting for a row."""

    def __init__(self, config: CpuEngineConfig) -> None:
        self.config = config
        self.seqs: dict[str, Sequence] = {}
        self.waiting: collections.deque[Sequence] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return sum(not s.done for s in self.waiting)

    @property
    def has_waiting(self) -> bool:
        return any(not s.done for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.rid] = seq
        self.waiting.append(seq)

    def requeue_front(self, seqs: list[Sequence]) -> None:
        """Retracted rows go back first, in their order."""
        self.waiting.extendleft(reversed(seqs))

    def forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.rid, None)

    def schedule(self, num_live_rows: int) -> list[Sequence]:
        """Pop the sequences to prefill this step."""
        cfg = self.config
        room = cfg.max_running - num_live_rows
        admit: list[Sequence] = []
        longest = 0
        while self.waiting and len(admit) < room:
            s = self.waiting[0]
            if s.done:
                self.waiting.popleft()
                continue
            n = s.num_tokens
            if admit and max(longest, n) * (len(admit) + 1) > cfg.max_prefill_tokens:
                break
            longest = max(longest, n)
            admit.append(self.waiting.popleft())
        return admit

    def load(self) -> EngineLoad:
        """Load now.  Admitted sequences count as running (and as holding KV for their tokens) from the
        moment they leave the queue; a retracted one is queued again and holds none."""
        queued = [s for s in self.waiting if not s.done]
        queued_tokens = sum(s.num_tokens for s in queued)
        return EngineLoad(
            running=len(self.seqs) - len(queued),
            queued=len(queued),
            queued_tokens=queued_tokens,
            max_running_requests=self.config.max_running,
            kv_used_tokens=sum(s.num_tokens for s in self.seqs.values()) - queued_tokens,
        )
