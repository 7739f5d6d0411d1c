"""Streaming rollouts that beat the long tail: continuous refill, over-provisioning, carry-over, staleness.

In a synchronous RL step the longest samples decide the step time.  The producer keeps every engine's
batch full instead::

    async with client.rollouts(prompts, agent=agent, group_size=8, batch_groups=32, mode="partial",
                               max_staleness=1, reward=reward) as stream:
        async for batch in stream:                      # batch.groups: 32 finished groups of 8
            train(batch)
            await client.update_weights(..., version=v) # the next batch uses the new weights

Modes:

* ``sync`` — the batch-gather baseline: start ``batch_groups`` groups, wait for all, yield, repeat.
* ``async`` — keep ``ceil(batch_groups * over_provision)`` groups in flight, refilling as soon as one
  finishes; yield a batch as soon as ``batch_groups`` groups are done.  Groups still running keep running
  across the yield (and across weight updates: their tokens say which weights made them).
* ``partial`` — as ``async``, but when a batch is yielded the groups still running are *preempted*: their
  requests are aborted and parked with the tokens they had; when the consumer asks for the next batch
  (after updating the weights) they resume from those tokens on the new weights.

Concurrency (the shared producer, :mod:`.producer`)::

    producer task (spawned by the client) ── TaskGroup ── one task per group ── n trajectory coroutines
      a slot is one group, held from the moment its sample is pulled until the consumer is done with it:
      taken into a batch (async, partial) or yielded in a batch (sync); ``capacity`` slots in all
      (``batch_groups`` in sync mode, ``ceil(batch_groups * over_provision)`` otherwise), so a slow
      consumer holds at most that many finished groups, never an unbounded backlog
      pulls the next sample: re-queued ones first (a stale group gives its sample back), then the source
      member k of a group runs in RolloutContext(member=k): agent.run(ctx, sample) / one generate
    finished group ─▶ reward (as each trajectory finishes) ─▶ filter ─▶ the producer's `done` deque
    consumer (__anext__) takes batch_groups groups; partial mode pauses the producer and preempts the
      running groups before returning, and resumes both when it is called again
    a sampler task records each server's in-flight count every 20 ms (busy fraction per batch)

Guarantees: every sample of the source ends up in exactly one yielded group, or is reported as dropped
by the filter; none is lost or duplicated across preemption, resumption and re-queueing.  No yielded
trajectory has tokens from weights more than ``max_staleness`` versions apart from the version current
when it is yielded: the producer refuses to extend (or yield) a group past the bound, and re-queues its
sample instead, counting it in ``metrics["requeued_stale"]``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .._aio import cancel_and_wait
from ..errors import ConfigError, StalenessError
from ..protocol import GenerateRequest, SamplingParams
from .context import RolloutContext
from .generator import USE_CLIENT_DEFAULT, Generator, UseClientDefault
from .group import Agent, RewardFn, run_trajectory
from .producer import DROP, REQUEUE, Finished, Producer, ProducerStatistics, Spawn, StreamState
from .trajectory import Trajectory

__all__ = ["GenerateAgent", "RolloutBatch", "RolloutStream"]

GroupFilter = Callable[[list[Trajectory]], "bool | Awaitable[bool]"]
RolloutMode = Literal["sync", "async", "partial"]


class GenerateAgent(Agent):
    """One generation per trajectory: the sample is a GenerateRequest or a list of token ids."""

    def __init__(self, sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()

    async def run(self, ctx: RolloutContext, sample: Any) -> Trajectory:
        if isinstance(sample, GenerateRequest):
            ids, sp = sample.input_ids, sample.sampling
        else:
            ids, sp = list(sample), self.sampling
        r = await ctx.generate(ids, sp)
        return Trajectory(
            id=ctx.session_id,
            prompt_ids=list(ids),
            response_ids=r.output_ids,
            loss_mask=[1] * len(r.output_ids),
            logprobs=r.logprobs or [0.0] * len(r.output_ids),
            finish_reason=r.finish_reason,
            weight_versions=list(r.version_segments),
            kv_weight_versions=list(r.kv_version_segments),
            metrics={"model_tokens": float(len(r.output_ids)), "preemptions": float(ctx.preemptions)},
        )


@dataclass
class RolloutBatch:
    """``groups[i]`` holds the ``group_size`` trajectories of sample ``sample_indices[i]``."""

    index: int
    groups: list[list[Trajectory]]
    sample_indices: list[int]
    weight_version: int
    metrics: dict[str, Any] = field(default_factory=dict)
    final: bool = False

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]


@dataclass
class _Group:
    index: int
    sample: Any
    ctxs: list[RolloutContext] = field(default_factory=list)
    #: its members' first turns share it: placed together, the shared prompt prefilled once
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class RolloutStream:
    """Returned by :meth:`RolloutClient.rollouts`; see the module docstring.  Iterated once: a closed
    stream refuses reuse (StreamClosedError)."""

    def __init__(
        self,
        generator: Generator,
        source: Iterable[Any] | AsyncIterable[Any],
        *,
        agent: Agent | None,
        sampling: SamplingParams | None,
        group_size: int,
        batch_groups: int,
        mode: RolloutMode,
        over_provision: float,
        max_staleness: int | None,
        reward: RewardFn | None,
        filter: GroupFilter | None,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        spawn: Spawn,
        load: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        if mode not in ("sync", "async", "partial"):
            raise ConfigError("mode", mode, "must be 'sync', 'async' or 'partial'")
        if group_size < 1:
            raise ConfigError("group_size", group_size, "must be >= 1")
        if batch_groups < 1:
            raise ConfigError("batch_groups", batch_groups, "must be >= 1")
        if over_provision < 1.0:
            raise ConfigError("over_provision", over_provision, "must be >= 1")
        if max_staleness is not None and max_staleness < 0:
            raise ConfigError("max_staleness", max_staleness, "must be >= 0 or None")
        self.generator = generator
        self.agent = agent or GenerateAgent(sampling)
        self.n = group_size
        self.batch_groups = batch_groups
        self.mode = mode
        self.target = batch_groups if mode == "sync" else math.ceil(batch_groups * over_provision)
        self.max_staleness = max_staleness
        self.reward = reward
        self.filter = filter
        self.timeout = timeout
        self._spawn = spawn
        self._load = load
        self._producer: Producer[list[Trajectory]] = Producer(
            source, self._run_group, capacity=self.target, spawn=spawn, name="rollouts", what="RolloutStream"
        )
        self._running: dict[int, _Group] = {}
        self._sampler: asyncio.Task[None] | None = None
        self._batch_index = 0
        self._last_yield = time.perf_counter()
        self._preempted: list[RolloutContext] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._busy: collections.Counter[str] = collections.Counter()
        self._ticks = 0
        self._in_flight_sum = 0

    @property
    def state(self) -> StreamState:
        return self._producer.state

    def statistics(self) -> ProducerStatistics:
        """Slots (groups) and where they are now: running, finished and waiting, re-queued."""
        return self._producer.statistics()

    # -- consumer side -----------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutStream:
        self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> RolloutStream:
        self._start()
        return self

    def _start(self) -> None:
        was = self._producer.state
        self._producer.start()
        if was is StreamState.UNOPENED and self._load is not None:
            self._sampler = self._spawn(self._sample_load(), "rollouts-load")

    async def __anext__(self) -> RolloutBatch:
        self._start()
        if self._producer.state is StreamState.EXHAUSTED:
            raise StopAsyncIteration
        for ctx in self._preempted:  # partial mode: the consumer is done with the last batch
            ctx.resume()
        self._preempted = []
        self._producer.resume()
        groups: list[Finished[list[Trajectory]]] = []
        while len(groups) < self.batch_groups:
            item = await self._producer.take()
            if item is None:
                break
            if self._too_stale(item.value):
                # finished too long ago to be used now: give its sample back for a fresh group
                self._counts["requeued_stale"] += 1
                self._producer.requeue(item.index, item.sample)
                continue
            groups.append(item)
            if self.mode != "sync":
                self._producer.release()  # consumed: its slot refills while the batch fills
        end = self._producer.exhausted
        if not groups:
            raise StopAsyncIteration
        if not end and self.mode == "partial":
            self._producer.pause()  # no new group starts on weights about to be replaced
            for g in self._running.values():
                for ctx in g.ctxs:
                    ctx.preempt()
                    self._preempted.append(ctx)
        if self.mode == "sync":
            self._producer.release(len(groups))
        return self._batch(groups, final=end)

    def _too_stale(self, trajs: list[Trajectory]) -> bool:
        if self.max_staleness is None:
            return False
        now = self.generator.weight_version
        firsts = [t.min_weight_version for t in trajs if t.min_weight_version is not None]
        return bool(firsts) and now - min(firsts) > self.max_staleness

    def _batch(self, groups: list[Finished[list[Trajectory]]], *, final: bool) -> RolloutBatch:
        now = time.perf_counter()
        version = self.generator.weight_version
        trajs = [t for g in groups for t in g.value]
        lags: collections.Counter[int] = collections.Counter()
        for t in trajs:
            first = t.min_weight_version
            lags[0 if first is None else version - first] += 1
        ticks = max(1, self._ticks)
        stats = self._producer.statistics()
        metrics: dict[str, Any] = {
            "wall_s": now - self._last_yield,
            "groups": len(groups),
            "trajectories": len(trajs),
            "model_tokens": sum(t.num_model_tokens for t in trajs),
            "groups_in_flight_at_yield": stats.in_flight,
            "groups_buffered_at_yield": stats.buffered,
            "preempted": len(self._preempted),
            "staleness_histogram": dict(sorted(lags.items())),
            "busy_fraction": {s: self._busy[s] / ticks for s in (self._load() if self._load else {})},
            "mean_in_flight": self._in_flight_sum / ticks,
            "requeued_stale": self._counts["requeued_stale"],
            "filtered": self._counts["filtered"],
            "resumed_segments": sum(int(t.metrics.get("preemptions", 0)) for t in trajs),
        }
        self._last_yield = now
        self._ticks = 0
        self._in_flight_sum = 0
        self._busy.clear()
        batch = RolloutBatch(
            index=self._batch_index,
            groups=[g.value for g in groups],
            sample_indices=[g.index for g in groups],
            weight_version=version,
            metrics=metrics,
            final=final,
        )
        self._batch_index += 1
        return batch

    async def aclose(self) -> None:
        """Cancel every group still running and refuse reuse.  Idempotent."""
        for ctx in self._preempted:
            ctx.resume()
        self._preempted = []
        sampler, self._sampler = self._sampler, None
        try:
            await self._producer.aclose()
        finally:
            await cancel_and_wait(sampler)

    # -- one group ---------------------------------------------------------------------------------

    async def _run_group(self, index: int, sample: Any) -> list[Trajectory] | Any:
        group = _Group(index, sample)
        self._running[index] = group
        stale = False
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._run_one(group, k)) for k in range(self.n)]
        except* StalenessError:
            stale = True
        finally:
            self._running.pop(index, None)
        if stale:  # past its bound: the group starts afresh on current weights
            self._counts["requeued_stale"] += 1
            return REQUEUE
        trajs = [t.result() for t in tasks]
        if self.filter is not None:
            verdict = self.filter(trajs)
            keep = bool(await verdict) if isinstance(verdict, Awaitable) else bool(verdict)
            if not keep:
                self._counts["filtered"] += 1
                return DROP
        return trajs

    async def _run_one(self, group: _Group, k: int) -> Trajectory:
        ctx = RolloutContext(
            self.generator,
            session_id=f"g{group.index}-{k}-{uuid.uuid4().hex[:6]}",
            member=k,
            timeout=self.timeout,
            max_staleness=self.max_staleness,
            group_id=group.group_id if self.n > 1 else None,
        )
        group.ctxs.append(ctx)
        traj = await run_trajectory(self.agent, ctx, group.sample, reward=self.reward, sample_index=group.index)
        if traj.finish_reason == "stale":
            raise StalenessError(f"group {group.index} passed its staleness bound")
        return traj

    async def _sample_load(self) -> None:
        assert self._load is not None
        while True:
            await asyncio.sleep(0.02)
            self._ticks += 1
            for server_id, in_flight in self._load().items():
                if in_flight > 0:
                    self._busy[server_id] += 1
                self._in_flight_sum += in_flight
