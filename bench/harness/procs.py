"""Processes a benchmark starts, and the guarantee that it stops every one of them.

Servers print ``READY <address>`` once serving; :class:`ServerProcs` reads their stdout for that line (a
handshake, not a sleep) and stops them SIGTERM-first.  :func:`sigterm_as_interrupt` makes a timeout's
SIGTERM unwind like Ctrl-C, so the ``finally`` blocks run.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

#: the repository root: the working directory of the processes a benchmark starts
ROOT = Path(__file__).resolve().parents[2]


def fake_server_argv(*options: str) -> list[str]:
    """``python -m rollout_sdk serve --engine fake <options>``: the no-GPU engine most benchmarks drive."""
    return [sys.executable, "-m", "rollout_sdk", "serve", "--engine", "fake", *options]


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

    def __init__(self, logdir: Path, cwd: Path = ROOT) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.logdir = logdir
        self._cwd = cwd

    @classmethod
    @contextlib.contextmanager
    def session(cls, prefix: str, *, keep_logs: bool = False, **kwargs: Any) -> Iterator[Self]:
        """Processes logged in a new temporary folder (``keep_logs``: left for a post-mortem), every one of
        them stopped when the block ends, however it ends."""
        with contextlib.ExitStack() as stack:
            if keep_logs:
                logdir = tempfile.mkdtemp(prefix=prefix)
            else:
                logdir = stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))
            procs = cls(Path(logdir), **kwargs)
            try:
                yield procs
            finally:
                procs.stop()

    def spawn(
        self, name: str, argv: Sequence[str], timeout: float = 60.0, *, pipe_stdin: bool = False
    ) -> tuple[subprocess.Popen[str], str]:
        """Start ``argv`` and wait for its READY line; ``pipe_stdin``: its stdin is a pipe (commands)."""
        log_path = self.logdir / f"{name}.log"
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
