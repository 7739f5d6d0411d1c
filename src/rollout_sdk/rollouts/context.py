"""The context one trajectory runs in: generate with its session's affinity, its seeds and preemption.

A context belongs to one trajectory: member ``member`` of its group.  Its n-th model call is turn n;
a seeded request gets ``sample_seed(seed, member=member, turn=n)`` and each resumption after a
preemption the next segment (:mod:`.seeds`).  With a ``group_id``, the first turn (the prompt every member
of the group shares) carries it: the group is placed together and its prompt prefilled once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import msgspec

from ..errors import StalenessError
from ..protocol import GenerateRequest, GenerateResult, Lifecycle, RoutedExperts, SamplingParams, SessionHint
from .continuation import Continuation
from .generator import USE_CLIENT_DEFAULT, Generator, UseClientDefault
from .seeds import sample_seed
from .trajectory import Trajectory

__all__ = ["RolloutContext"]

log = logging.getLogger("rollout_sdk.rollouts")


class RolloutContext:
    """What an agent loop may do: generate (with its session's affinity), and know the weight version.

    A streaming producer may *preempt* a trajectory (partial mode): its request in flight is aborted, the
    context parks it, and once resumed continues the same turn from the tokens it had (on newer weights),
    so the agent sees one turn whose ``version_segments`` span the update.
    """

    def __init__(
        self,
        generator: Generator,
        *,
        session_id: str | None = None,
        member: int = 0,
        timeout: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        max_staleness: int | None = None,
        return_routed_experts: bool = False,
        group_id: str | None = None,
    ) -> None:
        if member < 0:
            raise ValueError(f"member must be >= 0, got {member}")
        self.generator = generator
        self.member = member
        self.session_id = session_id or uuid.uuid4().hex
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.return_routed_experts = return_routed_experts
        self.group_id = group_id
        #: one per engine call, in order: when and where each ran (exported with the trajectory)
        self.lifecycles: list[Lifecycle] = []
        #: one per engine call when ``return_routed_experts``: the MoE experts of its tokens
        self.routed_experts: list[RoutedExperts] = []
        self.first_version: int | None = None
        self.current_rid: str | None = None
        self.preemptions = 0
        self._gate = asyncio.Event()
        self._gate.set()
        self._calls = 0

    @property
    def client(self) -> Generator:
        """The generator (usually the RolloutClient) this context generates with."""
        return self.generator

    def _check_staleness(self) -> None:
        if self.max_staleness is not None and self.first_version is not None:
            lag = self.generator.weight_version - self.first_version
            if lag > self.max_staleness:
                raise StalenessError(
                    f"trajectory started on weights v{self.first_version}; v{self.generator.weight_version} is "
                    f"{lag} versions later (max_staleness={self.max_staleness})"
                )

    def preempt(self) -> bool:
        """Hold this trajectory: abort its request in flight (it resumes after :meth:`resume`)."""
        self._gate.clear()
        rid = self.current_rid
        return rid is not None and self.generator.abort(rid)

    def resume(self) -> None:
        self._gate.set()

    @property
    def parked(self) -> bool:
        return not self._gate.is_set()

    async def hint(self, *, wait_s: float | None = None, ended: bool = False) -> None:
        """Tell the engine what this session does next (``keep_kv_s``, docs/agents.md): it waits on a tool
        for about ``wait_s`` seconds, or it ``ended`` (its kept KV is released now).  Advisory: a generator
        without session hints ignores it, and a failed hint costs memory, never the trajectory."""
        send = getattr(self.generator, "session_hints", None)
        if send is None or not self._calls:
            return
        hint = SessionHint(session_id=self.session_id, wait_s=wait_s, ended=ended)  # bad values raise here
        try:
            await send([hint])
        except Exception:  # a closed client, a lost server: the engine's lease ends it instead
            log.debug("session hint not delivered", exc_info=True)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        images: Sequence[bytes] = (),
        *,
        keep_kv_s: float | None = None,
    ) -> GenerateResult:
        """One model turn.  Refuses (StalenessError) to extend a trajectory past its staleness bound.
        ``images``: the images ``input_ids`` marks, in order (vision-language models).  ``keep_kv_s``:
        another turn may follow (a tool call): the engine keeps this session's KV that long after the turn
        (``GenerateRequest.keep_kv_s``); end it early with :meth:`hint`."""
        self._calls += 1
        if sampling.seed is not None:
            seed = sample_seed(sampling.seed, member=self.member, turn=self._calls - 1)
            sampling = msgspec.structs.replace(sampling, seed=seed)
        req = GenerateRequest(
            input_ids=input_ids,
            sampling=sampling,
            session_id=self.session_id,
            rid=f"{self.session_id}.{self._calls}",
            return_routed_experts=self.return_routed_experts,
            images=list(images),
            group_id=self.group_id if self._calls == 1 else None,  # later turns diverge per member
            keep_kv_s=keep_kv_s,
        )
        cont = Continuation(req)
        segment = 0
        while True:
            await self._gate.wait()
            self._check_staleness()
            nxt = cont.next_request()
            if not nxt.rid:
                segment += 1
                nxt = msgspec.structs.replace(nxt, rid=f"{req.rid}.{segment}")
            self.current_rid = nxt.rid
            try:
                result = await self.generator.generate(nxt, timeout=self.timeout)
            finally:
                self.current_rid = None
            cont.add(result)
            if result.lifecycle is not None:
                self.lifecycles.append(result.lifecycle)
            if result.routed_experts is not None:
                self.routed_experts.append(result.routed_experts)
            if self.first_version is None and result.output_ids:
                segs = result.version_segments
                self.first_version = segs[0][0] if segs else result.weight_version
            if result.finish_reason == "abort" and self.parked and cont.remaining > 0:
                self.preemptions += 1
                continue  # preempted by the producer: wait, then continue from the tokens so far
            return cont.result()

    def finish(self, traj: Trajectory) -> Trajectory:
        """Attach what this context recorded (lifecycles, routed experts) to the agent's trajectory."""
        if not traj.lifecycles:
            traj.lifecycles = list(self.lifecycles)
        if not traj.routed_experts:
            traj.routed_experts = list(self.routed_experts)
        return traj
