"""Launch under real torchrun (gloo, CPU): DP x TP layouts, discovery through the c10d store, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_sdk import DiscoveryError, RolloutClient, SamplingParams
from rollout_sdk.errors import ConfigError
from rollout_sdk.launch import Layout, StoreDiscovery

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _env(sdk_home: Path, tag: str = "") -> dict[str, str]:
    return dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home), PYTHONUNBUFFERED="1", ROLLOUT_SDK_TEST_TAG=tag)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``ROLLOUT_SDK_TEST_TAG=tag`` (torchrun and every worker:
    torchrun starts each worker in a session of its own, so sessions cannot find them)."""
    needle = f"ROLLOUT_SDK_TEST_TAG={tag}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(int(entry))
    return out


def _wait_gone(tag: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _tagged(tag):
            return []
        time.sleep(0.1)
    return _tagged(tag)


@pytest.fixture
def tag() -> Iterator[str]:
    """A tag for the processes a test starts; whatever carries it is killed at teardown."""
    value = uuid.uuid4().hex
    yield value
    for pid in _tagged(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- layout (no processes) -----------------------------------------------------------------------


def test_layout_from_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}
    lay = Layout.from_env(2, env)
    assert (lay.dp, lay.dp_rank, lay.tp_rank, lay.is_leader, lay.nnodes) == (4, 1, 1, False, 2)
    assert lay.tp_ranks == [2, 3]
    assert Layout.from_env(4, dict(env, RANK="4")).is_leader
    with pytest.raises(ConfigError, match="must divide"):
        Layout.from_env(3, env)
    with pytest.raises(ConfigError, match="torchrun"):
        Layout.from_env(1, {})


# -- jobs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 1])
def test_driver_on_rank0_spreads_100_requests_over_every_dp_server(tmp_path, sdk_home, tiny_model, tp, tag) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        _torchrun(
            "--nproc-per-node",
            "4",
            str(ROOT / "examples" / "driver.py"),
            "--tp",
            str(tp),
            "--engine",
            "cpu",
            "--model",
            str(tiny_model),
            "--requests",
            "100",
            "--report",
            str(report),
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(sdk_home, tag),
        cwd=ROOT,
    )
    assert _wait_gone(tag, 15) == []
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(report.read_text())
    dp = 4 // tp
    assert summary["servers"] == [f"dp{d}" for d in range(dp)]
    assert summary["requests"] == 100
    assert sorted(summary["per_server"]) == [f"dp{d}" for d in range(dp)]
    assert min(summary["per_server"].values()) >= 100 // dp - 10


def _secret_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """``env`` with a fresh job secret file (mode 0600), as every node of a real job would get it."""
    from rollout_sdk import JobSecret

    path = tmp_path / "job.secret"
    if not path.exists():
        JobSecret.generate().write(path)
    return dict(env, ROLLOUT_SDK_SECRET_FILE=str(path))


def test_two_nodes_on_one_machine(tmp_path, sdk_home, tag) -> None:
    """Across nodes the servers bind every interface, so the job needs (and here has) authentication."""
    port = _free_port()
    report = tmp_path / "report.json"
    procs = [
        subprocess.Popen(
            _torchrun(
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "twonodes",
                str(ROOT / "examples" / "driver.py"),
                "--tp",
                "1",
                "--engine",
                "fake",
                "--requests",
                "100",
                "--report",
                str(report),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_secret_env(_env(sdk_home, tag), tmp_path),
            cwd=ROOT,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    summary = json.loads(report.read_text())
    assert summary["servers"] == ["dp0", "dp1", "dp2", "dp3"]
    assert sum(summary["per_server"].values()) == 100
    assert len(summary["per_server"]) == 4
    # across nodes the servers bind every interface and publish a reachable address, not 127.0.0.1
    assert not re.search(r"serving at tcp://127\.0\.0\.1", "\n".join(outs))
    assert "\n".join(outs).count("(authentication on)") == 4


def _start_service(
    sdk_home: Path, tag: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        _torchrun("--nproc-per-node", "4", str(ROOT / "launch" / "serve.py"), *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or _env(sdk_home, tag),
        cwd=ROOT,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    store = ""
    serving = 0
    lines = []
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(r"ROLLOUT_SDK_STORE=(\S+)", line)
        if m:
            store = m.group(1).rstrip(")")
        if "serving at" in line:
            serving += 1
        if store and serving == 4 // int(dict(zip(extra[::2], extra[1::2], strict=False)).get("--tp", "1")):
            return proc, store
    proc.kill()
    raise AssertionError("service did not start:\n" + "".join(lines[-40:]))


def _drain(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.read()


def test_external_client_discovers_a_running_service_then_sigterm_leaves_nothing(sdk_home, tag) -> None:
    proc, store = _start_service(sdk_home, tag, "--tp", "2", "--engine", "fake", "--fake-step-base-s", "0.002")
    try:
        code = (
            "import asyncio, collections, sys\n"
            "from rollout_sdk import RolloutClient, SamplingParams\n"
            "from rollout_sdk.launch import StoreDiscovery\n"
            "async def main():\n"
            "    async with RolloutClient(discovery=StoreDiscovery(sys.argv[1])) as c:\n"
            "        rs = await asyncio.gather(*(c.generate([1, 2, i], sampling=SamplingParams(max_new_tokens=4))"
            " for i in range(50)))\n"
            "        print('SERVED', sorted(collections.Counter(r.server_id for r in rs).items()))\n"
            "asyncio.run(main())\n"
        )
        out = subprocess.run([sys.executable, "-c", code, store], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "SERVED [('dp0', 25), ('dp1', 25)]" in out.stdout
        # a running job, SIGTERM to torchrun: every rank stops cleanly, no process is left
        assert len(_tagged(tag)) == 5  # torchrun + 4 ranks
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log = _drain(proc)
        assert _wait_gone(tag, 15) == [], "processes left behind"
        assert log.count("stopping: SIGTERM") + log.count("stopping: job shutdown") == 4, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_mid_run_of_a_driver_job_leaves_no_process(tmp_path, sdk_home, tag) -> None:
    proc = subprocess.Popen(
        _torchrun(
            "--nproc-per-node",
            "4",
            str(ROOT / "examples" / "driver.py"),
            "--tp",
            "1",
            "--engine",
            "fake",
            "--fake-step-base-s",
            "0.01",
            "--requests",
            "400",
            "--max-new-tokens",
            "100000",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(sdk_home, tag),
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        serving = 0
        while serving < 4 and time.monotonic() < deadline:
            serving += "serving at" in proc.stdout.readline()
        time.sleep(1.0)  # the driver's requests are in flight
        assert len(_tagged(tag)) == 5
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert _wait_gone(tag, 15) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killing_one_rank_fails_the_job_fast_naming_the_rank(sdk_home, tag) -> None:
    proc, _ = _start_service(sdk_home, tag, "--tp", "1", "--engine", "fake")
    try:
        victim = None
        for pid in _tagged(tag):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"RANK=2" in env:
                victim = pid
        assert victim is not None
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        log = _drain(proc)
        assert rc != 0
        assert elapsed < 30
        assert re.search(r"rank\s*:\s*2", log), log[-3000:]
        assert _wait_gone(tag, 15) == []
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_discovery_timeout_names_the_missing_ranks() -> None:
    import msgspec
    import torch.distributed as dist

    from rollout_sdk.discovery.store import ServerRecord, StoreKeys

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = StoreKeys("rollout_sdk/a0")
    master.set(StoreKeys.latest(), keys.prefix)
    master.set(keys.num_servers, "3")
    rec = ServerRecord(
        address="tcp://127.0.0.1:1", dp_rank=1, tp_size=1, global_rank=1, node_rank=0, pid=1, backend="fake", model="m"
    )
    master.set(keys.server(1), msgspec.msgpack.encode(rec))
    disc = StoreDiscovery(f"127.0.0.1:{master.port}")
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"DP ranks \[0, 2\]") as info:
        await disc.open(timeout=1.0)
    assert info.value.missing == ["dp0", "dp2"]
    assert time.monotonic() - t0 < 5
    with pytest.raises(DiscoveryError, match="cannot reach"):
        await StoreDiscovery(f"127.0.0.1:{_free_port()}").open(timeout=1.0)


async def test_client_reads_the_store_from_the_environment(monkeypatch, sdk_home, tag) -> None:
    proc, store = _start_service(sdk_home, tag, "--tp", "1", "--engine", "fake")
    try:
        monkeypatch.setenv("ROLLOUT_SDK_STORE", store)
        async with RolloutClient() as client:
            assert sorted(s.server_id for s in client.servers) == ["dp0", "dp1", "dp2", "dp3"]
            r = await client.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=3))
            assert r.finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 60)
        _drain(proc)


# -- security (docs/security.md) -----------------------------------------------------------------


def test_a_job_binding_beyond_loopback_without_a_secret_refuses_in_one_line(sdk_home, tag) -> None:
    env = {k: v for k, v in _env(sdk_home, tag).items() if not k.startswith("ROLLOUT_SDK_SECRET")}
    proc = subprocess.run(
        _torchrun("--nproc-per-node", "1", str(ROOT / "launch" / "serve.py"), "--engine", "fake", "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("rollout-sdk: ")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ROLLOUT_SDK_SECRET_FILE" in lines[0] and "rollout-sdk secret" in lines[0]
    # the worker printed no traceback of its own (torchrun's agent still reports the failed worker)
    assert "ConfigError" not in proc.stdout + proc.stderr
    assert _wait_gone(tag, 15) == []


def _client_code() -> str:
    return (
        "import asyncio, sys\n"
        "from rollout_sdk import RolloutClient, SamplingParams, AuthenticationError\n"
        "from rollout_sdk.launch import StoreDiscovery\n"
        "async def main():\n"
        "    try:\n"
        "        async with RolloutClient(discovery=StoreDiscovery(sys.argv[1]), connect_timeout_s=60) as c:\n"
        "            r = await c.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=2))\n"
        "            print('SERVED', r.finish_reason)\n"
        "    except AuthenticationError as exc:\n"
        "        print('REFUSED', exc)\n"
        "asyncio.run(main())\n"
    )


def test_forged_shutdown_key_is_ignored_and_keyless_clients_are_refused(tmp_path, sdk_home, tag) -> None:
    import torch.distributed as dist

    env = _secret_env(_env(sdk_home, tag), tmp_path)
    proc, store = _start_service(sdk_home, tag, "--tp", "2", "--engine", "fake", env=env)
    try:
        host, port = store.rsplit(":", 1)
        attacker = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)  # no credentials needed
        attacker.set("rollout_sdk/a0/shutdown", b"evil: stop the job")
        assert proc.stdout is not None
        seen = []
        while not any("ignored a shutdown key" in ln for ln in seen):  # a rank's watcher saw it (logs)
            seen.append(proc.stdout.readline())
            assert seen[-1], "".join(seen[-40:])
        assert not any("stopping" in ln for ln in seen), "".join(seen[-40:])
        # the job still serves a client holding the secret; a client without it is refused
        keyed = subprocess.run(
            [sys.executable, "-c", _client_code(), store], capture_output=True, text=True, timeout=90, env=env
        )
        assert "SERVED length" in keyed.stdout, keyed.stdout + keyed.stderr[-2000:]
        bare = {k: v for k, v in env.items() if not k.startswith("ROLLOUT_SDK_SECRET")}
        keyless = subprocess.run(
            [sys.executable, "-c", _client_code(), store], capture_output=True, text=True, timeout=90, env=bare
        )
        assert "REFUSED" in keyless.stdout and "requires authentication" in keyless.stdout, keyless.stderr[-2000:]
        # a forged server record fails discovery for a client that holds the secret
        attacker.set("rollout_sdk/a0/server/1", b"\x80")
        forged = subprocess.run(
            [sys.executable, "-c", _client_code(), store], capture_output=True, text=True, timeout=90, env=env
        )
        assert "not signed with this job's secret" in forged.stderr, forged.stderr[-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log = _drain(proc)
        assert _wait_gone(tag, 15) == []
        stops = [ln for ln in log.splitlines() if "stopping:" in ln]
        assert len(stops) == 4 and not any("evil" in ln for ln in stops), log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_job_without_a_secret_acts_on_no_store_record_from_the_network(sdk_home, tag) -> None:
    """Issue 25 item 1: torchrun's store listens on every interface; a job without a secret seals its store
    values with a key of its own (a 0600 file only this user reads), so a forged shutdown is ignored and a
    forged server record fails discovery for a client holding that key."""
    import stat as stat_mod

    import msgspec
    import torch.distributed as dist

    from rollout_sdk.discovery.store import ServerRecord

    proc, store = _start_service(sdk_home, tag, "--tp", "2", "--engine", "fake")
    try:
        assert proc.stdout is not None
        host, port = store.rsplit(":", 1)
        attacker = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        attacker.set("rollout_sdk/a0/shutdown", b"evil: stop the job")
        seen: list[str] = []
        while not any("ignored a shutdown key" in ln for ln in seen):
            seen.append(proc.stdout.readline())
            assert seen[-1], "".join(seen[-40:])
        assert not any("stopping" in ln for ln in seen), "".join(seen[-40:])
        keys = [p for d in _key_dirs() if d.exists() for p in d.glob("job-*.key") if _owned_by_tag(p, proc.pid)]
        assert len(keys) == 1, keys
        key = keys[0]
        assert stat_mod.S_IMODE(key.stat().st_mode) == 0o600
        env = dict(_env(sdk_home, tag), ROLLOUT_SDK_JOB_KEY_FILE=str(key))
        keyed = subprocess.run(
            [sys.executable, "-c", _client_code(), store], capture_output=True, text=True, timeout=90, env=env
        )
        assert "SERVED length" in keyed.stdout, keyed.stdout + keyed.stderr[-2000:]
        # a forged member registered from elsewhere: the job's key does not seal it, discovery refuses it
        forged = ServerRecord(
            address="tcp://10.9.9.9:1", dp_rank=1, tp_size=2, global_rank=2, node_rank=0, pid=1, backend="f", model="x"
        )
        attacker.set("rollout_sdk/a0/server/1", msgspec.msgpack.encode(forged))
        refused = subprocess.run(
            [sys.executable, "-c", _client_code(), store], capture_output=True, text=True, timeout=90, env=env
        )
        assert "not signed with this job's secret" in refused.stderr, refused.stderr[-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log = _drain(proc)
        assert _wait_gone(tag, 15) == []
        stops = [ln for ln in log.splitlines() if "stopping:" in ln]
        assert len(stops) == 4 and not any("evil" in ln for ln in stops), log[-3000:]
        assert not key.exists()  # removed when the job ends
    finally:
        if proc.poll() is None:
            proc.kill()


def _key_dirs() -> list[Path]:
    import tempfile

    bases = [os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()]
    return [Path(b) / f"rollout_sdk-{os.getuid()}" for b in bases]


def _owned_by_tag(path: Path, torchrun_pid: int) -> bool:
    """The key file of the job whose torchrun agent is ``torchrun_pid`` (its name starts with the agent's pid)."""
    return path.name.startswith(f"job-{torchrun_pid}-")
