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

Concurrency::

    producer task (owned by the client) ── TaskGroup ── one task per group ── n trajectory coroutines
      waits on: `room` (a group slot: in flight < target; in sync mode a slot frees only when its group
                is yielded)                              agent.run(ctx, sample) / one generate
      pulls the next sample: re-queued ones first (a stale group gives its sample back), then the source
    finished groups ─▶ reward (as each trajectory finishes) ─▶ filter ─▶ `done` queue
    consumer (__anext__) takes batch_groups groups from `done`; partial mode preempts the rest first
      and resumes them when it is called again
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
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._aio import cancel_and_wait, first_exception, iterate
from .agents.loop import Agent, RewardFn, RolloutContext, _reward
from .agents.trajectory import Trajectory
from .errors import ConfigError, StalenessError
from .protocol import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from .client import RolloutClient

__all__ = ["GenerateAgent", "RolloutBatch", "RolloutStream"]

GroupFilter = Callable[[list[Trajectory]], "bool | Awaitable[bool]"]


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


class RolloutStream:
    """Returned by :meth:`RolloutClient.rollouts`; see the module docstring."""

    def __init__(
        self,
        client: RolloutClient,
        source: Iterable[Any] | AsyncIterable[Any],
        *,
        agent: Agent | None,
        sampling: SamplingParams | None,
        group_size: int,
        batch_groups: int,
        mode: str,
        over_provision: float,
        max_staleness: int | None,
        reward: RewardFn | None,
        filter: GroupFilter | None,
        timeout: float | None,
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
        self.client = client
        self.agent = agent or GenerateAgent(sampling)
        self.source = source
        self.n = group_size
        self.batch_groups = batch_groups
        self.mode = mode
        self.target = batch_groups if mode == "sync" else math.ceil(batch_groups * over_provision)
        self.max_staleness = max_staleness
        self.reward = reward
        self.filter = filter
        self.timeout = timeout
        self._room = asyncio.Semaphore(self.target)
        self._done: asyncio.Queue[tuple[_Group, list[Trajectory]] | BaseException | None] = asyncio.Queue()
        self._requeue: collections.deque[tuple[int, Any]] = collections.deque()
        self._running: dict[int, _Group] = {}
        self._task: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._finished = False
        self._source_done = False
        self._batch_index = 0
        self._last_yield = time.perf_counter()
        self._preempted: list[RolloutContext] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._busy: collections.Counter[str] = collections.Counter()
        self._ticks = 0
        self._in_flight_sum = 0
        self._requeued = asyncio.Event()
        self._gen_gate = asyncio.Event()
        self._gen_gate.set()

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
        if self._task is None:
            self._task = self.client._own(self._produce(), name="rollouts")
            self._sampler = self.client._own(self._sample_load(), name="rollouts-load")

    async def __anext__(self) -> RolloutBatch:
        if self._finished:
            raise StopAsyncIteration
        self._start()
        for ctx in self._preempted:  # partial mode: the consumer is done with the last batch
            ctx.resume()
        self._preempted = []
        self._gen_gate.set()
        groups: list[tuple[_Group, list[Trajectory]]] = []
        while len(groups) < self.batch_groups and not self._exhausted():
            item = await self._done.get()
            if item is None:
                continue  # an end-of-work mark: _exhausted() says whether it still holds
            if isinstance(item, BaseException):
                self._finished = True
                raise item
            group, trajs = item
            if self._too_stale(trajs):
                # finished too long ago to be used now: give its sample back for a fresh group
                self._counts["requeued_stale"] += 1
                self._give_back(group)
                self._release_slot_if_sync()
                continue
            groups.append(item)
        end = self._exhausted()
        if not groups:
            self._finished = True
            raise StopAsyncIteration
        if end:
            self._finished = True
        elif self.mode == "partial":
            self._gen_gate.clear()  # no new group starts on weights about to be replaced
            for g in self._running.values():
                for ctx in g.ctxs:
                    ctx.preempt()
                    self._preempted.append(ctx)
        if self.mode == "sync":
            for _ in groups:
                self._room.release()
        return self._batch(groups, final=end)

    def _exhausted(self) -> bool:
        """Nothing more will ever finish: the source is empty and no group runs, waits or is re-queued."""
        return self._source_done and not self._running and not self._requeue and self._done.empty()

    def _give_back(self, group: _Group) -> None:
        self._requeue.append((group.index, group.sample))
        self._requeued.set()

    def _release_slot_if_sync(self) -> None:
        if self.mode == "sync":
            self._room.release()

    def _too_stale(self, trajs: list[Trajectory]) -> bool:
        if self.max_staleness is None:
            return False
        now = self.client.weight_version
        firsts = [t.min_weight_version for t in trajs if t.min_weight_version is not None]
        return bool(firsts) and now - min(firsts) > self.max_staleness

    def _batch(self, groups: list[tuple[_Group, list[Trajectory]]], *, final: bool) -> RolloutBatch:
        now = time.perf_counter()
        version = self.client.weight_version
        trajs = [t for _, ts in groups for t in ts]
        lags: collections.Counter[int] = collections.Counter()
        for t in trajs:
            first = t.min_weight_version
            lags[0 if first is None else version - first] += 1
        servers = [s.server_id for s in self.client.servers]
        ticks = max(1, self._ticks)
        metrics: dict[str, Any] = {
            "wall_s": now - self._last_yield,
            "groups": len(groups),
            "trajectories": len(trajs),
            "model_tokens": sum(t.num_model_tokens for t in trajs),
            "groups_in_flight_at_yield": len(self._running),
            "preempted": len(self._preempted),
            "staleness_histogram": dict(sorted(lags.items())),
            "busy_fraction": {s: self._busy[s] / ticks for s in servers},
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
            groups=[ts for _, ts in groups],
            sample_indices=[g.index for g, _ in groups],
            weight_version=version,
            metrics=metrics,
            final=final,
        )
        self._batch_index += 1
        return batch

    async def aclose(self) -> None:
        self._finished = True
        for ctx in self._preempted:
            ctx.resume()
        for task in (self._task, self._sampler):
            await cancel_and_wait(task)

    # -- producer side -----------------------------------------------------------------------------

    async def _produce(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                it = iterate(self.source)
                index = 0
                while True:
                    await self._gen_gate.wait()
                    await self._room.acquire()
                    if not self._requeue and not self._source_done:
                        try:
                            sample = await anext(it)
                        except StopAsyncIteration:
                            self._source_done = True
                            self._mark_if_done()
                        else:
                            idx, index = index, index + 1
                            self._start_group(tg, idx, sample)
                            continue
                    while not self._requeue:  # only re-queued samples are left: wait for one
                        self._requeued.clear()
                        await self._requeued.wait()
                    idx, sample = self._requeue.popleft()
                    self._start_group(tg, idx, sample)
        except asyncio.CancelledError:
            raise
        except BaseExceptionGroup as eg:
            self._done.put_nowait(first_exception(eg))
        except BaseException as exc:
            self._done.put_nowait(exc)

    def _start_group(self, tg: asyncio.TaskGroup, idx: int, sample: Any) -> None:
        group = _Group(idx, sample)
        self._running[idx] = group
        tg.create_task(self._run_group(group))

    def _mark_if_done(self) -> None:
        if self._source_done and not self._running and not self._requeue:
            self._done.put_nowait(None)  # wakes a consumer waiting for groups that will never come

    async def _run_group(self, group: _Group) -> None:
        stale = False
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._run_one(group, k)) for k in range(self.n)]
        except* StalenessError:
            stale = True
        self._running.pop(group.index, None)
        if stale:  # past its bound: the group starts afresh on current weights
            self._counts["requeued_stale"] += 1
            self._give_back(group)
            self._room.release()
            return
        trajs = [t.result() for t in tasks]
        keep = True
        if self.filter is not None:
            verdict = self.filter(trajs)
            keep = bool(await verdict) if isinstance(verdict, Awaitable) else bool(verdict)
        if keep:
            self._done.put_nowait((group, trajs))
        else:
            self._counts["filtered"] += 1
        if self.mode != "sync" or not keep:
            self._room.release()
        self._mark_if_done()

    async def _run_one(self, group: _Group, k: int) -> Trajectory:
        ctx = RolloutContext(
            self.client,
            session_id=f"g{group.index}-{k}-{uuid.uuid4().hex[:6]}",
            timeout=self.timeout,
            max_staleness=self.max_staleness,
        )
        group.ctxs.append(ctx)
        traj = ctx.finish(await self.agent.run(ctx, group.sample))
        if traj.finish_reason == "stale":
            raise StalenessError(f"group {group.index} passed its staleness bound")
        traj.sample_index = group.index
        if self.reward is not None:
            traj.reward = await _reward(self.reward, traj, group.sample)
        return traj

    async def _sample_load(self) -> None:
        while True:
            await asyncio.sleep(0.02)
            self._ticks += 1
            for s in self.client.servers:
                if s.in_flight > 0:
                    self._busy[s.server_id] += 1
                self._in_flight_sum += s.in_flight
