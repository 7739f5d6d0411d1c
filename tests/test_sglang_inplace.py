"""The scheduler side of in-place weight updates (engines/sglang/inplace.py) on a model of SGLang 0.5.16's
overlap loop: the batch launched last before the pause has sampled tokens the requests do not hold yet;
the patch appends them at the pause, exactly once, and records every request's tokens there."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rollout_sdk.engines.sglang import inplace


@dataclass
class Req:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    done: bool = False

    def finished(self) -> bool:
        return self.done


@dataclass
class Mode:
    extend: bool

    def is_extend(self) -> bool:
        return self.extend


@dataclass
class Batch:
    reqs: list[Req]
    forward_mode: Mode = field(default_factory=lambda: Mode(False))


@dataclass
class Result:
    """What the GPU sampled for each request of a batch (appended when the result is processed)."""

    tokens: dict[str, int]
    finishes: set[str] = field(default_factory=set)


@dataclass
class Out:
    internal_state: dict[str, Any]


def scheduler_class() -> type:
    class Scheduler:
        def __init__(self, overlap: bool = True) -> None:
            self.enable_overlap = overlap
            self.result_queue: deque[tuple[Batch, Result]] = deque()
            self.running_batch = Batch([])
            self.last_batch: Batch | None = None
            self.chunked_req: Req | None = None
            self.waiting_queue: list[Req] = []
            self.paused = False
            self.processed = 0

        def pause_generation(self, recv_req: Any) -> None:
            self.paused = True

        def process_batch_result(self, batch: Batch, result: Result) -> None:
            self.processed += 1
            for r in batch.reqs:
                if not r.finished() and r.rid in result.tokens:
                    r.output_ids.append(result.tokens[r.rid])
                    r.done = r.rid in result.finishes

        def get_internal_state(self, recv_req: Any) -> Out:
            return Out({"model_path": "m"})

        def pop_and_process(self) -> None:  # the overlap loop's closure, after the resume
            batch, result = self.result_queue.popleft()
            self.process_batch_result(batch, result)

    assert inplace.apply(Scheduler) and inplace.apply(Scheduler)  # idempotent
    return Scheduler


@dataclass
class Pause:
    mode: str


def test_the_pending_batch_is_processed_at_the_pause_once_and_counted() -> None:
    sched = scheduler_class()()
    a, b, gone = Req("a", [1, 2, 3]), Req("b", [4]), Req("gone", [5, 6])
    sched.running_batch = Batch([a, b, gone])
    sched.last_batch = sched.running_batch
    # launched before the pause: one token each sampled on the GPU, not yet appended; "gone" ends with it
    sched.result_queue.append((Batch([a, b, gone]), Result({"a": 7, "b": 8, "gone": 9}, finishes={"gone"})))
    assert sched.get_internal_state(None).internal_state[inplace.KEY] == {
        "pauses": 0,
        "counts": None,
        "retracted": [],
        "finished": [],
        "queued": [],
    }

    sched.pause_generation(Pause("in_place"))
    state = sched.get_internal_state(None).internal_state
    # "gone" ended with the batch processed at the pause: not held, and named so it is not stopped either
    assert state[inplace.KEY] == {
        "pauses": 1,
        "counts": {"a": 4, "b": 2},
        "retracted": [],
        "finished": ["gone"],
        "queued": [],
    }
    assert state["model_path"] == "m" and sched.paused
    assert (a.output_ids, b.output_ids) == ([1, 2, 3, 7], [4, 8])
    sched.pop_and_process()  # the loop after the resume: the entry is skipped, not appended twice
    assert (a.output_ids, b.output_ids, sched.processed) == ([1, 2, 3, 7], [4, 8], 1)
    sched.pause_generation(Pause("in_place"))  # a second pause with nothing pending
    assert sched.get_internal_state(None).internal_state[inplace.KEY]["pauses"] == 2


def test_a_prefill_just_run_and_a_chunked_request_are_counted() -> None:
    sched = scheduler_class()()
    running, fresh, chunked = Req("r", [1]), Req("fresh"), Req("chunk")
    sched.running_batch = Batch([running])
    sched.last_batch = Batch([fresh, chunked], Mode(True))  # a prefill: "fresh" samples its first token
    sched.chunked_req = chunked  # half prefilled: no token yet
    sched.result_queue.append((sched.last_batch, Result({"fresh": 3})))
    sched.pause_generation(Pause("in_place"))
    counts = sched.get_internal_state(None).internal_state[inplace.KEY]["counts"]
    assert counts == {"r": 1, "fresh": 1, "chunk": 0}


def test_requests_retracted_for_memory_are_named_apart_from_those_never_started() -> None:
    """SGLang's retract_decode puts a request back in the waiting queue with its tokens (its KV freed): it is
    not held in place, and the record names it so its prefill again is not charged to the update."""
    sched = scheduler_class()()
    sched.running_batch = Batch([Req("r", [1, 2])])
    sched.waiting_queue = [Req("new"), Req("back", [3, 4, 5])]
    sched.pause_generation(Pause("in_place"))
    record = sched.get_internal_state(None).internal_state[inplace.KEY]
    assert (record["counts"], record["retracted"], record["queued"]) == ({"r": 2}, ["back"], ["new"])


def test_without_overlap_nothing_is_pending_and_other_modes_record_nothing() -> None:
    sched = scheduler_class()(overlap=False)
    sched.running_batch = Batch([Req("x", [1, 2])])
    sched.pause_generation(Pause("retract"))
    assert sched.get_internal_state(None).internal_state[inplace.KEY]["counts"] is None
    sched.pause_generation(Pause("in_place"))
    assert sched.get_internal_state(None).internal_state[inplace.KEY]["counts"] == {"x": 2}


def test_a_scheduler_without_the_hooks_is_left_alone() -> None:
    class Bare:
        def pause_generation(self, recv_req: Any) -> None: ...

    assert not inplace.apply(Bare)
    assert not hasattr(Bare, "get_internal_state")
