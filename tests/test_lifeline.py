"""No process the SDK starts outlives its parent, whatever kills the parent (issue 36 item 10; server/lifeline.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.errors import RolloutError

HANG_GUARD_S = 60.0  # only against a hang: no assertion depends on it

_PARENT = """
import multiprocessing, sys, time

def child(lifeline):
    if lifeline:
        from rollout_sdk.server.lifeline import die_with_parent
        assert die_with_parent()
    while True:
        time.sleep(3600)  # blocked for good: only the lifeline can end it

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1] == "1",))
    p.start()
    print(p.pid, flush=True)
    while True:
        time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    """The live descendants of ``pid`` (from /proc: each task's children)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            with contextlib.suppress(OSError):
                kids = [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
                out += kids
                todo += kids
    return [k for k in out if _alive(k)]


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)  # a poll of process state, not a duration


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
@pytest.mark.parametrize("lifeline", [True, False])
def test_a_child_with_a_lifeline_dies_with_its_sigkilled_parent(lifeline: bool) -> None:
    """The child blocks for good; only its lifeline can end it once the parent is SIGKILLed (the control
    without it stays: the harness can tell)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, "1" if lifeline else "0"], stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=HANG_GUARD_S)
        if lifeline:
            _wait(lambda: not _alive(child), "the child leaves with its parent")
        else:
            assert _alive(child)  # nothing ends it: what the lifeline prevents
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
async def test_a_server_killed_mid_decode_leaves_no_child(spawn_server) -> None:
    """A server whose decode worker is decoding large requests is SIGKILLed: every process it started goes."""
    server = spawn_server("--engine", "fake", "--fake-step-base-s", "0.002")
    pid = server.proc.pid
    big = [
        i % 150_000 + 1 for i in range(200_000)
    ]  # ~600 KB encoded: decoded in the worker (offload_decode_bytes 256 KiB)
    async with RolloutClient(servers=[server.address], retries=0) as client:
        first = await client.generate(big, sampling=SamplingParams(max_new_tokens=1))
        assert first.prompt_tokens == len(big)
        kids = _children(pid)
        assert kids, "the decode worker runs"
        more = [
            asyncio.ensure_future(client.generate(big, sampling=SamplingParams(max_new_tokens=1))) for _ in range(8)
        ]
        await asyncio.sleep(0)  # a yield: the 8 frames go out; the worker decodes them one by one
        os.kill(pid, signal.SIGKILL)
        server.proc.wait(timeout=HANG_GUARD_S)
        results = await asyncio.gather(*more, return_exceptions=True)
        assert all(isinstance(r, RolloutError) or not isinstance(r, BaseException) for r in results)
    _wait(lambda: not any(_alive(k) for k in kids), f"the server's children {kids} are gone")
