"""Group-native GRPO (issue 39): a group's prompt prefilled once, groups placed whole, samples unchanged.

On FakeEngines with the modelled prefix cache (engines/fake.py: a prompt is cached only after the step that
admitted it, so a burst of siblings all compute it, as SGLang's scheduler does) behind real servers on
loopback.  The SGLang engine's wiring of the same mechanism is tested over SGLang's real tokenizer manager
in tests/test_sglang_direct.py.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.engines.prefill import PrefillOnce
from test_scheduler import HANG_GUARD_S, until  # a condition polled to a deadline, never a sleep-then-assert

P = 512  # prompt tokens: above the default prefill-once threshold (256)


def _prompts(n: int) -> list[list[int]]:
    return [[1000 + 7 * i + j % 97 for j in range(P)] for i in range(n)]


def _cfg(*, once: bool) -> FakeEngineConfig:
    return FakeEngineConfig(
        step_base_s=0.001, max_batch=1024, prefix_cache=True, prefill_once_min_tokens=256 if once else None
    )


async def _run_groups(address: list[str], prompts: list[list[int]], g: int, **options: object) -> list[list[tuple]]:
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    async with RolloutClient(servers=address, **options) as client:
        async with client.generate_many(prompts, group_size=g, sampling=sampling) as stream:
            groups = sorted([grp async for grp in stream], key=lambda grp: grp.index)
    return [[(r.output_ids, r.logprobs, r.cached_tokens, r.server_id) for r in grp.results] for grp in groups]


async def test_a_groups_prompt_is_prefilled_once_and_samples_are_unchanged(fake_servers) -> None:
    prompts, g = _prompts(8), 8
    gate = asyncio.Event()
    (naive,) = await fake_servers(1, _cfg(once=False), gate=gate)
    (once,) = await fake_servers(1, _cfg(once=True))
    # the naive engine holds every sample until all have arrived, so the siblings meet in one step (as a
    # burst does in SGLang's scheduler), whatever the machine's speed
    naive_run = asyncio.create_task(_run_groups([naive.address], prompts, g))
    await until(lambda: len(naive.engine._reqs) == g * len(prompts), "every sample reached the naive engine")
    gate.set()
    got_naive = await naive_run
    got_once = await _run_groups([once.address], prompts, g)

    # the naive engine computed every sibling's prompt; prefill-once computed each prompt once, plus the
    # last position of each member (its logits), however the members arrived
    assert naive.engine.prefill_tokens == g * P * len(prompts)
    assert once.engine.prefill_tokens <= len(prompts) * (P + g)
    assert once.engine.prefill_tokens / (len(prompts) * P) <= 1.05
    assert once.engine.prefill_once.prefills == len(prompts)
    # every member took the prompt from the cache, all but its last token
    assert all(c == P - 1 for grp in got_once for (_, _, c, _) in grp)
    # and the samples themselves are the same: ids and logprobs, member by member
    assert [[(ids, lps) for ids, lps, _, _ in grp] for grp in got_naive] == [
        [(ids, lps) for ids, lps, _, _ in grp] for grp in got_once
    ]


async def _held_run(servers: list, gate: asyncio.Event, prompts: list[list[int]], g: int, **options: object) -> list:
    """Every sample placed before any runs (the engines hold them at ``gate``): loads only grow while the
    client places, so placement does not depend on the machine's speed."""
    run = asyncio.create_task(_run_groups([s.address for s in servers], prompts, g, **options))
    await until(lambda: sum(len(s.engine._reqs) for s in servers) == g * len(prompts), "every sample placed")
    gate.set()
    return await run


async def test_groups_are_placed_whole_and_spread_evenly(fake_servers) -> None:
    gate = asyncio.Event()
    servers = await fake_servers(2, _cfg(once=True), gate=gate)
    got = await _held_run(servers, gate, _prompts(16), 8)
    per_server = {s.config.server_id: 0 for s in servers}
    for grp in got:
        where = {sid for *_, sid in grp}
        assert len(where) == 1, f"a group was split over {where}"
        per_server[where.pop()] += 1
    assert sorted(per_server.values()) == [8, 8], per_server
    for s in servers:  # each server prefilled only its own groups' prompts
        assert s.engine.prefill_once.prefills == 8


async def test_group_placement_can_be_switched_off(fake_servers) -> None:
    gate = asyncio.Event()
    servers = await fake_servers(2, _cfg(once=True), gate=gate)
    got = await _held_run(servers, gate, _prompts(8), 8, place_groups=False)
    assert any(len({sid for *_, sid in grp}) == 2 for grp in got)  # samples placed one by one: groups split
    for s in servers:  # each server prefilled the prompts of the members it got, once per group
        assert 0 < s.engine.prefill_once.prefills <= 8


async def test_short_prompts_and_lone_requests_take_no_prefill_pass(fake_servers) -> None:
    (server,) = await fake_servers(1, _cfg(once=True))
    async with RolloutClient(servers=[server.address]) as client:
        async with client.generate_many([[1, 2, 3] * 10] * 4, group_size=4) as stream:  # 30 tokens < 256
            assert len([grp async for grp in stream]) == 4
        await client.generate(_prompts(1)[0], sampling=SamplingParams(max_new_tokens=2))  # no group
    assert server.engine.prefill_once.prefills == 0


async def test_a_member_waiting_for_its_groups_prefill_can_be_aborted(fake_servers) -> None:
    (server,) = await fake_servers(1, _cfg(once=True))
    engine: FakeEngine = server.engine  # type: ignore[assignment]
    await engine.pause("retract")  # the step loop holds: the group's prefill cannot run
    prompt = _prompts(1)[0]
    reqs = [
        GenerateRequest(input_ids=prompt, rid=f"m{k}", group_id="g", sampling=SamplingParams(max_new_tokens=4))
        for k in range(3)
    ]
    tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
    await until(lambda: engine.prefill_once.members == 3, "all three members wait for the group's prefill")
    engine.abort("m1")
    aborted = await asyncio.wait_for(tasks[1], HANG_GUARD_S)
    assert aborted.finish_reason == "abort" and aborted.output_ids == []
    assert not tasks[0].done() and not tasks[2].done()  # the others still wait for the prefill
    await engine.resume()
    done = await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), HANG_GUARD_S)
    assert [r.finish_reason for r in done] == ["length", "length"]
    assert [r.cached_tokens for r in done] == [P - 1, P - 1]


async def test_prefill_once_survives_a_cancelled_member_and_a_failed_prefill() -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    calls: list[str] = []

    async def prefill(req: GenerateRequest) -> None:
        calls.append(req.rid)
        started.set()
        await release.wait()
        if req.rid == "boom":
            raise RuntimeError("the engine refused the prefill")

    once = PrefillOnce(prefill, min_tokens=4, max_entries=2)
    mk = lambda rid, gid, ids: GenerateRequest(input_ids=ids, rid=rid, group_id=gid)  # noqa: E731
    first = asyncio.create_task(once.wait(mk("a0", "A", [1, 2, 3, 4])))
    await started.wait()
    second = asyncio.create_task(once.wait(mk("a1", "A", [1, 2, 3, 4])))
    await until(lambda: once.members == 2, "the second member joins")
    first.cancel()  # one member's cancellation does not stop the prefill the other waits for
    await asyncio.gather(first, return_exceptions=True)
    assert not second.done()
    release.set()
    await asyncio.wait_for(second, HANG_GUARD_S)
    assert calls == ["a0"]  # one prefill for the group

    await asyncio.wait_for(once.wait(mk("boom", "B", [5, 6, 7, 8])), HANG_GUARD_S)  # a failed prefill: go on
    await asyncio.wait_for(once.wait(mk("b1", "B", [5, 6, 7, 8])), HANG_GUARD_S)  # (remembered: not re-run)
    assert calls == ["a0", "boom"]
    for i in range(5):  # finished entries are forgotten beyond max_entries
        await once.wait(mk(f"c{i}", f"C{i}", [9, 9, 9, i]))
    assert len(once._entries) <= 2

    release.clear()
    waiting = asyncio.create_task(once.wait(mk("d0", "D", [4, 4, 4, 4])))
    await until(lambda: calls[-1] == "d0", "the prefill of group D runs")
    await once.close()  # cancels the prefill: its member goes on, it is not cancelled itself
    await asyncio.wait_for(waiting, HANG_GUARD_S)
    assert not waiting.cancelled()


@pytest.mark.parametrize("gid", ["", "x" * 257])
def test_a_bad_group_id_is_refused_at_construction(gid: str) -> None:
    from rollout_sdk.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="group_id"):
        GenerateRequest(input_ids=[1], group_id=gid)


def test_a_bad_group_id_on_the_wire_is_refused() -> None:
    import msgspec

    from rollout_sdk.errors import RolloutError
    from rollout_sdk.protocol import decode_client_message

    payload = msgspec.msgpack.encode({"type": "generate", "input_ids": [1], "group_id": "y" * 5000})
    with pytest.raises((RolloutError, msgspec.ValidationError)):
        decode_client_message(payload)


def test_the_rl_step_bench_runs_its_cpu_dry_run(tmp_path) -> None:
    """bench/gpu_rlstep.py --engine fake --quick: every side of a GRPO pass and a long pass runs, the SDK's
    GRPO prefill is the ideal (within 5%) while the raw side's is a multiple of it, every token arrives."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu_rlstep.py"
    out = tmp_path / "rlstep.json"
    plan = ["grpo2048x8:raw,sdk,sdkoff", "long:raw,rawcap,http,sdk"]
    cmd = [
        sys.executable,
        str(bench),
        "--engine",
        "fake",
        "--quick",
        "--reps",
        "1",
        "--plan",
        *plan,
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    by = {(p["workload"], p["mode"]): p for p in res["passes"]}
    assert len(by) == 7 and all(p.get("ok") for p in by.values()), by
    assert by[("grpo2048x8", "sdk")]["prefill_x"] <= 1.05
    assert by[("grpo2048x8", "raw")]["prefill_x"] >= 2  # a gather of every sample meets in one step


async def test_an_agent_groups_first_turn_carries_its_group_id_and_later_turns_do_not() -> None:
    from rollout_sdk.protocol import GenerateResult
    from rollout_sdk.rollouts import RolloutContext, Trajectory, rollout_group
    from rollout_sdk.rollouts.group import Agent

    seen: list[GenerateRequest] = []

    class Recorder:
        weight_version = 0

        async def generate(self, req: GenerateRequest, *, timeout: object = None) -> GenerateResult:
            seen.append(req)
            return GenerateResult(
                rid=req.rid, output_ids=[7, 8], finish_reason="length", prompt_tokens=len(req.input_ids)
            )

        def abort(self, rid: str) -> bool:
            return False

        def server_info(self) -> list:
            return []

    class TwoTurns(Agent):
        async def run(self, ctx: RolloutContext, sample: object) -> Trajectory:
            first = await ctx.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
            await ctx.generate([1, 2, 3, *first.output_ids, 4], SamplingParams(max_new_tokens=2))
            return Trajectory(
                id=ctx.session_id, prompt_ids=[1], response_ids=[], loss_mask=[], logprobs=[], finish_reason="stop"
            )

    await rollout_group(Recorder(), TwoTurns(), {}, group_size=3)  # type: ignore[arg-type]
    first_turns = [r for r in seen if r.input_ids == [1, 2, 3]]
    later_turns = [r for r in seen if r.input_ids != [1, 2, 3]]
    assert len(first_turns) == 3 and len({r.group_id for r in first_turns}) == 1 and first_turns[0].group_id
    assert len(later_turns) == 3 and all(r.group_id is None for r in later_turns)
