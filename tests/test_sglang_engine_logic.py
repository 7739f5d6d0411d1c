"""The SGLang engine's own logic on CPU, against a scriptable stand-in for SGLang's tokenizer manager.

What is tested is ours: the gate that holds requests while weights change or memory is released, the
checkpoint that stops running parts inside SGLang and continues them as ``prompt + tokens so far`` (exact
version segments), pause modes, user aborts of held requests, the manifest check that refuses a bad update
before anything loads (a refused distributed update still receives its broadcast under discarded names),
and engine death failing waiting requests.  The real SGLang runs in tests/gpu and bench/gpu_check.py.

The stand-in emits token id = absolute position (``len(prompt) + i``), so a request continued after a
checkpoint returns exactly ``range(len(prompt), len(prompt) + n)`` if and only if the parts join right.
"""

from __future__ import annotations

import asyncio
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_sdk import EngineBusyError, EngineDeadError, GenerateRequest, SamplingParams, WeightUpdateError
from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
from rollout_sdk.protocol import EngineLimits, TensorMeta, UpdateWeightsDistributed, UpdateWeightsFromIpc

STEP_S = 0.002
PROMPT = [7, 8, 9, 10]


class FakeTokenizerManager:
    """generate_request / abort_request / weight and memory calls, with the invariants SGLang asserts."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Event] = {}
        self.tokens: dict[str, int] = {}  # tokens emitted so far per rid (the last part's)
        self.submitted: list[Any] = []
        self.loaded: list[list[str]] = []
        self.flushes = 0
        self.released: set[str] = set()
        self.fail_update = False
        self.server_args = SimpleNamespace(weight_version="0")  # SGLang echoes it; the engine keeps it equal

    async def generate_request(self, obj: Any, _request: Any) -> Any:
        stop = self.running[obj.rid] = asyncio.Event()
        self.tokens[obj.rid] = 0
        self.submitted.append(obj)
        ids: list[int] = []
        kind = "length"
        try:
            for i in range(obj.sampling_params["max_new_tokens"]):
                if stop.is_set():
                    kind = "abort"
                    break
                assert not self.released, "generating with memory released"
                await asyncio.sleep(STEP_S)
                ids.append(len(obj.input_ids) + i)
                self.tokens[obj.rid] = len(ids)
        finally:
            del self.running[obj.rid]
        yield {
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": kind},
                "output_token_logprobs": [(-0.5, t, None) for t in ids],
                "queue_time": 0.0,
            },
        }

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        for r, ev in self.running.items():
            if abort_all or r.startswith(rid):
                ev.set()

    async def update_weights_from_distributed(self, obj: Any, _request: Any) -> tuple[bool, str]:
        loads = [n for n in obj.names if not n.startswith("rollout_sdk_discarded_")]
        assert not (loads and self.running), f"weights changed with {len(self.running)} requests running"
        await asyncio.sleep(0.01)  # the broadcast
        if self.fail_update:
            return False, "Failed to update parameter online: boom. The full weights are partially updated."
        self.loaded.append(list(obj.names))
        return True, "Succeeded"

    async def update_weights_from_tensor(self, obj: Any, _request: Any) -> tuple[bool, str]:
        assert not self.running
        self.loaded.append(["ipc"])
        return True, "Succeeded"

    async def flush_cache(self, timeout_s: float = 0.0) -> Any:
        assert not self.running, "flush with requests running"
        self.flushes += 1
        return SimpleNamespace(success=True)

    async def release_memory_occupation(self, obj: Any, _request: Any) -> None:
        assert not self.running, "release with requests running"
        self.released.update(obj.tags)

    async def resume_memory_occupation(self, obj: Any, _request: Any) -> None:
        self.released.difference_update(obj.tags)


def _io_struct() -> types.ModuleType:
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    for name in (
        "GenerateReqInput",
        "UpdateWeightsFromDistributedReqInput",
        "UpdateWeightsFromTensorReqInput",
        "ReleaseMemoryOccupationReqInput",
        "ResumeMemoryOccupationReqInput",
    ):
        setattr(mod, name, lambda **kw: SimpleNamespace(**kw))
    return mod


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> tuple[SglangEngine, FakeTokenizerManager]:
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", _io_struct())
    eng = SglangEngine(SglangEngineConfig(model_path="/nonexistent"))
    tm = FakeTokenizerManager()
    eng._tm = tm
    eng._limits = EngineLimits(vocab_size=1000, max_context=4096, eos_token_ids=[0])
    eng._control.groups.add("g")
    eng._control.manifest = {"model.norm.weight": (16,), "lm_head.weight": (1000, 16)}
    return eng, tm


def req(rid: str, n: int) -> GenerateRequest:
    return GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True), rid=rid)


def exact(r: Any, n: int) -> bool:
    start = len(PROMPT)
    return r.output_ids == list(range(start, start + n)) and r.logprobs == [-0.5] * n


def dist(buckets: list[list[TensorMeta]], version: int) -> UpdateWeightsDistributed:
    return UpdateWeightsDistributed(call_id="c", group_name="g", buckets=buckets, version=version)


def ipc(buckets: list[list[TensorMeta]], version: int) -> UpdateWeightsFromIpc:
    return UpdateWeightsFromIpc(call_id="c", handles=[b"h"], buckets=buckets, version=version)


NORM = [[TensorMeta(name="model.norm.weight", dtype="bfloat16", shape=[16])]]


async def until_tokens(tm: FakeTokenizerManager, count: int, tokens: int = 3) -> None:
    """Until ``count`` requests run inside SGLang and each has emitted ``tokens`` tokens (a condition, not a
    sleep: a checkpoint taken from then on has something to keep, however slow the machine)."""
    while len(tm.running) < count or any(tm.tokens.get(rid, 0) < tokens for rid in tm.running):
        await asyncio.sleep(STEP_S)


async def until_more_tokens(eng: Any, tm: FakeTokenizerManager, rids: list[str], more: int = 2) -> None:
    """Until each of ``rids`` has emitted ``more`` tokens past what it had inside SGLang: it still runs, proven
    by its progress rather than by a look after a sleep."""
    sids = [eng.flights[rid].sid for rid in rids]
    start = {sid: tm.tokens[sid] for sid in sids}
    while not all(tm.tokens[sid] >= start[sid] + more for sid in sids):
        assert all(sid in tm.running for sid in sids), "a running request stopped"
        await asyncio.sleep(STEP_S)


async def at_gate(eng: Any, rids: list[str]) -> None:
    """Until each of ``rids`` waits at the engine's closed gate: from then on none can start before the gate
    opens, so one still pending is held, not merely slow (a condition, not a sleep)."""
    while not all(rid in eng.flights and eng.flights[rid].wake is not None for rid in rids):
        await asyncio.sleep(STEP_S)


async def test_unpaused_update_checkpoints_running_requests_into_exact_segments(engine) -> None:
    eng, tm = engine
    tasks = [asyncio.ensure_future(eng.generate(req(f"r{i}", 200))) for i in range(20)]
    await until_tokens(tm, 20)
    await eng.update_weights_distributed(dist(NORM, 1))
    results = await asyncio.gather(*tasks)
    for r in results:
        assert r.finish_reason == "length" and exact(r, 200)
        (v0, a), (v1, b) = r.version_segments
        assert (v0, v1) == (0, 1) and a > 0 and b > 0 and a + b == 200
        assert r.weight_version == 1
    assert tm.loaded == [["model.norm.weight"]] and tm.flushes == 1
    # each continuation asked for exactly what was left, from prompt + tokens so far
    cont = [o for o in tm.submitted if len(o.input_ids) > len(PROMPT)]
    assert len(cont) == 20
    assert all(len(o.input_ids) - len(PROMPT) + o.sampling_params["max_new_tokens"] == 200 for o in cont)


async def test_hold_keeps_new_requests_out_until_resume(engine) -> None:
    eng, tm = engine
    old = [asyncio.ensure_future(eng.generate(req(f"o{i}", 100))) for i in range(10)]
    await until_tokens(tm, 10)
    await eng.pause("retract")
    assert not tm.running and eng.paused
    new = [asyncio.ensure_future(eng.generate(req(f"n{i}", 30))) for i in range(5)]
    await at_gate(eng, [f"n{i}" for i in range(5)])
    assert not tm.running and not any(t.done() for t in [*old, *new])  # all wait at the gate
    await eng.update_weights_distributed(dist(NORM, 2))
    assert not tm.running  # still paused after the update
    await eng.resume()
    for r in await asyncio.gather(*old):
        assert exact(r, 100) and [v for v, _ in r.version_segments] == [0, 2]
    for r in await asyncio.gather(*new):
        assert exact(r, 30) and r.version_segments == [(2, 30)]


async def test_pause_abort_returns_partials_and_new_work_waits(engine) -> None:
    eng, tm = engine
    tasks = [asyncio.ensure_future(eng.generate(req(f"r{i}", 500))) for i in range(8)]
    await until_tokens(tm, 8)
    await eng.pause("abort")
    results = await asyncio.gather(*tasks)
    assert all(
        r.finish_reason == "abort" and 0 < len(r.output_ids) < 500 and exact(r, len(r.output_ids)) for r in results
    )
    late = asyncio.ensure_future(eng.generate(req("late", 5)))
    await at_gate(eng, ["late"])
    assert not late.done()
    await eng.resume()
    assert exact(await late, 5)


async def test_user_abort_of_a_held_request_returns_its_tokens(engine) -> None:
    eng, tm = engine
    task = asyncio.ensure_future(eng.generate(req("x", 300)))
    await until_tokens(tm, 1)
    await eng.pause("in_place")
    await at_gate(eng, ["x"])  # held at the closed gate: only the abort or a resume can end it now
    assert not task.done() and not tm.running
    eng.abort("x")
    r = await asyncio.wait_for(task, 1.0)
    assert r.finish_reason == "abort" and 0 < len(r.output_ids) < 300 and exact(r, len(r.output_ids))
    await eng.resume()


async def test_refused_update_loads_nothing_but_receives_the_broadcast(engine) -> None:
    eng, tm = engine
    running = asyncio.ensure_future(eng.generate(req("r", 100)))
    await until_tokens(tm, 1)
    bad = [
        [
            TensorMeta(name="model.norm.weight", dtype="bfloat16", shape=[16]),
            TensorMeta(name="model.norm.weight_typo", dtype="bfloat16", shape=[16]),
            TensorMeta(name="lm_head.weight", dtype="bfloat16", shape=[1000, 17]),
        ]
    ]
    with pytest.raises(WeightUpdateError) as info:
        await eng.update_weights_distributed(dist(bad, 5))
    assert info.value.applied is False
    assert "'model.norm.weight_typo'" in str(info.value) and "(1000, 17)" in str(info.value)
    # the collective ran (the trainer was sending) under names no model has: nothing loaded
    assert len(tm.loaded) == 1 and all(n.startswith("rollout_sdk_discarded_") for n in tm.loaded[0])
    r = await running
    assert exact(r, 100) and r.version_segments == [(0, 100)]  # a refused update holds nothing
    with pytest.raises(WeightUpdateError) as info:
        await eng.update_weights_from_ipc(ipc(bad, 5))
    assert info.value.applied is False and len(tm.loaded) == 1  # IPC: refused before anything is sent


async def test_failure_after_the_check_means_half_updated(engine) -> None:
    eng, tm = engine
    tm.fail_update = True
    with pytest.raises(WeightUpdateError) as info:
        await eng.update_weights_distributed(dist(NORM, 1))
    assert info.value.applied is None  # SGLang loads tensor by tensor: the client marks this engine dead


async def test_release_refused_while_running_allowed_while_held(engine) -> None:
    eng, tm = engine
    tasks = [asyncio.ensure_future(eng.generate(req(f"r{i}", 150))) for i in range(4)]
    await until_tokens(tm, 4)
    with pytest.raises(EngineBusyError):
        await eng.release_memory()
    await until_more_tokens(eng, tm, [f"r{i}" for i in range(4)])  # the refusal did not stop anything
    await eng.pause("retract")
    await eng.release_memory()
    assert tm.released == {"weights", "kv_cache", "cuda_graph"}
    await eng.resume()  # memory still released: requests keep waiting
    await at_gate(eng, [f"r{i}" for i in range(4)])
    assert not tm.running and not any(t.done() for t in tasks)
    await eng.resume_memory()
    assert all(exact(r, 150) for r in await asyncio.gather(*tasks))


async def test_engine_death_fails_waiting_requests_fast(engine) -> None:
    eng, _ = engine
    await eng.pause("retract")
    waiting = [asyncio.ensure_future(eng.generate(req(f"w{i}", 10))) for i in range(3)]
    await at_gate(eng, [f"w{i}" for i in range(3)])  # each waits at the gate (not merely not started yet)
    eng._on_child_death("in a test")
    for t in waiting:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(t, 1.0)


async def test_ipc_refused_up_front_with_tensor_parallel_engines(engine) -> None:
    eng, tm = engine
    eng.config = SglangEngineConfig(model_path="/nonexistent", tp_size=2)
    with pytest.raises(WeightUpdateError, match="one CUDA handle per TP rank") as info:
        await eng.update_weights_from_ipc(ipc(NORM, 1))
    assert info.value.applied is False and tm.loaded == []


async def test_load_never_shows_more_than_runs_here(engine) -> None:
    """SGLang's load snapshot is read once a second: one taken mid-run must not outlive the run."""
    from types import SimpleNamespace

    from rollout_sdk.engines.base import EngineLoad
    from rollout_sdk.engines.sglang.translate import load_from_snapshot

    eng, tm = engine
    snap = SimpleNamespace(
        num_running_reqs=128,
        num_waiting_reqs=7,
        num_waiting_uncached_tokens=900,
        num_used_tokens=50_000,
        max_total_num_tokens=400_000,
        max_running_requests=256,
        token_usage=0.125,
    )
    eng._load = load_from_snapshot(snap, eng.config)
    assert (eng._load.max_running_requests, eng._load.kv_capacity_tokens) == (256, 400_000)
    idle = eng.load()
    assert (idle.running, idle.queued, idle.queued_tokens) == (0, 0, 0)
    assert idle.max_running_requests == 256 and idle.kv_capacity_tokens == 400_000
    tasks = [asyncio.ensure_future(eng.generate(req(f"r{i}", 100))) for i in range(3)]
    await until_tokens(tm, 3)
    busy = eng.load()
    assert busy.running + busy.queued == 3
    eng._load = EngineLoad(running=1, queued=0)
    assert eng.load().running == 1  # a fresh snapshot below what runs is kept as it is
    await asyncio.gather(*tasks)


async def test_gc_freeze_uses_sglangs_call_and_a_failure_is_not_fatal(engine, caplog) -> None:
    """After start the engine asks SGLang to freeze the garbage collector (here and in its scheduler); an
    SGLang without the call, or one that fails it, leaves the engine serving."""
    eng, tm = engine
    calls: list[str] = []

    async def freeze_gc() -> None:
        calls.append("freeze")

    tm.freeze_gc = freeze_gc  # type: ignore[attr-defined]
    await eng._freeze_gc()
    assert calls == ["freeze"]

    async def broken() -> None:
        raise RuntimeError("no scheduler")

    tm.freeze_gc = broken  # type: ignore[attr-defined]
    with caplog.at_level("WARNING", logger="rollout_sdk.engines.sglang"):
        await eng._freeze_gc()
    assert "freezing the garbage collector failed" in caplog.text
    del tm.freeze_gc  # an SGLang without it
    await eng._freeze_gc()
    r = await eng.generate(req("after", 5))
    assert exact(r, 5)
    assert SglangEngineConfig(model_path="/m").freeze_gc is True


async def test_a_callers_cancellation_stays_cancellation_after_the_engine_died(engine) -> None:
    """Issue 25 item 7: once the engine is dead, a caller that cancels its request still gets
    CancelledError (not EngineDeadError); a request cancelled by the death itself gets EngineDeadError."""
    eng, tm = engine
    mine = asyncio.ensure_future(eng.generate(req("c1", 10_000)))
    other = asyncio.ensure_future(eng.generate(req("c2", 10_000)))
    while len(tm.running) < 2:
        await asyncio.sleep(STEP_S)
    eng._mark_dead(EngineDeadError("a child died in a test"))  # dead, its flights not cancelled yet
    mine.cancel()  # the caller's own cancellation
    with pytest.raises(asyncio.CancelledError):
        await mine
    assert mine.cancelled()
    eng._on_child_death("in a test")  # the death cancels what is left: that is the engine's failure
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(other, 60)
