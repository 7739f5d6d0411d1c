"""Shared fixtures: the tiny model (built once per session, offline), server processes, in-process servers."""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.server import EngineServer, ServerConfig

ROOT = Path(__file__).resolve().parent.parent


def _gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (tests/gpu runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sdk_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private ROLLOUT_SDK_HOME for the session (the tiny model is built there once)."""
    home = Path(os.environ.get("ROLLOUT_SDK_TEST_HOME") or tmp_path_factory.mktemp("sdk_home"))
    os.environ["ROLLOUT_SDK_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model(sdk_home: Path) -> Path:
    from rollout_sdk.models.tiny import ensure_tiny_model

    return ensure_tiny_model(sdk_home)


@pytest.fixture(scope="session")
def tool_model(sdk_home: Path) -> Path:
    """The trained tool model (trained on first use: a few minutes on two cores, once per session)."""
    from rollout_sdk.tasks import ensure_tool_model

    return ensure_tool_model(sdk_home)


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[str], address: str) -> None:
        self.proc = proc
        self.address = address

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=timeout)


def _wait_ready(proc: subprocess.Popen[str], timeout: float) -> str:
    """Read the server's stdout until its READY line (a handshake, not a sleep)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("READY "):
            return line.split()[1]
    proc.kill()
    raise RuntimeError(f"server did not become ready; output:\n{''.join(seen)}")


@pytest.fixture
def spawn_server(sdk_home: Path) -> Iterator:
    """Start ``python -m rollout_sdk serve ...`` processes; every one is stopped at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: str, timeout: float = 300) -> ServerProcess:  # a hang guard: loaded machines are slow
        env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_sdk", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        procs.append(proc)
        return ServerProcess(proc, _wait_ready(proc, timeout))

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        with contextlib.suppress(Exception):
            assert p.stdout is not None
            p.stdout.close()


@pytest.fixture
async def fake_servers() -> AsyncIterator:
    """Start in-process servers around FakeEngines (real ZMQ on loopback); all closed at teardown."""
    servers: list[EngineServer] = []

    async def start(n: int = 1, config: FakeEngineConfig | None = None, **engine_kw: object) -> list[EngineServer]:
        started = []
        for _ in range(n):
            s = EngineServer(FakeEngine(config, **engine_kw), ServerConfig(server_id=f"fake-{len(servers)}"))  # type: ignore[arg-type]
            await s.__aenter__()
            servers.append(s)
            started.append(s)
        return started

    yield start
    for s in servers:
        await s.aclose()
