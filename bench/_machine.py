"""The old name of the harness's machine and process plumbing, kept for bench/gpu_rlstep.py (issue 40
changes it this session; port it to ``import harness`` and delete this file)."""

from __future__ import annotations

from harness import (
    QUIET_PCT,
    ForeignCpu,
    ServerProcs,
    log,
    save_results,
    sigterm_as_interrupt,
    stop_processes,
    wait_quiet,
)

__all__ = [
    "QUIET_PCT",
    "ForeignCpu",
    "ServerProcs",
    "log",
    "save_results",
    "sigterm_as_interrupt",
    "stop_processes",
    "wait_quiet",
]
