"""The context a rollout runs in: generate with its session's affinity, seeds and preemption."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

import msgspec

from ..errors import StalenessError
from ..protocol import GenerateRequest, GenerateResult, SamplingParams
from .continuation import Continuation

if TYPE_CHECKING:
    from ..client import RolloutClient

__all__ = ["RolloutContext"]


class RolloutContext:
    """What an agent loop may do: generate (with its session's affinity), and know the weight version.

    A streaming producer may *preempt* a trajectory (partial mode): its request in flight is aborted, the
    context parks it, and once resumed continues the same turn from the tokens it had (on newer weights),
    so the agent sees one turn whose ``version_segments`` span the update.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        session_id: str | None = None,
        timeout: float | None = None,
        max_staleness: int | None = None,
    ) -> None:
        self.client = client
        self.session_id = session_id or uuid.uuid4().hex
        self.timeout = timeout
        self.max_staleness = max_staleness
        self.first_version: int | None = None
        self.current_rid: str | None = None
        self.preemptions = 0
        self._gate = asyncio.Event()
        self._gate.set()
        self._calls = 0
        #: added to a seeded request's seed, with the turn number, so samples and turns differ
        self.seed_offset = 0

    def _check_staleness(self) -> None:
        if self.max_staleness is not None and self.first_version is not None:
            lag = self.client.weight_version - self.first_version
            if lag > self.max_staleness:
                raise StalenessError(
                    f"trajectory started on weights v{self.first_version}; v{self.client.weight_version} is "
                    f"{lag} versions later (max_staleness={self.max_staleness})"
                )

    def preempt(self) -> bool:
        """Hold this trajectory: abort its request in flight (it resumes after :meth:`resume`)."""
        self._gate.clear()
        rid = self.current_rid
        return rid is not None and self.client.abort(rid)

    def resume(self) -> None:
        self._gate.set()

    @property
    def parked(self) -> bool:
        return not self._gate.is_set()

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateResult:
        """One model turn.  Refuses (StalenessError) to extend a trajectory past its staleness bound."""
        self._calls += 1
        if sampling.seed is not None:
            seed = (sampling.seed + self.seed_offset + 7919 * (self._calls - 1)) % (2**63 - 1)
            sampling = msgspec.structs.replace(sampling, seed=seed)
        req = GenerateRequest(
            input_ids=input_ids, sampling=sampling, session_id=self.session_id, rid=f"{self.session_id}.{self._calls}"
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
                result = await self.client.generate(nxt, timeout=self.timeout)
            finally:
                self.current_rid = None
            cont.add(result)
            if self.first_version is None and result.output_ids:
                segs = result.version_segments
                self.first_version = segs[0][0] if segs else result.weight_version
            if result.finish_reason == "abort" and self.parked and cont.remaining > 0:
                self.preemptions += 1
                continue  # preempted by the producer: wait, then continue from the tokens so far
            return cont.result()
