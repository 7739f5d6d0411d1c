"""bench/harness: the plumbing every benchmark script shares (docs/benchmarks.md's numbers come through it).

The scripts themselves are checked by running them (their ``--quick`` modes); these tests pin the shared
pieces whose mistakes would bias every bench at once: the ABBA order, the quiet-machine retries, the
statistics, the tables, that every server process a bench starts is stopped, and that an interrupted
bench exits 130 with its processes stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # bench/harness/ (a script run as bench/<name>.py has bench/ on sys.path)


def test_abba_alternates_the_order_of_the_sides_every_repetition() -> None:
    order = list(harness.abba(4, ["off", "on"]))
    assert order == [(0, "off"), (0, "on"), (1, "on"), (1, "off"), (2, "off"), (2, "on"), (3, "on"), (3, "off")]
    assert list(harness.abba(0, ["a", "b"])) == []


async def test_alternate_collects_each_side_in_repetition_order() -> None:
    calls: list[tuple[str, int]] = []

    def side(name: str):
        async def run(rep: int) -> dict[str, float]:
            calls.append((name, rep))
            return {"x": float(rep)}

        return run

    out = await harness.alternate(3, {"a": side("a"), "b": side("b")})
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert [r["x"] for r in out["a"]] == [0.0, 1.0, 2.0]
    assert harness.medians(out["b"], ["x"]) == {"x": 1.0}


async def test_until_quiet_measures_a_cell_again_only_when_others_used_the_cpu() -> None:
    loads = iter([80.0, 50.0, 5.0])

    async def cell() -> float:
        return next(loads)

    got, load, attempts = await harness.until_quiet(
        cell, wait_quiet_s=30.0, retries=2, foreign=lambda x: x, wait_first=False
    )
    assert (got, load, attempts) == (5.0, 5.0, 3)

    loads = iter([80.0, 50.0, 5.0])
    got, load, attempts = await harness.until_quiet(
        cell, wait_quiet_s=30.0, retries=1, foreign=lambda x: x, wait_first=False
    )
    assert (got, attempts) == (50.0, 2), "the last attempt is kept, noisy or not"

    loads = iter([80.0])
    got, _, attempts = await harness.until_quiet(cell, wait_quiet_s=0.0, retries=5, foreign=lambda x: x)
    assert (got, attempts) == (80.0, 1), "without --wait-quiet a cell runs once"


def test_statistics() -> None:
    assert harness.pct([5, 1, 4, 2, 3], 0.5) == 3
    assert harness.pct([1, 2, 3, 4], 0.99) == 4
    assert math.isnan(harness.pct([], 0.5))
    assert harness.median([4, 1, 3, 2]) == 2.5
    assert math.isnan(harness.median([]))
    assert harness.spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    step = harness.interpolate({1: 1.0, 3: 3.0})
    assert (step(0), step(2), step(9)) == (1.0, 2.0, 3.0)


def test_by_mode_fills_only_the_flags_left_unset() -> None:
    args = argparse.Namespace(quick=True, duration=None, reps=7)
    harness.by_mode(args, duration=(8.0, 3.0), reps=(5, 3))
    assert (args.duration, args.reps) == (3.0, 7)
    args = argparse.Namespace(quick=False, duration=None)
    assert harness.by_mode(args, duration=(8.0, 3.0)).duration == 8.0


def test_parser_has_the_shared_flags_asked_for() -> None:
    p = harness.parser("doc", quick="fast", json="x", reps=3, uvloop=True)
    harness.add_quiet(p)
    a = p.parse_args([])
    assert (a.quick, a.reps, a.no_uvloop, a.wait_quiet, a.retries) == (False, 3, False, 0.0, 2)
    assert Path(a.json).name == "x.json" and Path(a.json).parent.name == "results"
    out = harness.parser(json="y", json_flag="--out", json_type=Path).parse_args(["--out", "/tmp/z.json"])
    assert out.out == Path("/tmp/z.json")


def test_mode_facts_name_the_loop_and_the_mode() -> None:
    p = harness.parser("doc", quick="q", uvloop=True)
    assert harness.mode_facts(p.parse_args([])) == {"loop": "uvloop", "mode": "full"}
    assert harness.mode_facts(p.parse_args(["--quick", "--no-uvloop"])) == {"loop": "asyncio", "mode": "quick"}


def test_table_aligns_columns_and_markdown_marks_numeric_ones() -> None:
    text = harness.table(["mode", "req/s"], [["sync", "1,234"], ["async", "9"]])
    lines = text.splitlines()
    assert lines[0] == "mode   req/s"
    assert set(lines[1]) == {"-"} and len(lines[1]) == len(lines[0])
    assert lines[2:] == ["sync   1,234", "async      9"]
    md = harness.markdown(["a", "b"], [[1, 2]], numeric=[1])
    assert md.splitlines() == ["| a | b |", "| --- | ---: |", "| 1 | 2 |"]


def test_write_json_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "r.json"
    harness.write_json(path, {"a": 1, "p": Path("/x")})
    harness.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]
    meta = harness.save_results(tmp_path / "s.json", [{"x": 1}], {"quick": True})
    assert json.loads((tmp_path / "s.json").read_text()) == {"meta": meta, "rows": [{"x": 1}]}


def test_publish_writes_the_json_then_prints_the_table_and_where_the_numbers_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    payload = {"meta": {"runtime_s": 12.5}, "cells": [1, 2]}
    harness.publish(path, payload, "a | b")
    assert json.loads(path.read_text()) == payload
    assert capsys.readouterr().out == f"a | b\n\nruntime 12.5 s; numbers in {path}\n"


def test_facts_name_the_machine_and_the_command() -> None:
    facts = harness.facts()
    assert {"date", "host", "cpu_model", "cores", "load_average", "versions", "command"} <= set(facts)
    assert facts["versions"]["python"]


_READY = "import sys, time; print('READY tcp://127.0.0.1:1', flush=True); time.sleep(600)"


def test_a_session_stops_every_process_it_started_also_on_an_error() -> None:
    seen: list[tuple[harness.ServerProcs, object]] = []

    def bench() -> None:
        with harness.ServerProcs.session("harness-test-") as procs:
            proc, address = procs.spawn("sleeper", [sys.executable, "-c", _READY])
            assert address == "tcp://127.0.0.1:1"
            assert proc.poll() is None
            seen.append((procs, proc))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bench()
    procs, proc = seen[0]
    assert proc.poll() is not None  # type: ignore[attr-defined]
    assert procs.procs == []


def test_an_interrupted_bench_exits_130_after_its_finally_blocks() -> None:
    stopped = []

    async def bench() -> None:
        try:
            raise KeyboardInterrupt
        finally:
            stopped.append(True)

    with pytest.raises(SystemExit) as exc:
        harness.run(bench(), uvloop=False)
    assert exc.value.code == 130
    assert stopped == [True]


def test_records_is_a_markdown_table_of_result_dicts() -> None:
    md = harness.records([{"case": "a", "s": 1.23456, "n": 3}, {"case": "b", "s": 2.0, "n": None}])
    assert md.splitlines() == ["| case | s | n |", "| --- | --- | --- |", "| a | 1.23 | 3 |", "| b | 2.00 | None |"]


def test_read_until_returns_the_first_matching_line_also_after_buffered_ones() -> None:
    # three lines in one write: the two after the first sit in the reader's buffer, never seen by a select()
    script = "import sys, time; sys.stdout.write('a\\nMEASURE\\nDONE 3 0 1.5\\n'); sys.stdout.flush(); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        seen: list[str] = []
        assert harness.read_until(proc, "^MEASURE", 60, seen=seen).group(0) == "MEASURE"
        assert seen == ["a\n", "MEASURE\n"]
        assert harness.read_until(proc, r"^DONE (\d+)", 60).group(1) == "3"
    finally:
        harness.stop_processes([proc])


def test_read_until_fails_when_the_process_ends_or_the_time_is_up() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match="ended before printing"):
        harness.read_until(proc, "^READY", 60)
    proc.wait()
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError, match=r"within 0\.2 s"):
            harness.read_until(quiet, "^READY", 0.2)
    finally:
        harness.stop_processes([quiet])


def test_process_facts_from_proc() -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc")
    proc = subprocess.Popen([sys.executable, "-c", _READY], stdout=subprocess.PIPE, text=True)
    try:
        harness.read_until(proc, "^READY", 60)
        assert harness.rss_kb(proc.pid) > 0
        assert harness.rss_kb(proc.pid, "VmHWM") >= harness.rss_kb(proc.pid)
        assert harness.rss_kb(proc.pid, "NoSuchField") == -1
        assert harness.num_fds(proc.pid) >= 3
        assert harness.child_pids(os.getpid()).count(proc.pid) == 1
        assert harness.child_pids(proc.pid) == []
    finally:
        harness.stop_processes([proc])


_SERVE = """
import asyncio, sys
sys.path.insert(0, {bench!r})
import harness
from rollout_sdk.engines.fake import FakeEngine
from rollout_sdk.server import EngineServer, ServerConfig

asyncio.run(harness.serve(EngineServer(FakeEngine(), ServerConfig()), lag_samples={samples!r},
                          on_ready=lambda address: print("BOUND", address, flush=True)))
"""


def test_a_bench_server_child_says_ready_stops_on_sigterm_and_writes_its_lag_samples(tmp_path: Path) -> None:
    samples = tmp_path / "lag.json"
    code = _SERVE.format(bench=str(Path(__file__).resolve().parents[1] / "bench"), samples=str(samples))
    with harness.ServerProcs.session("harness-serve-") as procs:
        proc, address = procs.spawn("child", [sys.executable, "-c", code], timeout=120)
        assert address.startswith("tcp://")
        procs.stop([proc])  # SIGTERM: the server stops, the probe's samples are written
        assert proc.returncode == 0
    rows = json.loads(samples.read_text())
    assert rows and all(len(r) == 3 for r in rows)
    late, busy = harness.lag_window(samples, rows[0][0], rows[-1][0])
    assert len(late) == len(busy) == len(rows)
    assert harness.lag_window(samples, 0.0, 1.0) == ([], [])


def test_rotate_gives_each_side_each_place_in_turn() -> None:
    assert [harness.rotate(["a", "b", "c"], rep) for rep in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


async def test_run_plan_rotates_records_every_row_and_turns_a_failure_into_an_error_row() -> None:
    calls: list[tuple[str, str, int]] = []
    rows: list[dict] = []

    async def one_pass(side: str, workload: str, rep: int) -> dict:
        calls.append((side, workload, rep))
        if workload == "broken":
            raise ValueError("no such workload")
        return {"tok_s": {"raw": 100.0, "sdk": 120.0}[side] + rep}

    plan = [("grpo", ["raw", "sdk"]), ("broken", ["sdk"])]
    stopped = await harness.run_plan(plan, 2, one_pass, rows.append)
    assert stopped is None
    rep0 = [("raw", "grpo", 0), ("sdk", "grpo", 0), ("sdk", "broken", 0)]
    rep1 = [("sdk", "grpo", 1), ("raw", "grpo", 1), ("sdk", "broken", 1)]  # the sides rotated
    assert calls == [*rep0, *rep1]
    assert rows[2] == {"error": "ValueError: no such workload", "rep": 0, "workload": "broken", "mode": "sdk"}
    by = harness.by_side(rows)
    assert list(by) == ["grpo", "broken"] and by["broken"] == {}, "a workload whose passes all failed has no sides"
    assert by["grpo"]["sdk"][1]["tok_s"] == 121.0
    ratios = harness.ratios(by["grpo"], [("sdk", "raw"), ("sdk", "sdk"), ("http", "raw")])
    assert list(ratios) == ["sdk/raw"]
    assert ratios["sdk/raw"] == harness.span([120 / 100, 121 / 101])
    summary = harness.plan_summary(rows, lambda reps: sorted(reps), [("sdk", "raw")])
    assert summary == {
        "grpo": {"raw": [0, 1], "sdk": [0, 1], "sdk/raw": ratios["sdk/raw"], "all_ok": False},
        "broken": {"all_ok": False},
    }


async def test_run_plan_begins_no_repetition_past_the_budget() -> None:
    rows: list[dict] = []

    async def one_pass(side: str, workload: str, rep: int) -> dict:
        return {"tok_s": 1.0}

    stopped = await harness.run_plan([("w", ["a"])], 5, one_pass, rows.append, budget_s=-1.0)  # spent already
    assert [r["rep"] for r in rows] == [0]
    assert stopped is not None and stopped.startswith("after 1 reps")


def test_span_and_its_cell() -> None:
    assert harness.span([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert harness.span([1234.4, 1000.6], None) == {"median": 1118, "min": 1001, "max": 1234}
    assert harness.span_cell({"median": 1500.0, "min": 1000.0, "max": 2000.0}) == "1,500 [1,000-2,000]"
    assert harness.span_cell(None) == "-"


_CHILD = """
import asyncio, sys
sys.path.insert(0, {bench!r})
import harness

async def main():
    pipe = await harness.Pipe.open()
    pipe.reply({{"ready": True, "nofile": pipe.nofile}})
    async for cmd in pipe:
        pipe.reply({{"twice": 2 * cmd["x"]}})
    pipe.reply({{"bye": True}})

asyncio.run(main())
"""


async def test_a_client_process_answers_each_command_and_ends_on_quit() -> None:
    code = _CHILD.format(bench=str(Path(__file__).resolve().parents[1] / "bench"))
    child = await harness.ClientProc([sys.executable, "-c", code]).started()
    try:
        assert child.hello["ready"] is True and child.hello["nofile"] > 0
        assert await child.run(x=21) == {"twice": 42}
        assert await child.run(x=1) == {"twice": 2}
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_the_rl_step_workloads_are_the_same_for_a_salt_and_fresh_for_another() -> None:
    from workloads import make_work

    def draw(name: str, salt: str):
        w = make_work(name, shape="0.5b", quick=True, vocab=151936, salt=salt)
        return [(it.prompt, it.max_new, it.group) for it in w.items], w.sessions, w.waits

    for name in ("grpo2048x8", "grpo512x4f16", "grpo", "long", "short", "agent", "update"):
        assert draw(name, "0-sdk") == draw(name, "0-sdk"), name
        assert draw(name, "0-sdk")[0] != draw(name, "0-raw")[0], name
    grpo = make_work("grpo512x4f16", shape="0.5b", quick=False, vocab=151936, salt="s")
    assert len(grpo.items) == 64 * 4 and {it.max_new for it in grpo.items} == {16}
    assert grpo.ideal_prefill == 64 * 512, "a group's prompt is prefilled once"
    update = make_work("update", shape="0.5b", quick=True, vocab=151936, salt="s")
    assert update.name == "update" and len(update.items) == 8 * 8
    with pytest.raises(ValueError, match="unknown workload"):
        make_work("nope", shape="0.5b", quick=True, vocab=151936, salt="s")


def test_the_sides_of_a_repetition_send_fresh_prompts_of_one_shape() -> None:
    """A long-tailed step's wall is its longest sample's: two sides compared in one repetition draw the same
    lengths, prompt sizes and waits (shape_salt) and different prompts (salt: no cache hits between them)."""
    from workloads import make_work

    def shape(w):
        return [(len(it.prompt), it.max_new) for it in w.items], [len(s) for s in w.sessions], w.waits

    def ids(w):
        return [it.prompt for it in w.items], w.sessions

    for name in ("grpo2048x8", "grpo", "agent", "update"):
        raw = make_work(name, shape="7b", quick=False, vocab=151936, salt="1-raw", shape_salt="1")
        sdk = make_work(name, shape="7b", quick=False, vocab=151936, salt="1-sdk", shape_salt="1")
        assert shape(raw) == shape(sdk), name
        assert ids(raw) != ids(sdk), name
        other = make_work(name, shape="7b", quick=False, vocab=151936, salt="2-raw", shape_salt="2")
        assert shape(other) != shape(raw), name
    # the long-tailed lengths vary within a workload (the cap and the median both occur)
    lengths = [it.max_new for it in make_work("grpo2048x8", shape="7b", quick=False, vocab=151936, salt="s").items]
    assert max(lengths) == 2048 and min(lengths) < 300
