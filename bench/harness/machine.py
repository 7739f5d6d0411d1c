"""Facts about the machine a number came from, and other people's load on it.

A figure means nothing without its machine: :func:`facts` is what every result's meta records.  On a
shared machine other sessions' jobs make timings noisy: :class:`ForeignCpu` measures them over a run and
:func:`wait_quiet` waits for them to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the packages whose versions a result records unless a benchmark names its own
DISTS = ("rollout-sdk", "pyzmq", "msgspec", "uvloop", "psutil")

#: other processes' CPU (% of one core) under which the machine counts as quiet
QUIET_PCT = 20.0


def log(msg: str) -> None:
    """A timestamped progress line on stderr (stdout is the benchmark's table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def versions(dists: Sequence[str] = DISTS) -> dict[str, Any]:
    """Python's and each distribution's version (``None`` where not installed), and libzmq's."""
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return out


def facts(dists: Sequence[str] = DISTS) -> dict[str, Any]:
    """Date (UTC), host, platform, CPU model, cores (and those this process may use), load average,
    package versions and the command line: what a result's reader needs to weigh it."""
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "versions": versions(dists),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (all but idle and iowait), from /proc/stat; None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # guest time is inside user


class CpuMeter:
    """CPU time between start() and stop(), in % of one core: this process, its descendants (servers, Ray's
    workers) and everything else on the machine ("foreign": other people's jobs on a shared machine, which
    make the numbers noisy).  With psutil every live descendant counts; without it, /proc/stat and
    ``os.times`` (children count once waited for).  None where neither is available."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:
            psutil = None
        self._ps: Any = psutil
        self._me = psutil.Process() if psutil is not None else None
        self._t0 = 0.0
        self._mine0 = 0.0
        self._kids0: dict[int, float] = {}
        self._busy0: float | None = None

    def _busy(self) -> float | None:
        if self._ps is None:
            return _machine_busy_s()
        t = self._ps.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0) + getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        return float(sum(t) - idle)

    def _mine(self) -> float:
        if self._ps is None:
            t = os.times()
            return t.user + t.system
        t = self._me.cpu_times()
        return float(t.user + t.system)

    def _kids(self) -> dict[int, float]:
        if self._ps is None:
            t = os.times()
            return {0: t.children_user + t.children_system}
        out: dict[int, float] = {}
        for p in self._me.children(recursive=True):
            try:
                t = p.cpu_times()
                out[p.pid] = float(t.user + t.system)
            except self._ps.Error:
                pass
        return out

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._mine0, self._kids0, self._busy0 = self._mine(), self._kids(), self._busy()

    def stop_all(self) -> tuple[float, float, float] | None:
        """(this process, its descendants, foreign) in % of one core since start()."""
        busy = self._busy()
        wall = time.perf_counter() - self._t0
        if busy is None or self._busy0 is None or wall <= 0:
            return None
        mine = self._mine() - self._mine0
        kids = sum(t - self._kids0.get(pid, 0.0) for pid, t in self._kids().items())
        foreign = max(0.0, busy - self._busy0 - mine - kids)
        return 100.0 * mine / wall, 100.0 * kids / wall, 100.0 * foreign / wall

    def stop(self) -> float | None:
        """Foreign CPU since start(), in % of one core."""
        cpu = self.stop_all()
        return None if cpu is None else cpu[2]


#: the meter as the scripts that only want other people's load call it
ForeignCpu = CpuMeter


async def foreign_load(seconds: float = 1.0) -> float | None:
    """CPU used by processes other than this one and its descendants, % of one core, over ``seconds``."""
    meter = CpuMeter()
    meter.start()
    await asyncio.sleep(seconds)
    return meter.stop()


async def wait_quiet(max_wait_s: float, threshold_pct: float = QUIET_PCT) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use less than ``threshold_pct`` of a core (1 s
    windows); the last load measured (None when not measured)."""
    if max_wait_s <= 0:
        return None
    deadline = time.monotonic() + max_wait_s
    load = await foreign_load()
    while load is not None and load >= threshold_pct and time.monotonic() < deadline:
        log(f"other processes use {load:.0f}% of a core; waiting up to {deadline - time.monotonic():.0f} s")
        load = await foreign_load()
    return load
