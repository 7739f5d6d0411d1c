"""A GRPO group's prompt prefilled once: its members wait for one prefill-only pass, then hit the cache.

A group of G samples shares one prompt.  Sent together, the engine's scheduler plans each prefill batch
before the previous one is in its prefix cache, so it computes the prompt several times (SGLang 0.5.16,
7B, 64 prompts x 4,096 tokens x 8 samples sent at once: 3.18x the ideal prefill, docs/benchmarks.md).
An engine that has a prefix cache uses :class:`PrefillOnce`: the first member of a group to arrive
starts one *prefill-only* pass of the prompt (no token sampled; the prompt's KV lands in the prefix
cache), and every member, the first included, waits for it before it is submitted; each then computes
only the last prompt position (its logits) and decodes as before.  Sampling, seeds and logprobs are
untouched: only where the prompt's KV comes from changes.

::

    member k of group g ──wait(req)──▶ key = (group_id, prompt)
        key seen, prefill running ──▶ await it (shielded: one member's cancellation stops nobody else)
        key seen, prefill done ───────▶ go on at once
        key new ──▶ start run_prefill(req) as a task owned here ──▶ await it
    the prefill's outcome never matters: a failed, aborted or refused prefill only means the members
    compute the prompt themselves, so its errors are swallowed here (the members report their own)

Bounds: an entry per group in flight plus the last ``max_entries`` finished ones (keys, not KV); a
request joins only with a ``group_id`` and a prompt of at least ``min_tokens`` (shorter prompts cost
less to compute twice than the extra round through the scheduler).  :meth:`close` cancels what runs.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import ConfigError
from ..protocol import GenerateRequest

__all__ = ["PrefillOnce"]


class PrefillOnce:
    """One engine's group prefills (see the module docstring).  Event-loop local; no lock."""

    def __init__(self, run_prefill: Callable[[GenerateRequest], Awaitable[Any]], *, min_tokens: int = 256,
                 max_entries: int = 4096) -> None:  # fmt: skip
        if min_tokens < 1:
            raise ConfigError("prefill_once_min_tokens", min_tokens, "must be >= 1")
        if max_entries < 1:
            raise ConfigError("max_entries", max_entries, "must be >= 1")
        self._run = run_prefill
        self.min_tokens = min_tokens
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, int, int], asyncio.Future[Any]] = collections.OrderedDict()
        #: prefill-only passes started, and members that waited for one (tests, stats, benches)
        self.prefills = 0
        self.members = 0

    def wants(self, req: GenerateRequest) -> bool:
        return (
            req.group_id is not None and len(req.input_ids) >= self.min_tokens and not req.images and not req.score_only
        )

    async def wait(self, req: GenerateRequest) -> None:
        """Return once ``req``'s group prompt has been prefilled (or its prefill has failed); at once for a
        request that is not a group member with a long enough prompt."""
        if not self.wants(req):
            return
        assert req.group_id is not None
        key = (req.group_id, len(req.input_ids), hash(tuple(req.input_ids)))
        fut = self._entries.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._run(req))
            fut.add_done_callback(_consume)
            self._entries[key] = fut
            self.prefills += 1
            self._trim()
        else:
            self._entries.move_to_end(key)
        self.members += 1
        if fut.done():
            return
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if fut.cancelled() and (me is None or not me.cancelling()):
                return  # the prefill was cancelled (close()), not this member: it goes on without
            raise
        except Exception:
            pass  # its outcome does not matter (module docstring)

    def _trim(self) -> None:
        """Forget the oldest finished entries beyond ``max_entries`` (running ones are kept: they are
        bounded by the requests in flight)."""
        excess = len(self._entries) - self.max_entries
        if excess <= 0:
            return
        for key in [k for k, f in self._entries.items() if f.done()][:excess]:
            del self._entries[key]

    @property
    def running(self) -> int:
        return sum(not f.done() for f in self._entries.values())

    async def close(self) -> None:
        """Cancel every prefill still running and wait for them to end."""
        running = [f for f in self._entries.values() if not f.done()]
        for f in running:
            f.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        self._entries.clear()


def _consume(fut: asyncio.Future[Any]) -> None:
    """Mark a prefill's exception retrieved: no member may be left to await it."""
    if not fut.cancelled():
        fut.exception()
