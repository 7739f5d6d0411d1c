"""Processes a benchmark starts, and the guarantee that it stops every one of them.

Servers print ``READY <address>`` once serving; :class:`ServerProcs` reads their stdout for that line
(:func:`read_until`: a handshake, not a sleep) and stops them SIGTERM-first.  :func:`sigterm_as_interrupt`
makes a timeout's SIGTERM unwind like Ctrl-C, so the ``finally`` blocks run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

#: the repository root: the working directory of the processes a benchmark starts
ROOT = Path(__file__).resolve().parents[2]


def read_until(
    proc: subprocess.Popen[str], pattern: str, timeout: float, *, seen: list[str] | None = None
) -> re.Match[str]:
    """Read ``proc``'s stdout a line at a time until one matches ``pattern`` (``re.search``): the match.  A
    handshake, not a sleep; RuntimeError when its stdout ends or ``timeout`` passes first.  ``seen``: every
    line read is appended to it (for an error message).

    The lines are read in a thread that ends with the match or the stream (a select() on the pipe would
    miss lines already in the text buffer); after a timeout it ends when the caller stops the process."""
    assert proc.stdout is not None
    stdout = proc.stdout
    found: list[re.Match[str]] = []

    def scan() -> None:
        for line in iter(stdout.readline, ""):
            if seen is not None:
                seen.append(line)
            if (m := re.search(pattern, line)) is not None:
                found.append(m)
                return

    reader = threading.Thread(target=scan, name=f"read_until {pattern}", daemon=True)
    reader.start()
    reader.join(timeout)
    if found:
        return found[0]
    if reader.is_alive():
        raise RuntimeError(f"no {pattern!r} from {proc.args!r} within {timeout} s")
    raise RuntimeError(f"process {proc.args!r} ended before printing {pattern!r}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process that takes a port number)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """A process's memory from /proc (``VmRSS``, or ``VmHWM``: its peak), in KiB; -1 when not there."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def reset_peak(pid: int) -> None:
    """Reset a process's ``VmHWM`` to its current RSS (so the next peak is this phase's)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def child_pids(pid: int) -> list[int]:
    """A process's direct children (its worker processes), from /proc; none when it cannot be read."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def num_fds(pid: int) -> int:
    """How many file descriptors a process has open (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_times(http_proc: Any = None) -> dict[str, float]:
    """CPU seconds so far: this thread (the event loop), each child process of this one by name (``client``
    for a ``--client`` one), and the process tree ``http_proc`` leads (``http:<name>``); this thread's alone
    without psutil."""
    out = {"loop": time.thread_time()}
    try:
        import psutil
    except ImportError:
        return out
    http_tree: list[Any] = []
    if http_proc is not None:
        with contextlib.suppress(psutil.Error):
            hp = psutil.Process(http_proc.pid)
            http_tree = [hp, *hp.children(recursive=True)]
    skip = {p.pid for p in http_tree}
    for c in psutil.Process().children(recursive=True):
        if c.pid in skip:
            continue
        with contextlib.suppress(psutil.Error):
            name = "client" if "--client" in c.cmdline() else c.name()
            t = c.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system
    for c in http_tree:
        with contextlib.suppress(psutil.Error):
            t = c.cpu_times()
            out["http:" + c.name()] = out.get("http:" + c.name(), 0.0) + t.user + t.system
    return out


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session=True``: a server and its
    children), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


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
        try:
            return proc, read_until(proc, r"^READY (\S+)", timeout).group(1)
        except RuntimeError:
            raise RuntimeError(
                f"server {name} did not become ready; its log:\n{log_path.read_text()[-4000:]}"
            ) from None

    def stop(self, procs: Sequence[subprocess.Popen[str]] | None = None) -> None:
        """Stop ``procs`` (default: all): SIGTERM (a server drains and exits), SIGKILL after 15 s."""
        targets = list(self.procs if procs is None else procs)
        stop_processes(targets)
        for p in targets:
            self.procs.remove(p)
