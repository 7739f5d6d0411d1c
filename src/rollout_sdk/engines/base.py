"""The Engine interface every backend implements (CPU transformers, SGLang, the test fakes).

An engine lives inside one server process, on that server's event loop.  The server calls:

* ``await engine.start()`` once, ``await engine.close()`` once (also usable as ``async with engine``);
* ``await engine.generate(req)`` once per request, concurrently; it returns a :class:`GenerateResult`
  whatever happens to the request (``finish_reason='abort'`` with the tokens so far when aborted) and
  raises :class:`EngineDeadError` only when the engine itself died;
* ``engine.abort(rid)`` (sync, idempotent, unknown rids ignored) to cut one request short;
* ``engine.load()`` for live load (cheap, sync, called on every heartbeat), ``engine.progress()`` for the
  stall detector;
* ``engine.step_listener`` (set by the server where ``reports_steps``): the backend calls it, through
  :meth:`Engine._stepped`, with the rids of the ``probation`` requests whose admitting step has just ended,
  before it admits the next step's requests, and yields to the event loop once before that admission when
  the listener asks for it (it handed the engine another probation request: server.py, "Probation");
* the lifecycle hooks below, which a backend may leave unsupported (they raise
  :class:`UnsupportedOperationError`).

No method may block the event loop: model work runs in a thread or another process.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import UnsupportedOperationError
from ..protocol import (
    EngineLimits,
    GenerateRequest,
    GenerateResult,
    InflightMode,
    InitWeightGroup,
    PauseMode,
    SessionHint,
    Timings,
    UpdateWeightsDistributed,
    UpdateWeightsFromIpc,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "EngineLoad", "Gate", "NamedTensors", "prompt_score_result"]

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]


def prompt_score_result(
    req: GenerateRequest,
    prompt_logprobs: list[float],
    *,
    weight_version: int,
    queue_s: float,
    total_s: float,
    vision: Any = None,
) -> GenerateResult:
    """A score request's result, whichever engine scored it: no output (so no first token), the logprobs of
    the prompt (the expanded one when it has images, with the expansion's fields), the weights they came
    from."""
    prompt = req.input_ids if vision is None else vision.input_ids
    return GenerateResult(
        rid=req.rid,
        output_ids=[],
        finish_reason="stop",
        prompt_tokens=len(prompt),
        weight_version=weight_version,
        prompt_logprobs=prompt_logprobs,
        timings=Timings(queue_s=queue_s, total_s=total_s),
        **(vision.result_fields() if vision is not None else {}),
    )


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Live load and capacity of an engine (carried in every Pong as :class:`~rollout_sdk.protocol.ServerStats`).

    ``running``: requests being decoded; ``queued``: requests accepted and waiting for a slot;
    ``queued_tokens``: tokens those waiting requests hold; ``max_running_requests``: the most requests the
    engine decodes at once (None: no fixed limit); ``kv_capacity_tokens``: tokens its KV pool holds (None:
    the cache grows on demand, as in the CPU engine); ``kv_used_tokens``: tokens the KV cache holds now;
    ``kv_usage``: ``kv_used_tokens / kv_capacity_tokens`` where the engine knows it.  An idle engine reports
    zero running, zero queued.
    """

    running: int = 0
    queued: int = 0
    queued_tokens: int = 0
    kv_usage: float | None = None
    max_running_requests: int | None = None
    kv_capacity_tokens: int | None = None
    kv_used_tokens: int | None = None


class Gate:
    """What an engine's steps and new work wait on: open unless some reason holds it (``"pause"``, a
    ``"memory"`` release).  Used from the engine's event loop only."""

    def __init__(self) -> None:
        self._reasons: set[str] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._waiting = 0

    @property
    def num_waiting(self) -> int:
        """Tasks waiting for the gate to open now (the step loop parked at it, held new work): what a test
        waits for to know that nothing can move until the gate opens."""
        return self._waiting

    @property
    def is_open(self) -> bool:
        return not self._reasons

    def holds(self, reason: str) -> bool:
        return reason in self._reasons

    def hold(self, reason: str) -> None:
        self._reasons.add(reason)
        self._open.clear()

    def release(self, reason: str) -> bool:
        """Drop ``reason``; True when that leaves the gate open."""
        self._reasons.discard(reason)
        if not self._reasons:
            self._open.set()
        return not self._reasons

    async def wait(self) -> None:
        self._waiting += 1
        try:
            await self._open.wait()
        finally:
            self._waiting -= 1


class Engine(abc.ABC):
    """Base class of every backend.  See the module docstring for the contract."""

    #: short backend name reported in ServerInfo ("cpu", "sglang", "fake")
    backend: str = "engine"
    #: ``GenerateRequest.score_only`` (prompt logprobs without generating); the server refuses it otherwise
    supports_score: bool = False
    #: ``GenerateRequest.return_routed_experts`` (MoE routing replay); the server refuses it otherwise
    supports_routed_experts: bool = False
    #: the backend calls ``step_listener`` (module docstring) when a probation request has been through a
    #: step; the server paces probation requests only then (SGLang answers only when a request ends: no)
    reports_steps: bool = False

    def __init__(self) -> None:
        self._dead: BaseException | None = None
        self._dead_event = asyncio.Event()
        self._weight_version = 0
        #: called with the rids of probation requests whose admitting step ended; returns True when the
        #: engine should let the event loop run once before its next admission (server.py, "Probation")
        self.step_listener: Callable[[list[str]], bool] | None = None

    def _stepped(self, rids: list[str]) -> bool:
        """Report probation requests that have been through a step (module docstring); True: the backend
        yields to the event loop once (``await asyncio.sleep(0)``) before it admits its next step."""
        listener = self.step_listener
        return bool(rids) and listener is not None and listener(rids)

    # -- lifecycle ---------------------------------------------------------------------------------

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start background work.  Raises EngineStartupError on failure."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop background work and free resources.  Idempotent."""

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- identity ----------------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def limits(self) -> EngineLimits:
        """Vocabulary size, context length, EOS ids (valid after start)."""

    @property
    def model_name(self) -> str:
        return "?"

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def tp_size(self) -> int:
        """GPUs (ranks) this engine spans: its members in a weight-update group."""
        return 1

    # -- health --------------------------------------------------------------------------------------

    @property
    def dead(self) -> BaseException | None:
        """Why the engine died, or None while it is alive."""
        return self._dead

    def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
            self._dead_event.set()

    async def wait_dead(self) -> BaseException:
        """Return when the engine dies, with the reason.  Never returns for a healthy engine."""
        await self._dead_event.wait()
        assert self._dead is not None
        return self._dead

    # -- requests ------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Run one request to completion (or abort)."""

    @abc.abstractmethod
    def abort(self, rid: str) -> None:
        """Cut one request short; its ``generate`` returns an abort result.  Unknown rids are ignored."""

    def abort_all(self) -> None:
        for rid in list(self.running_rids()):
            self.abort(rid)

    @abc.abstractmethod
    def running_rids(self) -> Sequence[str]:
        """The rids this engine holds now (running or queued)."""

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    def progress(self) -> int | None:
        """A counter that grows with the tokens the engine decodes (running requests included), for the
        server's stall detector (server/stall.py); None where the engine cannot tell.  Cheap and sync."""
        return None

    def prefill_progress(self) -> int | None:
        """A counter of the prompt tokens the engine has prefilled (cache hits not counted), or None.  The
        stall detector compares a window only with earlier windows of a similar prefill share: a CPU step
        that prefills a batch of next turns decodes far fewer tokens per second than a decode step, and is
        work, not a stall.  Cheap and sync."""
        return None

    # -- lifecycle hooks for trainers (optional) ---------------------------------------------------------

    def _unsupported(self, what: str) -> UnsupportedOperationError:
        return UnsupportedOperationError(f"{what} is not supported by the {self.backend!r} engine")

    async def pause(self, mode: PauseMode = "abort") -> None:
        raise self._unsupported("pause")

    async def resume(self) -> None:
        raise self._unsupported("resume")

    @property
    def paused(self) -> bool:
        return False

    async def flush_cache(self) -> None:
        raise self._unsupported("flush_cache")

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        raise self._unsupported("release_memory")

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        raise self._unsupported("resume_memory")

    async def set_weight_version(self, version: int) -> None:
        self._weight_version = version

    def session_hints(self, hints: Sequence[SessionHint]) -> None:
        """Advisory (agent sessions, ``GenerateRequest.keep_kv_s``): a session ended, or waits on a tool for
        about ``wait_s``.  Engines that keep no session KV ignore them."""
        return None

    async def update_weights(
        self, named: NamedTensors, *, version: int | None = None, inflight: InflightMode = "reprefill"
    ) -> None:
        """Load tensors already in this process (all-or-nothing).  ``inflight``: what happens to requests in
        flight (protocol.InflightMode): re-prefilled on the new weights, or kept on their KV."""
        raise self._unsupported("update_weights")

    async def init_weight_group(self, msg: InitWeightGroup) -> None:
        """Join the trainer's weight-update process group (the wire message, as received)."""
        raise self._unsupported("init_weight_group")

    async def update_weights_distributed(self, msg: UpdateWeightsDistributed) -> None:
        """Receive ``msg.buckets`` by broadcast from the group's rank 0 and load them."""
        raise self._unsupported("update_weights_distributed")

    async def update_weights_from_ipc(self, msg: UpdateWeightsFromIpc) -> None:
        """Load buckets shared by CUDA IPC handles (colocated trainer)."""
        raise self._unsupported("update_weights_from_ipc")

    async def destroy_weight_group(self, group_name: str) -> None:
        raise self._unsupported("destroy_weight_group")
