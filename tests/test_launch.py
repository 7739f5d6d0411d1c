"""Launch under real torchrun (gloo, CPU): DP x TP layouts, discovery through the c10d store, shutdown.

Every torchrun job costs seconds of CPU (each rank imports torch): the tests that only observe a healthy
service share one (``service``, module scope), a test that ends that service takes it for itself, and the
others start the smallest job that shows their property.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_sdk import DiscoveryError, RolloutClient, SamplingParams
from rollout_sdk.discovery.store import StoreDiscovery
from rollout_sdk.errors import ConfigError
from rollout_sdk.launch import Layout

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
HANG_GUARD_S = 120.0  # only against a hang: no assertion depends on it


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
    """Two DP servers of the CPU engine either way (a CPU engine costs seconds of CPU to start); with tp=2
    each has a TP member beside its leader, which holds no engine."""
    dp = 2
    report = tmp_path / "report.json"
    proc = subprocess.run(
        _torchrun(
            "--nproc-per-node",
            str(dp * tp),
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
                "1",  # a rank (a server) on each node: what crosses nodes is what this test shows
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
    assert summary["servers"] == ["dp0", "dp1"]
    assert [o.count("serving at") for o in outs] == [1, 1]  # one on each node
    assert sum(summary["per_server"].values()) == 100
    assert len(summary["per_server"]) == 2
    # across nodes the servers bind every interface and publish a reachable address, not 127.0.0.1
    assert not re.search(r"serving at tcp://127\.0\.0\.1", "\n".join(outs))
    assert "\n".join(outs).count("(authentication on)") == 2


class _Job:
    """A torchrun job a test started.  A thread of its own reads the job's output (stdout and stderr) into
    ``lines``, which the test waits on (``wait_for``): a job that lives through several tests never blocks
    on a full pipe, and nothing is read twice."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.tag = env["ROLLOUT_SDK_TEST_TAG"]
        self.store = ""  # its c10d store, host:port (printed by rank 0)
        self.lines: list[str] = []
        self._ended = False
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            _torchrun(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
        self._reader = threading.Thread(target=self._read, name=f"job-output-{self.proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], start: int = 0) -> int:
        """The index of the first output line from ``start`` on for which ``pred`` holds; AssertionError
        (with the output's tail) when the output ends first, or past the hang guard."""
        deadline = time.monotonic() + HANG_GUARD_S
        with self._cond:
            while True:
                for i in range(start, len(self.lines)):
                    if pred(self.lines[i]):
                        return i
                start = len(self.lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    raise AssertionError("no such line in the job's output:\n" + "".join(self.lines[-40:]))
                self._cond.wait(left)

    def output(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def finish(self, timeout: float = 60) -> str:
        """Wait for the job to end; its whole output."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return self.output()

    def close(self) -> None:
        """End whatever is left of the job: SIGTERM to a torchrun still running (its ranks stop and clean up),
        then SIGKILL to any process left that carries its tag."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        for pid in _tagged(self.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=60)


def _start_service(env: dict[str, str], *extra: str, nproc: int = 4) -> _Job:
    """``launch/serve.py`` on ``nproc`` ranks; returns once rank 0 printed the store and every server serves."""
    job = _Job(["--nproc-per-node", str(nproc), str(ROOT / "launch" / "serve.py"), *extra], env)
    try:
        i = job.wait_for(lambda ln: "ROLLOUT_SDK_STORE=" in ln)
        m = re.search(r"ROLLOUT_SDK_STORE=(\S+)", job.lines[i])
        assert m is not None
        job.store = m.group(1).rstrip(")")
        i = -1
        for _ in range(nproc // int(dict(zip(extra[::2], extra[1::2], strict=False)).get("--tp", "1"))):
            i = job.wait_for(lambda ln: "serving at" in ln, i + 1)
        _wait_ranks_running(job, nproc)
    except BaseException:
        job.close()
        raise
    return job


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for signal ``sig`` (its SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("SigCgt:")), 0)
    return bool(caught >> (sig - 1) & 1)


def _wait_ranks_running(job: _Job, nproc: int) -> None:
    """Wait until each of the job's ``nproc`` ranks catches SIGTERM: the handler of its event loop, which a
    rank installs as it starts its run.  From then on SIGTERM stops it cleanly, saying so in its log (a TP
    member can still be joining when the leaders already serve; SIGTERM would end it silently)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        ranks = [pid for pid in _tagged(job.tag) if pid != job.proc.pid]
        if len(ranks) == nproc and all(_catches(pid, signal.SIGTERM) for pid in ranks):
            return
        assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-3000:]
        time.sleep(0.05)  # a poll of the ranks' state, not a duration


def _drain(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.read()


class _SharedService:
    """One healthy service (torchrun, 4 ranks, tp=2, the fake engine, no job secret) for the tests that only
    observe a running job (``get``).  A test that ends it takes it for itself (``take``); a later ``get``
    starts another.  Under pytest-xdist the tests that use it stay on one worker (tests/conftest.py)."""

    ARGS = ("--tp", "2", "--engine", "fake", "--fake-step-base-s", "0.002")

    def __init__(self, sdk_home: Path) -> None:
        self.sdk_home = sdk_home
        self.job: _Job | None = None
        self.started: list[_Job] = []

    def get(self) -> _Job:
        if self.job is None:
            self.job = _start_service(_env(self.sdk_home, uuid.uuid4().hex), *self.ARGS)
            self.started.append(self.job)
        assert self.job.proc.poll() is None, "the shared service ended:\n" + self.job.output()[-3000:]
        return self.job

    def take(self) -> _Job:
        job = self.get()
        self.job = None
        return job

    def close(self) -> None:
        for job in self.started:
            job.close()


@pytest.fixture(scope="module")
def service(sdk_home: Path) -> Iterator[_SharedService]:
    shared = _SharedService(sdk_home)
    yield shared
    shared.close()


def _client_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """This process's client environment: exactly ``env`` of the variables the SDK reads for discovery and
    authentication (an in-process client reads them as a client process of its own would)."""
    for name in ("SECRET", "SECRET_FILE", "JOB_KEY_FILE", "CREDENTIALS", "STORE", "NUM_SERVERS", "STORE_PREFIX"):
        monkeypatch.delenv(f"ROLLOUT_SDK_{name}", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


async def _one_request(store: str) -> str:
    """A client of the job at ``store`` (its keys from the environment) sends one request: its finish reason."""
    async with RolloutClient(discovery=StoreDiscovery(store), connect_timeout_s=60) as client:
        r = await client.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
        return r.finish_reason


async def test_external_client_discovers_a_running_service(service, monkeypatch) -> None:
    job = service.get()
    _client_env(monkeypatch)
    async with RolloutClient(discovery=StoreDiscovery(job.store)) as c:  # a client outside the job
        rs = await asyncio.gather(
            *(c.generate([1, 2, i], sampling=SamplingParams(max_new_tokens=4)) for i in range(50))
        )
    assert sorted(collections.Counter(r.server_id for r in rs).items()) == [("dp0", 25), ("dp1", 25)]
    assert len(_tagged(job.tag)) == 5  # torchrun + 4 ranks, all still running


def test_sigterm_mid_run_of_a_driver_job_leaves_no_process(sdk_home, tag) -> None:
    job = _Job(
        [
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "driver.py"),
            "--tp",
            "1",
            "--engine",
            "fake",
            "--fake-step-base-s",
            "0.01",
            "--requests",
            "8",  # each runs for good (100000 tokens at 10 ms a step): in flight when SIGTERM comes
            "--max-new-tokens",
            "100000",
        ],
        _env(sdk_home, tag),
    )
    try:
        i = job.wait_for(lambda ln: "ROLLOUT_SDK_STORE=" in ln)
        m = re.search(r"ROLLOUT_SDK_STORE=(\S+)", job.lines[i])
        assert m is not None
        asyncio.run(_wait_busy(m.group(1).rstrip(")"), 2))  # the driver's requests are in flight
        assert len(_tagged(tag)) == 3  # torchrun + 2 ranks
        job.proc.send_signal(signal.SIGTERM)
        job.finish()
        assert _wait_gone(tag, 15) == []
    finally:
        job.close()


async def _wait_busy(store: str, servers: int) -> None:
    """Return once every server of the job at ``store`` decodes requests (the driver's: this client, which
    reads it from the servers' heartbeat replies, sends none)."""
    deadline = time.monotonic() + HANG_GUARD_S
    async with RolloutClient(discovery=StoreDiscovery(store, num_servers=servers), connect_timeout_s=60) as client:
        while not all(s.engine_running > 0 for s in client.stats().servers):
            assert time.monotonic() < deadline, client.stats().servers
            await asyncio.sleep(0.05)  # a poll of the client's state (the condition, not a duration)


def test_killing_one_rank_fails_the_job_fast_naming_the_rank(sdk_home, tag) -> None:
    job = _start_service(_env(sdk_home, tag), "--tp", "1", "--engine", "fake", nproc=2)
    try:
        victim = None
        for pid in _tagged(tag):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"RANK=1" in env:
                victim = pid
        assert victim is not None
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        rc = job.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        log = job.finish()
        assert rc != 0
        assert elapsed < 30
        assert re.search(r"rank\s*:\s*1", log), log[-3000:]
        assert _wait_gone(tag, 15) == []
    finally:
        job.close()


async def test_discovery_timeout_names_the_missing_ranks() -> None:
    import msgspec
    import torch.distributed as dist

    from rollout_sdk.auth import JobSecret
    from rollout_sdk.discovery.store import ServerRecord, StoreKeys, seal

    secret = JobSecret.generate()

    def put(name: str, body: bytes) -> None:
        master.set(name, seal(secret.store_key, name, body))

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = StoreKeys("rollout_sdk/a0")
    put(StoreKeys.latest(), keys.prefix.encode())
    put(keys.num_servers, b"3")
    rec = ServerRecord(
        address="tcp://127.0.0.1:1", dp_rank=1, tp_size=1, global_rank=1, node_rank=0, pid=1, backend="fake", model="m"
    )
    put(keys.server(1), msgspec.msgpack.encode(rec))
    disc = StoreDiscovery(f"127.0.0.1:{master.port}", secret=secret)
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"DP ranks \[0, 2\]") as info:
        await disc.open(timeout=1.0)
    assert info.value.missing == ["dp0", "dp2"]
    assert time.monotonic() - t0 < 5
    with pytest.raises(DiscoveryError, match="cannot reach"):
        await StoreDiscovery(f"127.0.0.1:{_free_port()}").open(timeout=1.0)


async def test_client_reads_the_store_from_the_environment(service, monkeypatch) -> None:
    job = service.get()
    _client_env(monkeypatch, ROLLOUT_SDK_STORE=job.store)
    async with RolloutClient() as client:
        assert sorted(s.server_id for s in client.servers) == ["dp0", "dp1"]
        r = await client.generate([1, 2, 3], sampling=SamplingParams(max_new_tokens=3))
        assert r.finish_reason == "length"


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


def _forge_a_shutdown(job: _Job) -> Any:
    """Write an unsigned shutdown key into the job's store from outside (a store client needs no
    credentials); return once a rank's watcher logged that it ignored it, the job still running.  Returns
    that attacker's store client."""
    import torch.distributed as dist

    host, port = job.store.rsplit(":", 1)
    attacker = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    mark = len(job.lines)
    attacker.set("rollout_sdk/a0/shutdown", b"evil: stop the job")
    job.wait_for(lambda ln: "ignored a shutdown key" in ln, mark)  # a rank's watcher saw it (logs)
    assert "stopping" not in job.output(), job.output()[-3000:]
    return attacker


def _sigterm_stops_every_rank(job: _Job, ranks: int) -> str:
    """SIGTERM to torchrun: every rank stops cleanly (no forged reason among them), no process is left."""
    assert len(_tagged(job.tag)) == 1 + ranks  # torchrun and its ranks
    job.proc.send_signal(signal.SIGTERM)
    log = job.finish()
    assert _wait_gone(job.tag, 15) == [], "processes left behind"
    stops = [ln for ln in log.splitlines() if "stopping:" in ln]
    assert len(stops) == ranks and not any("evil" in ln for ln in stops), log[-3000:]
    assert log.count("stopping: SIGTERM") + log.count("stopping: job shutdown") == ranks, log[-3000:]
    return log


def test_forged_shutdown_key_is_ignored_and_keyless_clients_are_refused(tmp_path, sdk_home, tag, monkeypatch) -> None:
    """One server and its TP member (both watch the store): the forgeries do not need more ranks."""
    env = _secret_env(_env(sdk_home, tag), tmp_path)
    job = _start_service(env, "--tp", "2", "--engine", "fake", nproc=2)
    try:
        attacker = _forge_a_shutdown(job)
        # the job still serves a client holding the secret; a client without it is refused
        _client_env(monkeypatch, ROLLOUT_SDK_SECRET_FILE=env["ROLLOUT_SDK_SECRET_FILE"])
        assert asyncio.run(_one_request(job.store)) == "length"
        _client_env(monkeypatch)  # no secret: it cannot verify the sealed records, so it trusts none (issue 36)
        with pytest.raises(DiscoveryError, match="ROLLOUT_SDK_SECRET_FILE"):
            asyncio.run(_one_request(job.store))
        # a forged server record fails discovery for a client that holds the secret
        attacker.set("rollout_sdk/a0/server/0", b"\x80")
        _client_env(monkeypatch, ROLLOUT_SDK_SECRET_FILE=env["ROLLOUT_SDK_SECRET_FILE"])
        with pytest.raises(DiscoveryError, match="not signed with this job's secret"):
            asyncio.run(_one_request(job.store))
        _sigterm_stops_every_rank(job, 2)
    finally:
        job.close()


def test_a_job_without_a_secret_acts_on_no_store_record_from_the_network(service, monkeypatch) -> None:
    """Issue 25 item 1: torchrun's store listens on every interface; a job without a secret seals its store
    values with a key of its own (a 0600 file only this user reads), so a forged shutdown is ignored and a
    forged server record fails discovery for a client holding that key.  The job is the shared service,
    which this test then ends: SIGTERM stops every rank and leaves no process, and the key file goes."""
    import stat as stat_mod

    import msgspec

    from rollout_sdk.discovery.store import ServerRecord

    job = service.take()
    try:
        attacker = _forge_a_shutdown(job)
        keys = [p for d in _key_dirs() if d.exists() for p in d.glob("job-*.key") if _owned_by_tag(p, job.proc.pid)]
        assert len(keys) == 1, keys
        key = keys[0]
        assert stat_mod.S_IMODE(key.stat().st_mode) == 0o600
        _client_env(monkeypatch, ROLLOUT_SDK_JOB_KEY_FILE=str(key))
        assert asyncio.run(_one_request(job.store)) == "length"
        # a forged member registered from elsewhere: the job's key does not seal it, discovery refuses it
        forged = ServerRecord(
            address="tcp://10.9.9.9:1", dp_rank=1, tp_size=2, global_rank=2, node_rank=0, pid=1, backend="f", model="x"
        )
        attacker.set("rollout_sdk/a0/server/1", msgspec.msgpack.encode(forged))
        with pytest.raises(DiscoveryError, match="not signed with this job's secret"):
            asyncio.run(_one_request(job.store))
        _sigterm_stops_every_rank(job, 4)
        assert not key.exists()  # removed when the job ends
    finally:
        job.close()


def _key_dirs() -> list[Path]:
    import tempfile

    bases = [os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()]
    return [Path(b) / f"rollout_sdk-{os.getuid()}" for b in bases]


def _owned_by_tag(path: Path, torchrun_pid: int) -> bool:
    """The key file of the job whose torchrun agent is ``torchrun_pid`` (its name starts with the agent's pid)."""
    return path.name.startswith(f"job-{torchrun_pid}-")
