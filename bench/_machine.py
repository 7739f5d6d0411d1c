"""What the CPU benchmark scripts share: logging, the quiet-machine check, clean exits.

Imported as ``_machine`` by the scripts in bench/ (run as ``python bench/<script>.py``, so bench/ is on
``sys.path``).  Other sessions' jobs on a shared machine make timings noisy: ``ForeignCpu`` measures
them over a run and ``wait_quiet`` waits for them to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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


def save_results(path: str, rows: list[Any], args: dict[str, Any]) -> dict[str, Any]:
    """Write ``{"meta": ..., "rows": rows}`` as JSON to ``path`` (meta: date, machine and load, ``args``);
    return the meta."""
    import json

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "args": args,
    }
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return meta


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ForeignCpu:
    """CPU used by every process other than this one and its children between start() and stop(), in % of
    one core (other jobs on a shared machine make the numbers noisy).  None without psutil."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:
            self._ps: Any = None
            return
        self._ps = psutil
        self._me = psutil.Process()
        self._t0 = 0.0
        self._busy0 = 0.0
        self._ours0 = 0.0

    def _busy(self) -> float:
        t = self._ps.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        return float(sum(t) - idle)

    def _ours(self) -> float:
        total = 0.0
        for p in [self._me, *self._me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except self._ps.Error:
                pass
        return total

    def start(self) -> None:
        if self._ps is not None:
            self._t0, self._busy0, self._ours0 = time.perf_counter(), self._busy(), self._ours()

    def stop(self) -> float | None:
        if self._ps is None:
            return None
        wall = time.perf_counter() - self._t0
        foreign = (self._busy() - self._busy0) - (self._ours() - self._ours0)
        return max(0.0, 100.0 * foreign / wall)


#: other processes' CPU (% of one core) under which the machine counts as quiet
QUIET_PCT = 20.0


async def wait_quiet(max_wait_s: float) -> None:
    """Wait (up to ``max_wait_s``) until other processes use less than QUIET_PCT of a core (1 s windows)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        meter = ForeignCpu()
        meter.start()
        await asyncio.sleep(1.0)
        load = meter.stop()
        if load is None or load < QUIET_PCT:
            return
        log(f"other processes use {load:.0f}% of a core; waiting up to {deadline - time.monotonic():.0f} s")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks stop every process this script started."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stop_processes(procs: list[Any], timeout: float = 15.0) -> None:
    """SIGTERM every process still running (servers drain and exit), then SIGKILL any left after ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        if p.stdout is not None:
            p.stdout.close()


class ServerProcs:
    """Server processes a benchmark starts (each ``argv`` prints ``READY <address>`` once serving, stderr to
    ``<logdir>/<name>.log``); :meth:`stop` terminates them, then kills what is left."""

    def __init__(self, logdir: Path, cwd: Path) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self._logdir = logdir
        self._cwd = cwd

    def spawn(
        self, name: str, argv: Sequence[str], timeout: float = 60.0, *, pipe_stdin: bool = False
    ) -> tuple[subprocess.Popen[str], str]:
        """Start ``argv`` and wait for its READY line; ``pipe_stdin``: its stdin is a pipe (commands)."""
        log_path = self._logdir / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if pipe_stdin else None,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                cwd=self._cwd,
            )
        self.procs.append(proc)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:  # read stdout until READY (a handshake, not a sleep)
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith("READY "):
                    return proc, line.split()[1]
        raise RuntimeError(f"server {name} did not become ready; its log:\n{log_path.read_text()[-4000:]}")

    def stop(self, procs: Sequence[subprocess.Popen[str]] | None = None) -> None:
        """Stop ``procs`` (default: all): SIGTERM (a server drains and exits), SIGKILL after 15 s."""
        targets = list(self.procs if procs is None else procs)
        stop_processes(targets)
        for p in targets:
            self.procs.remove(p)
