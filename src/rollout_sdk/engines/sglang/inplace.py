"""Weight updates with requests paused in place, inside SGLang's scheduler process (issue 41, ``inflight="keep"``).

SGLang 0.5.16 can pause its scheduler "in place" (``PauseGenerationReqInput(mode="in_place")``): the running
batch keeps its KV and goes on decoding after ``continue_generation``, so an update between the two costs
no abort, no resubmission and no prefill.  What SGLang does not say is *where* each request's tokens
switched weights, and without that a result's per-token versions would be a guess.  Two facts make it
exact here:

* With the overlap scheduler, the batch launched last before the pause has sampled its tokens on the GPU
  but not yet appended them to the requests (that happens when the scheduler processes its result, after
  the resume).  Those tokens were sampled by the old weights.  The patched ``pause_generation`` processes
  that result at the pause (as the non-overlap loop would have) and marks it so the loop's own later
  ``process_batch_result`` skips it, then synchronizes the device: no forward of the old weights is still
  reading them when the update writes.
* It then records, for every request that holds KV in the scheduler (the running batch, the prefill batch
  just run, the request being prefilled in chunks), how many output tokens it has: exactly the tokens of
  the old weights.  Everything it samples after the resume is of the new weights.  Requests still in the
  waiting queue are not recorded (they hold no KV yet); the engine checkpoints those the old way.  Among
  them, those that already hold output tokens are requests SGLang *retracted* from a decode batch when its
  KV pool ran short (SGLang prefills them again, prompt and tokens, whether or not an update comes): the
  record names them (``retracted``), so the re-prefill they cost is not charged to the update.

The engine reads the record through ``get_internal_state`` (key :data:`KEY`; its presence says the patch
is in this scheduler).  It is applied by rollout-sdk's SGLang plugin (:mod:`.radix_patch`) in the
processes of engines that :class:`~rollout_sdk.engines.sglang.SglangEngine` starts; a scheduler that lacks
what it relies on is left as it is (a warning) and ``keep`` falls back to checkpoint and resubmit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["KEY", "apply", "finished", "snapshot", "waiting"]

log = logging.getLogger("rollout_sdk.engines.sglang")

#: the key of ``get_internal_state``'s answer:
#: ``{"pauses": n, "counts": {rid: output tokens} | None, "retracted": [rid of a queued request with tokens],
#: "finished": [rid of a request that ended in the batch processed at the pause], "queued": [rid waiting, no tokens]}``
KEY = "rollout_sdk_inplace"
_NEEDS = ("pause_generation", "process_batch_result", "get_internal_state")
_DONE = "_rollout_sdk_processed"  # set on a batch result processed at a pause
_MARK = "_rollout_sdk_inplace"  # set on a patched class


def snapshot(scheduler: Any) -> dict[str, int]:
    """Settle ``scheduler`` (paused, or about to be) and return ``{rid: output tokens}`` of every unfinished
    request that holds KV in it: the running batch, the last batch if it was a prefill, the chunked one."""
    queue = getattr(scheduler, "result_queue", None)
    if getattr(scheduler, "enable_overlap", False) and queue:
        batch, result = queue[0]
        if not getattr(result, _DONE, False):
            scheduler.process_batch_result(batch, result)
            setattr(result, _DONE, True)  # the loop pops it after the resume: processed once, not twice
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # nothing launched before the pause still reads the weights
    except Exception:  # pragma: no cover - a CPU build
        pass
    reqs: list[Any] = []
    running = getattr(scheduler, "running_batch", None)
    if running is not None:
        reqs += list(running.reqs)
    last = getattr(scheduler, "last_batch", None)
    if last is not None and last.forward_mode.is_extend():
        reqs += list(last.reqs)
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        reqs.append(chunked)
    return {r.rid: len(r.output_ids) for r in reqs if not r.finished()}


def finished(scheduler: Any) -> list[str]:
    """The rids of requests of ``scheduler``'s batches that have finished (their last output is on its way
    to the tokenizer side): neither held in place nor to be checkpointed."""
    reqs: list[Any] = []
    for name in ("running_batch", "last_batch"):
        batch = getattr(scheduler, name, None)
        if batch is not None:
            reqs += list(batch.reqs)
    return sorted({r.rid for r in reqs if r.finished()})


def waiting(scheduler: Any) -> tuple[list[str], list[str]]:
    """The rids of requests in ``scheduler``'s waiting queue: (retracted, queued).  Retracted: with output
    tokens, taken from a decode batch for KV memory, to be prefilled again (prompt and tokens) by SGLang itself;
    queued: none yet."""
    retracted: list[str] = []
    queued: list[str] = []
    for r in getattr(scheduler, "waiting_queue", None) or ():
        (retracted if getattr(r, "output_ids", None) else queued).append(r.rid)
    return retracted, queued


def _empty() -> dict[str, Any]:
    return {"pauses": 0, "counts": None, "retracted": [], "finished": [], "queued": []}


def apply(scheduler_cls: Any) -> bool:
    """Patch SGLang's ``Scheduler`` class in this process (idempotent); returns whether it is patched."""
    if scheduler_cls.__dict__.get(_MARK):
        return True
    missing = [name for name in _NEEDS if not hasattr(scheduler_cls, name)]
    if missing:
        log.warning("no in-place weight updates: SGLang's Scheduler lacks %s", ", ".join(missing))
        return False
    original_pause = scheduler_cls.pause_generation
    original_process = scheduler_cls.process_batch_result
    original_state = scheduler_cls.get_internal_state

    def pause_generation(self: Any, recv_req: Any) -> Any:
        if getattr(recv_req, "mode", None) == "in_place":
            record = self.__dict__.setdefault(KEY, _empty())
            record["pauses"] += 1
            try:
                record["counts"] = snapshot(self)
                record["retracted"], record["queued"] = waiting(self)
                record["finished"] = finished(self)
            except Exception:  # the engine sees counts=None and falls back; the scheduler goes on
                record["counts"], record["retracted"], record["finished"], record["queued"] = None, [], [], []
                log.exception("in-place pause: could not record the requests' tokens")
        return original_pause(self, recv_req)

    def process_batch_result(self: Any, batch: Any, result: Any) -> Any:
        if getattr(result, _DONE, False):
            return None  # processed at an in-place pause already
        return original_process(self, batch, result)

    def get_internal_state(self: Any, recv_req: Any) -> Any:
        out = original_state(self, recv_req)  # GetInternalStateReqOutput(internal_state=dict) in 0.5.16
        state = getattr(out, "internal_state", out)
        if isinstance(state, dict):
            record = self.__dict__.get(KEY) or _empty()
            state[KEY] = dict(record)  # msgpack-native
        return out

    scheduler_cls.pause_generation = pause_generation
    scheduler_cls.process_batch_result = process_batch_result
    scheduler_cls.get_internal_state = get_internal_state
    setattr(scheduler_cls, _MARK, True)
    return True
