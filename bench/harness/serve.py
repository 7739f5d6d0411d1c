"""A benchmark's own server process: the script started again as its child (``--serve``), serving an
``EngineServer`` it builds, with the handshake and the stop every such child shares.

The child prints ``READY <address>`` once bound (what :meth:`harness.procs.ServerProcs.spawn` waits for),
SIGTERM stops the server (it drains and exits, so :func:`harness.procs.stop_processes` ends it cleanly),
and, asked to, a loop-lag probe runs beside it: a task sleeping 1 ms in a loop, recording each wake-up's
``(when, how late, CPU the loop thread spent meanwhile)``, written as JSON when the server stops.  The
parent reads a window of them with :func:`lag_window`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: the probe's sleep: a wake-up later than this by X means the loop was busy for X
PROBE_S = 0.001


async def serve(
    server: Any,
    *,
    lag_samples: str | Path | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop_signals: Sequence[signal.Signals] = (signal.SIGTERM,),
) -> None:
    """Serve ``server`` (an unopened ``EngineServer``) until one of ``stop_signals``; ``on_ready(address)``
    runs just before the READY line; ``lag_samples``: run the loop-lag probe and write its samples there."""
    loop = asyncio.get_running_loop()
    for sig in stop_signals:
        loop.add_signal_handler(sig, server.stop)
    samples: list[tuple[float, float, float]] = []
    probe = asyncio.create_task(_probe(samples)) if lag_samples else None

    def ready(address: str) -> None:
        if on_ready is not None:
            on_ready(address)
        print(f"READY {address}", flush=True)

    try:
        await server.serve(on_ready=ready)
    finally:
        if probe is not None:
            probe.cancel()
            Path(str(lag_samples)).write_text(json.dumps(samples))


async def _probe(samples: list[tuple[float, float, float]]) -> None:
    perf, cpu = time.perf_counter, time.thread_time
    while True:
        t, c = perf(), cpu()
        await asyncio.sleep(PROBE_S)
        samples.append((time.time(), perf() - t - PROBE_S, cpu() - c))


def lag_window(path: str | Path, t0: float, t1: float) -> tuple[list[float], list[float]]:
    """The probe's samples taken between wall-clock times ``t0`` and ``t1``: (how late each wake-up was,
    the loop thread's CPU during each), in seconds."""
    rows = [r for r in json.loads(Path(path).read_text()) if t0 <= r[0] <= t1]
    return [r[1] for r in rows], [r[2] for r in rows]
