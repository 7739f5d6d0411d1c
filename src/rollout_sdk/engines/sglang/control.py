"""The SGLang engine's control side: the gate, checkpoints, pause, memory and weight updates.

SGLang returns a request's tokens only when it ends and does not say where in a request the weights changed.
So a weight change happens in one of two ways, both exact.  *Checkpointed* (``inflight="reprefill"``, and
``keep`` where in place is not available): new requests wait at the *gate*, running ones are aborted inside
SGLang with their tokens so far kept and continued after the change as ``prompt + tokens so far`` with the
remaining budget, each part tagged with the version it ran on.  Under ``reprefill`` the continuation is
re-prefilled on the new weights (SGLang's ``retract``); under ``keep`` it goes on under the prefix-cache
namespace its KV was cached under and takes all but its last token from the cache.  *In place* (``keep`` where
our scheduler patch answers, inplace.py): SGLang pauses with its batch and KV kept, the patch records each
running request's tokens at the pause (the split point, exactly), the weights change and decoding resumes;
only requests still queued inside SGLang are checkpointed (:meth:`Control._update`).  ``kv_version_segments``
says which tokens were sampled from KV of older weights.  Every part carries its namespace as SGLang's
``extra_key``, a generation bumped at every weight change, so no new request reuses KV of older weights
(issue 41, :meth:`Control.kv_namespace`).  ``pause('retract')`` and ``pause('in_place')`` hold requests by
checkpoint (a pause has no weights to keep KV for); ``pause('abort')`` returns them.

Other traps handled here (docs/design.md, "SGLang inside our event loop"):

* ``flush_cache=True`` inside a weight update asserts in the scheduler (killing it) unless idle: updates
  go with ``flush_cache=False`` and a separate ``flush_cache`` call whose result is checked.
* Bumping the weight version never aborts in-flight requests (``abort_all_requests=False``).
* SGLang does not refuse a bad update: an unknown name is logged and skipped, a wrong shape fails half way
  through a bucket.  Every update is checked against the model's manifest (HF names and shapes, built from
  its config) first; a refused distributed update still receives the broadcast (the trainer is already
  sending) under names SGLang skips, so nothing loads and the group stays usable.
* ``release_memory_occupation`` asserts that the scheduler is idle: requests are held at the gate first.
* SGLang's control calls wait forever for a scheduler that died: each is raced against engine death.

Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from ..._aio import await_unless
from ...errors import EngineBusyError, EngineDeadError, UnsupportedOperationError, WeightUpdateError
from ...protocol import (
    InflightMode,
    InitWeightGroup,
    PauseMode,
    TensorMeta,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
)
from ...weights.ipc import sglang_bucket_payload
from ...weights.manifest import check_metas, hf_parameter_shapes
from .config import SglangEngineConfig
from .inplace import KEY

__all__ = ["Control", "Flight"]

log = logging.getLogger("rollout_sdk.engines.sglang")
T = TypeVar("T")


class Flight:
    """One request of ours: possibly several SGLang requests (parts), one per weight version."""

    __slots__ = (
        "held",
        "kv_epoch",
        "kv_key",
        "kv_version",
        "retracted",
        "sid",
        "slot",
        "splits",
        "task",
        "user_aborted",
        "wake",
    )

    def __init__(self) -> None:
        self.sid = ""
        #: the weight version its KV is cached under (its parts' ``extra_key``), and the reprefill epoch then
        self.kv_key: int | None = None
        self.kv_version = 0  # the weight version then
        self.kv_epoch = 0
        #: (output tokens of the running part, weight version from there on): in-place updates it ran across
        self.splits: list[tuple[int, int]] = []
        self.slot = False  # holds a place in the engine's decode window (engine.py)
        self.task: asyncio.Future[Any] | None = None
        self.held = False  # checkpointed: its abort result means "continue after the gate opens"
        #: checkpointed at an in-place pause while SGLang held it retracted (queued with tokens, no KV): its
        #: continuation's prefill is the retraction's cost, not the update's
        self.retracted = False
        self.user_aborted = False
        self.wake: asyncio.Future[None] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def wake_up(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


class Host(Protocol):
    """What the control side needs of its engine."""

    @property
    def config(self) -> SglangEngineConfig: ...
    @property
    def tm(self) -> Any: ...
    @property
    def dead(self) -> BaseException | None: ...
    @property
    def flights(self) -> dict[str, Flight]: ...
    @property
    def weight_version(self) -> int: ...
    def is_direct(self, sid: str) -> bool: ...
    async def wait_dead(self) -> BaseException: ...
    async def set_weight_version(self, version: int) -> None: ...
    def abort_part(self, sid: str) -> None: ...


class Control:
    """The gate and every control call of one :class:`~rollout_sdk.engines.sglang.SglangEngine`."""

    def __init__(self, host: Host) -> None:
        self._host = host
        # why new requests wait at the gate: "pause", "update", "release"; open when empty
        self.holds: set[str] = set()
        self.paused = False
        self.released: set[str] = set()
        self.groups: set[str] = set()
        self.manifest: dict[str, tuple[int, ...]] | None = None  # built at the first update
        self._manifest_tried = False
        #: bumped by every update with ``inflight="reprefill"``: a flight whose KV predates it re-keys
        self.reprefill_epoch = 0
        #: the prefix cache's namespace: bumped at every change of weights or version (an update without a
        #: version changes the weights too), so new requests never meet KV of older weights
        self.kv_generation = 0
        #: SGLang's scheduler pauses in place and records each request's tokens (inplace.py, our plugin):
        #: ``keep`` updates leave running requests decoding on their KV (probed at start; False: every
        #: update checkpoints and resubmits)
        self.inplace = False
        #: parts stopped inside SGLang and continued as new requests (checkpoints), and parts an update left
        #: running in place: what updates cost the requests in flight
        self.checkpointed = 0
        self.kept_in_place = 0
        #: of the checkpointed at in-place pauses: parts SGLang had retracted for KV memory (queued with
        #: tokens), which SGLang would prefill again anyway
        self.retracted = 0
        #: the last in-place update's phases (seconds): pause, record, checkpoint, load (weights, version,
        #: cache), resume; decoding stops from the pause's end to the resume's end
        self.phases: dict[str, float] = {}
        #: the last parts an in-place pause did not hold (sid, where SGLang had them): for diagnosis
        self.unheld: collections.deque[tuple[str, str]] = collections.deque(maxlen=256)
        #: one weight change at a time: control calls run concurrently, and two updates overlapping would
        #: open the gate (or resume SGLang) while the other still loads
        self._updating = asyncio.Lock()

    @property
    def _tm(self) -> Any:
        return self._host.tm

    # -- the gate ----------------------------------------------------------------------------------

    async def wait_gate(self, flight: Flight) -> None:
        """Return once the gate is open, the flight was aborted, or the engine died."""
        while self.holds and not flight.user_aborted and self._host.dead is None:
            flight.wake = asyncio.get_running_loop().create_future()
            try:
                await flight.wake
            finally:
                flight.wake = None

    def _hold(self, why: str) -> None:
        self.holds.add(why)

    def _open(self, why: str) -> None:
        self.holds.discard(why)
        if not self.holds:
            for flight in list(self._host.flights.values()):
                flight.wake_up()

    async def _checkpoint(self, *, hold: bool, skip: frozenset[str] = frozenset()) -> None:
        """Stop every running part inside SGLang (the gate is closed, so no new one starts) but those in
        ``skip`` (sids).  ``hold``: each continues from its tokens when the gate opens; otherwise each
        returns its partial tokens."""
        first = True
        while True:
            running = [f for f in self._host.flights.values() if f.running and f.sid not in skip]
            if not running:
                return
            if first and hold:
                self.checkpointed += len(running)
                first = False
            for f in running:
                f.held = hold and not f.user_aborted
                self._host.abort_part(f.sid)
            # an abort can miss a part SGLang has not registered yet: abort again until all have ended
            await self.call(asyncio.wait([f.task for f in running if f.task is not None], timeout=0.5))

    @contextlib.asynccontextmanager
    async def _quiesced(self) -> AsyncIterator[None]:
        """Nothing runs inside SGLang within: running parts are checkpointed and continue afterwards."""
        self._hold("update")
        try:
            await self._checkpoint(hold=True)
            yield
        finally:
            self._open("update")

    async def probe_inplace(self) -> bool:
        """Whether SGLang's scheduler has our in-place patch (inplace.py): its internal state says so."""
        states = await self.call(self._tm.get_internal_state())
        self.inplace = bool(states) and isinstance(states[0], dict) and KEY in states[0]
        return self.inplace

    @contextlib.asynccontextmanager
    async def _in_place(self) -> AsyncIterator[list[tuple[Flight, int]] | None]:
        """SGLang paused in place within: requests that hold KV in the scheduler stay in its batch and go on
        after the resume; yields each with its output tokens at the pause (the split point).  Those still
        queued inside SGLang (no KV yet) are checkpointed as in :meth:`_quiesced`.  Yields None for
        the block, where the split points cannot be had (the scheduler could not record them): the caller
        checkpoints instead, after SGLang resumes at the block's end."""
        from sglang.srt.managers.io_struct import (  # optional: sglang
            ContinueGenerationReqInput,
            PauseGenerationReqInput,
        )

        self._hold("update")
        paused = False
        mark = self._phase_clock()
        try:
            await self.call(self._tm.pause_generation(PauseGenerationReqInput(mode="in_place")))
            paused = True
            mark("pause")
            states = await self.call(self._tm.get_internal_state())
            mark("record")
            record = (states[0].get(KEY) or {}) if states and isinstance(states[0], dict) else {}
            counts = record.get("counts")
            if not isinstance(counts, dict):
                log.warning("SGLang could not record its requests at an in-place pause: checkpointing them")
                yield None
                return
            kept = [(f, counts[f.sid]) for f in self._host.flights.values() if f.running and f.sid in counts]
            retracted = set(record.get("retracted") or ())
            queued = set(record.get("queued") or ())
            ended = set(record.get("finished") or ())  # their last output is on its way: nothing to stop
            for f in self._host.flights.values():
                if f.running and f.sid not in counts and f.sid not in ended:
                    where = "retracted" if f.sid in retracted else "queued" if f.sid in queued else "absent"
                    self.unheld.append((f.sid, where))
                    if f.sid in retracted:
                        f.retracted = True
                        self.retracted += 1
            # queued ones hold no KV: aborted at once by the paused scheduler, continued after the gate opens
            await self._checkpoint(hold=True, skip=frozenset(f.sid for f, _ in kept) | ended)
            mark("checkpoint")
            yield kept
            mark("load")
        finally:
            if paused and self._host.dead is None:
                # no empty_cache: an update allocates little on the engine's side (IPC buckets are the
                # trainer's memory, broadcasts land in the parameters), and it would lengthen the pause
                await self.call(self._tm.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False)))
                mark("resume")
            self._open("update")

    def _phase_clock(self) -> Callable[[str], None]:
        """Time an in-place update's phases into :attr:`phases` (seconds, in order; cleared by :meth:`_update`)."""
        last = time.perf_counter()

        def mark(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            self.phases[name] = round(now - last, 4)
            last = now

        return mark

    async def _update(
        self, load: Callable[[], Awaitable[None]], version: int | None, flush_cache: bool, inflight: InflightMode
    ) -> None:
        """Run ``load`` (SGLang's weight calls) with nothing sampling meanwhile, then finish the update.
        ``keep`` where the scheduler can pause in place (:meth:`_in_place`) and every running part took the
        direct path (a request on the tokenizer manager's path waits for SGLang's pause inside the tokenizer
        manager, where no abort reaches it): running requests stay in SGLang's batch, nothing is aborted or
        prefilled again, and each records where its tokens switched weights.  Otherwise every running part
        is checkpointed (:meth:`_quiesced`)."""
        async with self._updating:
            self.phases = {}
            flights = self._host.flights.values()
            if inflight == "keep" and self.inplace and all(self._host.is_direct(f.sid) for f in flights if f.running):
                async with self._in_place() as kept:
                    if kept is not None:
                        await load()
                        await self._finish_update(version, flush_cache, inflight)
                        for flight, n in kept:
                            flight.splits.append((n, self._host.weight_version))
                        self.kept_in_place += len(kept)
                        return
            async with self._quiesced():
                await load()
                await self._finish_update(version, flush_cache, inflight)

    # -- the prefix cache's namespaces -------------------------------------------------------------

    def kv_namespace(self, flight: Flight, version: int) -> int | None:
        """Key ``flight``'s next part (``flight.kv_key``, sent as SGLang's ``extra_key``): the current
        namespace, except for a continuation whose KV a ``keep`` update left in place, which goes on under
        the namespace its KV was cached under; returns the weight version of that KV then (None otherwise).
        New requests never share a namespace with older weights, so none reuses their KV, flushed or not."""
        gen = self.kv_generation
        if flight.kv_key is not None and flight.kv_epoch == self.reprefill_epoch and flight.kv_key != gen:
            return flight.kv_version
        flight.kv_key, flight.kv_version, flight.kv_epoch = gen, version, self.reprefill_epoch
        return None

    # -- calls into SGLang -------------------------------------------------------------------------

    def require_alive(self) -> None:
        if self._host.dead is not None:
            raise EngineDeadError(str(self._host.dead))
        if self._tm is None:
            raise EngineDeadError("the SGLang engine has not started")

    async def call(self, coro: Awaitable[T]) -> T:
        """Await a tokenizer-manager control call, failing at once if the engine dies meanwhile: SGLang's
        own control calls wait forever for a scheduler that died."""
        self.require_alive()
        return await await_unless(coro, self._host.wait_dead(), error=lambda: EngineDeadError(str(self._host.dead)))

    # -- pause / memory ----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        self.require_alive()
        self._hold("pause")
        self.paused = True
        await self._checkpoint(hold=mode != "abort")

    async def resume(self) -> None:
        self.require_alive()
        self.paused = False
        self._open("pause")

    async def flush_cache(self) -> None:
        self.require_alive()
        out = await self.call(self._tm.flush_cache(timeout_s=60.0))
        if not getattr(out, "success", False):
            raise EngineBusyError(f"SGLang could not flush its cache: {getattr(out, 'message', out)}")

    async def release_memory(self, tags: Sequence[str] | None) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput  # optional: sglang

        self.require_alive()
        if not self._host.config.enable_memory_saver:
            raise UnsupportedOperationError("release_memory needs SglangEngineConfig(enable_memory_saver=True)")
        self._hold("release")  # new requests wait while memory is gone (SGLang asserts it is idle)
        running = sum(f.running for f in self._host.flights.values())
        if running:
            if not self.released:
                self._open("release")
            raise EngineBusyError(f"cannot release memory with {running} request(s) running (pause first)")
        wanted = list(tags or ("weights", "kv_cache"))
        todo = [t for t in wanted if t not in self.released]
        if "weights" in todo:
            todo.append("cuda_graph")  # SGLang keeps graphs apart; they go with the weights
        if todo:
            await self.call(self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=todo), None))
            self.released.update(todo)

    async def resume_memory(self, tags: Sequence[str] | None) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput  # optional: sglang

        self.require_alive()
        wanted = set(tags or ("weights", "kv_cache"))
        if "weights" in wanted:
            wanted.add("cuda_graph")
        todo = [t for t in ("cuda_graph", "weights", "kv_cache") if t in wanted and t in self.released]
        if todo:  # resuming a tag that was not released is fatal in SGLang: only what we released
            await self.call(self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=todo), None))
            self.released.difference_update(todo)
        if not self.released:
            self._open("release")

    # -- weights -----------------------------------------------------------------------------------

    async def init_weight_group(self, msg: InitWeightGroup) -> None:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput  # optional: sglang

        self.require_alive()
        ok, text = await self.call(
            self._tm.init_weights_update_group(
                InitWeightsUpdateGroupReqInput(
                    master_address=msg.master_address,
                    master_port=msg.master_port,
                    rank_offset=msg.rank_offset,
                    world_size=msg.world_size,
                    group_name=msg.group_name,
                    backend=msg.backend,
                ),
                None,
            )
        )
        if not ok:
            raise WeightUpdateError(f"SGLang could not join weight group {msg.group_name!r}: {text}", applied=False)
        self.groups.add(msg.group_name)

    async def _problems(self, buckets: list[list[TensorMeta]]) -> list[str]:
        """What the model's manifest refuses in this update (empty if the manifest cannot be built)."""
        model_path = self._host.config.model_path
        if self.manifest is None and not self._manifest_tried:
            self._manifest_tried = True
            try:
                self.manifest = await asyncio.to_thread(hf_parameter_shapes, model_path)
            except Exception as exc:  # an architecture transformers does not know: SGLang checks alone
                log.warning("no weight manifest for %s, updates are not pre-checked: %s", model_path, exc)
        if self.manifest is None:
            return []

        return check_metas(self.manifest, buckets)

    async def update_weights_distributed(self, msg: UpdateWeightsDistributed) -> None:
        self.require_alive()
        if msg.group_name not in self.groups:
            raise WeightUpdateError(f"no weight group {msg.group_name!r}: call init_weight_group first", applied=False)
        problems = await self._problems(msg.buckets)
        if problems:
            # the trainer is broadcasting already: receive every bucket under names SGLang skips, load nothing
            await self._receive_distributed(msg.group_name, _discarded(msg.buckets))
            raise WeightUpdateError("; ".join(problems), applied=False)
        await self._update(
            lambda: self._receive_distributed(msg.group_name, msg.buckets), msg.version, msg.flushes, msg.inflight
        )

    async def _receive_distributed(self, group_name: str, buckets: list[list[TensorMeta]]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput  # optional: sglang

        for i, bucket in enumerate(buckets):
            ok, text = await self.call(
                self._tm.update_weights_from_distributed(
                    UpdateWeightsFromDistributedReqInput(
                        names=[m.name for m in bucket],
                        dtypes=[m.dtype for m in bucket],
                        shapes=[list(m.shape) for m in bucket],
                        group_name=group_name,
                        load_format="flattened_bucket",
                        flush_cache=False,  # True asserts in the scheduler unless idle
                        abort_all_requests=False,
                    ),
                    None,
                )
            )
            _check_bucket(ok, text, i, len(buckets))

    async def update_weights_from_ipc(self, msg: UpdateWeightsFromIpc) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput  # optional: sglang

        self.require_alive()
        tp_size = self._host.config.tp_size
        if tp_size > 1:
            # each TP rank must map a bucket on its own GPU; one handle (one GPU) for all ranks kills the
            # scheduler with a CUDA error (seen on the H200s)
            raise WeightUpdateError(
                f"colocated (IPC) updates need one CUDA handle per TP rank and this engine has "
                f"tp_size={tp_size}: use method='distributed'",
                applied=False,
            )
        if len(msg.handles) != len(msg.buckets):
            raise WeightUpdateError(f"{len(msg.handles)} handles for {len(msg.buckets)} buckets", applied=False)
        problems = await self._problems(msg.buckets)
        if problems:
            raise WeightUpdateError("; ".join(problems), applied=False)
        # every handle is checked (allowlisted storage class and dtypes) before any bucket is applied
        payloads = [sglang_bucket_payload(h, b) for h, b in zip(msg.handles, msg.buckets, strict=True)]

        async def load() -> None:
            for i, payload in enumerate(payloads):
                ok, text = await self.call(
                    self._tm.update_weights_from_tensor(
                        UpdateWeightsFromTensorReqInput(
                            serialized_named_tensors=[payload] * tp_size,
                            load_format="flattened_bucket",
                            flush_cache=False,
                            abort_all_requests=False,
                        ),
                        None,
                    )
                )
                _check_bucket(ok, text, i, len(msg.buckets))

        await self._update(load, msg.version, msg.flushes, msg.inflight)

    async def _finish_update(self, version: int | None, flush_cache: bool, inflight: InflightMode) -> None:
        """The weights changed (quiesced: nothing runs inside SGLang).  ``reprefill``: every held request
        continues under the new version's key, so it re-prefills on the new weights; ``keep``: it continues
        under its old key and takes its KV from the cache (kv_namespace).  Either way new requests use the
        new key: nothing needs flushing for correctness, ``flush_cache`` only frees the old KV early."""
        self.kv_generation += 1
        if inflight == "reprefill":
            self.reprefill_epoch += 1
        if flush_cache:
            await self.flush_cache()
        if version is not None:
            await self._host.set_weight_version(version)

    async def destroy_weight_group(self, group_name: str) -> None:
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput  # optional: sglang

        if group_name in self.groups and self._tm is not None and self._host.dead is None:
            ok, text = await self.call(
                self._tm.destroy_weights_update_group(DestroyWeightsUpdateGroupReqInput(group_name=group_name), None)
            )
            if not ok:
                raise WeightUpdateError(f"SGLang could not leave weight group {group_name!r}: {text}")
        self.groups.discard(group_name)


def _check_bucket(ok: bool, msg: str, i: int, n: int) -> None:
    """A bucket that passed the manifest check and still failed may have loaded in part (SGLang loads tensor
    by tensor and says so): the engine is then half updated."""
    if not ok:
        raise WeightUpdateError(f"SGLang failed bucket {i + 1}/{n}: {msg}", applied=None)


def _discarded(buckets: list[list[TensorMeta]]) -> list[list[TensorMeta]]:
    """The same buckets (dtypes, shapes: the same bytes on the wire) under names no model has: SGLang's
    ``load_weights`` logs and skips unknown names, so receiving them loads nothing."""
    return [
        [TensorMeta(name=f"rollout_sdk_discarded_{i}_{k}", dtype=m.dtype, shape=m.shape) for k, m in enumerate(b)]
        for i, b in enumerate(buckets)
    ]
