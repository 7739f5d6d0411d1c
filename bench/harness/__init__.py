"""The plumbing every benchmark in bench/ shares, so that a new benchmark is a workload, not a copy.

A script in bench/ is a workload: what it starts, what it drives and what it reports.  Everything around
that lives here, one noun a module:

* :mod:`harness.cli` -- the command line: a parser with the shared flags (``--quick``, ``--json``,
  ``--reps``, ``--no-uvloop``, ``--wait-quiet``/``--retries``) and mode defaults (``None`` means "full X,
  quick Y"); :func:`run` runs the workload's coroutine on uvloop with SIGTERM unwinding like Ctrl-C.
* :mod:`harness.machine` -- machine facts for a result's meta (date, host, CPU model, cores, load, package
  versions, the command), other people's CPU on a shared machine (:class:`ForeignCpu`), :func:`wait_quiet`.
* :mod:`harness.procs` -- server processes the benchmark starts and always stops (:class:`ServerProcs`),
  what /proc says of a process (RSS and its peak, children, open descriptors, CPU seconds by child), a free
  port, a process group stopped (:func:`stop_group`).
* :mod:`harness.pipe` -- a child process driven one JSON line at a time (the GPU benches' client process):
  :class:`ClientProc` is the parent's end, :class:`Pipe` the child's.
* :mod:`harness.serve` -- the other end: a script's own server child (``--serve``), its READY handshake,
  its stop on SIGTERM, and a loop-lag probe beside it (:func:`serve`, :func:`lag_window`).
* :mod:`harness.passes` -- repetitions of alternating sides (ABBA order, so drift through a run is not
  charged to one side) or rotated (:func:`rotate`), their medians, and a cell measured again when other
  people's load disturbed it; a plan of workloads and their sides run in rotation within a time budget
  (:func:`run_plan`), its rows read back by side (:func:`by_side`, :func:`ratios`, :func:`plan_summary`).
* :mod:`harness.stats` -- percentiles, medians, median [min-max] (:func:`span` as a result records it),
  piecewise-linear step costs.
* :mod:`harness.table` -- aligned text and Markdown tables, a ``median [min-max]`` cell.
* :mod:`harness.results` -- JSON results with the machine facts beside the numbers; :func:`publish`, a
  benchmark's last lines (the JSON written, the table, the runtime and where the numbers are).

A new benchmark, whole::

    # bench/mybench.py; its module docstring says what it measures and how to run it (that is its --help)
    import harness

    async def drive(args):
        sides = {"direct": ..., "gateway": ...}            # async callables of the repetition number
        runs = await harness.alternate(args.reps, sides)   # ABBA order
        return {side: harness.medians(rs, ["req_s", "p50_ms"]) for side, rs in runs.items()}

    p = harness.parser(__doc__, quick="one repetition", json="mybench", reps=3)
    args = harness.by_mode(p.parse_args(), ...)
    res = harness.run(drive(args))
    harness.write_json(args.json, {"meta": harness.facts(), "results": res})
    rows = [[side, f"{m['req_s']:,.0f}", f"{m['p50_ms']:.2f}"] for side, m in res.items()]
    print(harness.table(["side", "req/s", "p50 ms"], rows))

Scripts run as ``python bench/<name>.py``, so bench/ is on ``sys.path`` and this package imports as
``harness``.  Nothing here runs at import time.
"""

from __future__ import annotations

from harness.cli import add_quiet, by_mode, loop_runner, mode_facts, parser, run
from harness.machine import QUIET_PCT, CpuMeter, ForeignCpu, cpu_model, facts, foreign_load, log, versions, wait_quiet
from harness.passes import (
    Plan,
    abba,
    alternate,
    by_side,
    medians,
    plan_summary,
    ratios,
    rotate,
    run_plan,
    until_quiet,
)
from harness.pipe import ClientProc, Pipe, raise_nofile
from harness.procs import (
    ServerProcs,
    child_pids,
    cpu_times,
    fake_server_argv,
    free_port,
    num_fds,
    read_until,
    reset_peak,
    rss_kb,
    sigterm_as_interrupt,
    stop_group,
    stop_processes,
)
from harness.results import publish, save_results, write_json
from harness.serve import lag_window, serve
from harness.stats import interpolate, median, pct, span, spread
from harness.table import markdown, records, span_cell, table

__all__ = [
    "QUIET_PCT",
    "ClientProc",
    "CpuMeter",
    "ForeignCpu",
    "Pipe",
    "Plan",
    "ServerProcs",
    "abba",
    "add_quiet",
    "alternate",
    "by_mode",
    "by_side",
    "child_pids",
    "cpu_model",
    "cpu_times",
    "facts",
    "fake_server_argv",
    "foreign_load",
    "free_port",
    "interpolate",
    "lag_window",
    "log",
    "loop_runner",
    "markdown",
    "median",
    "medians",
    "mode_facts",
    "num_fds",
    "parser",
    "pct",
    "plan_summary",
    "publish",
    "raise_nofile",
    "ratios",
    "read_until",
    "records",
    "reset_peak",
    "rotate",
    "rss_kb",
    "run",
    "run_plan",
    "save_results",
    "serve",
    "sigterm_as_interrupt",
    "span",
    "span_cell",
    "spread",
    "stop_group",
    "stop_processes",
    "table",
    "until_quiet",
    "versions",
    "wait_quiet",
    "write_json",
]
