"""A real bound on shutdown (issue 25 item 4): SIGTERM ends the process with a control call pending whose
worker thread can never be joined, in ``serve``, under torchrun, and with the embedded default.

The fake engine's ``hang_init_weight_group`` blocks a worker thread for good (a collective whose peers never
come).  Without the bound, ``serve`` never exits (asyncio and the interpreter both join that thread) and a
torchrun rank is SIGKILLed by its agent.  No assertion is on a duration: the test waits for the exit with a
hang guard, and checks how it exited (the log line of the abandoned thread, the exit code).
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_sdk.protocol import ErrorReply, InitWeightGroup
from test_faults import Raw
from test_launch import _drain, _env, _tagged, _torchrun, _wait_gone, tag  # noqa: F401  (tag is a fixture)

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120.0  # only against a hang: no assertion depends on it


_BLOCKED = "fake: init_weight_group blocks a worker thread for good"


def _stuck_init(call_id: str) -> InitWeightGroup:
    return InitWeightGroup(call_id=call_id, master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)


async def _hang_a_control_call(address: str, out: Any) -> Raw:
    """Send the control call that blocks a worker thread; return once the engine logged that it does."""
    raw = Raw(address)
    await raw.send(_stuck_init("stuck"))
    while True:
        line = await asyncio.wait_for(asyncio.to_thread(out.readline), HANG_GUARD_S)
        assert line, "the process ended before the control call ran"
        if _BLOCKED in line:
            return raw


async def test_serve_exits_on_sigterm_with_a_control_call_stuck_in_a_thread(spawn_server) -> None:
    srv = spawn_server("--engine", "fake", "--fake-hang-init-weight-group")
    raw = await _hang_a_control_call(srv.address, srv.proc.stdout)
    try:
        srv.proc.send_signal(signal.SIGTERM)
        reply = await raw.recv(HANG_GUARD_S)  # the pending call is answered before the process leaves
        assert isinstance(reply, ErrorReply) and (reply.code, reply.call_id) == ("shutting_down", "stuck")
        code = await asyncio.to_thread(srv.proc.wait, HANG_GUARD_S)
        assert code == 0
        assert srv.proc.stdout is not None
        out = srv.proc.stdout.read()
        assert "exiting without them" in out, out[-2000:]
    finally:
        raw.close()


@pytest.mark.slow
async def test_a_torchrun_rank_exits_on_sigterm_with_a_control_call_stuck_in_a_thread(sdk_home, tag, tmp_path) -> None:  # noqa: F811
    env = dict(_env(sdk_home, tag), XDG_RUNTIME_DIR=str(tmp_path))  # where the job's key file is made
    proc = subprocess.Popen(
        _torchrun(
            "--standalone", "--nproc-per-node", "1", str(ROOT / "launch" / "serve.py"),
            "--engine", "fake", "--fake-hang-init-weight-group",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        address = ""
        lines: list[str] = []
        while not address:
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, "".join(lines[-40:])
            lines.append(line)
            m = re.search(r"serving at (tcp://\S+)", line)
            address = m.group(1) if m else ""
        raw = await _hang_a_control_call(address, proc.stdout)
        try:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, HANG_GUARD_S)
        finally:
            raw.close()
        log = "".join(lines) + _drain(proc)
        # the rank left by itself (the abandoned thread's line), not by the agent's SIGKILL after 30 s
        assert "exiting without them" in log, log[-3000:]
        assert "stopping: SIGTERM" in log or "stopping: job shutdown" in log, log[-3000:]
        assert _wait_gone(tag, 30) == []
        # the hard exit skips every finally: the job's key file is removed just before it
        assert list(tmp_path.rglob("*.key")) == [], log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


_EMBEDDED = """
import asyncio, sys
from rollout_sdk import RolloutClient, SamplingParams

async def main():
    async with RolloutClient() as client:
        await client.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
        print("READY", flush=True)
        while True:
            await client.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=64))

asyncio.run(main())
"""


def test_the_embedded_default_exits_on_sigterm_and_leaves_no_process(sdk_home, tag) -> None:  # noqa: F811
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMBEDDED],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(sdk_home, tag),
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("READY"):
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines[-40:])
        assert _tagged(tag)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(HANG_GUARD_S)
        assert code == -signal.SIGTERM  # the default disposition: the process ends at once, threads and all
        assert _wait_gone(tag, 30) == []  # and nothing it started outlives it
    finally:
        if proc.poll() is None:
            proc.kill()
