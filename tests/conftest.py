"""Shared fixtures: the tiny model (built once per session, offline), server processes, in-process servers."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.server import EngineServer, ServerConfig

ROOT = Path(__file__).resolve().parent.parent

# One intra-op thread for torch here and in every process the tests start (servers, ranks, examples; the
# environment is inherited), unless the caller chose a count.  The tiny models' matrices are too small to
# split: on a busy 2-core machine two OpenMP threads wait on each other at every op, and a CPU-engine step
# then costs 5-15x the CPU of one thread (tests/test_cpu_engine.py: 4.5 s of CPU for 72 steps, 0.45 s).
# Not where there is an NVIDIA GPU: the GPU tests' CPU work (a 0.5B model's init) wants the host's cores.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _module_name(item: pytest.Item) -> str:
    return str(getattr(getattr(item, "module", None), "__name__", ""))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the modules with tests that need the tool model run last (the build overlaps the others: _ToolModelBuild)
    late = {_module_name(item) for item in items if _needs_tool_model(item)}
    items.sort(key=lambda item: _module_name(item) in late)
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (tests/gpu runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_HOME = pytest.StashKey[Path]()


def _session_home(config: pytest.Config) -> Path:
    """This session's ROLLOUT_SDK_HOME: ``$ROLLOUT_SDK_TEST_HOME`` (a cache kept between runs), else a
    fresh temporary directory (a fresh clone: every model is built once, in it)."""
    if _HOME not in config.stash:
        given = os.environ.get("ROLLOUT_SDK_TEST_HOME")
        home = Path(given) if given else config._tmp_path_factory.mktemp("sdk_home")  # type: ignore[attr-defined]
        os.environ["ROLLOUT_SDK_HOME"] = str(home)
        config.stash[_HOME] = home
    return config.stash[_HOME]


def _needs_tool_model(item: pytest.Item) -> bool:
    return "tool_model" in getattr(item, "fixturenames", ())


def default_sigint() -> None:
    """A ``preexec_fn``: the child gets Ctrl-C (SIGINT) as from a terminal, even where this pytest was
    started in the background by a shell (`pytest &`, nohup, some CI runners), which ignores SIGINT in it
    and so in every child it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _ToolModelBuild:
    """The trained tool model, built in a subprocess that starts before the first test.

    Training takes minutes on a loaded 2-core machine.  In a fixture that time counted against the first
    test's per-test timeout and failed it.  Here it runs beside the tests that do not need it (the suite
    mostly waits on sockets and subprocesses: about one core of two), those that need it run last, and the
    wait for it happens before their timeout starts (``pytest_runtest_protocol`` below), saying so.
    """

    def __init__(self, home: Path) -> None:
        self.home = home
        self.log = home / "tool-model-build.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.path: Path | None = None
        self.error: str | None = None

    def start(self) -> None:
        from rollout_sdk.tasks.tool_model import cached_tool_model

        self.path = cached_tool_model(self.home)
        if self.path is None:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "rollout_sdk", "make-model", "tool", "--home", str(self.home)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env=dict(os.environ, ROLLOUT_SDK_HOME=str(self.home)),
                    preexec_fn=default_sigint,  # stop() sends it Ctrl-C
                )

    def wait(self, say: Callable[[str], None]) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            say(f"\nwaiting for the tool model's training (started with the session; progress in {self.log})")
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout=_BUILD_GUARD_S)
        except subprocess.TimeoutExpired:  # a hang guard (minutes are normal; an hour is not)
            self.stop()
            code = -1
        self.proc = None
        if code == 0:
            from rollout_sdk.tasks.tool_model import cached_tool_model

            self.path = cached_tool_model(self.home)
            say(f"tool model ready (waited {time.monotonic() - t0:.0f}s)")
        if self.path is None:
            tail = self.log.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
            self.error = f"training the tool model failed (exit {code}); the end of {self.log}:\n" + "\n".join(tail)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: it stops at its next step and caches nothing
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_BUILD = pytest.StashKey[_ToolModelBuild]()
#: the longest the tests that need the tool model wait for its build
_BUILD_GUARD_S = 3600.0


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or not any(_needs_tool_model(item) for item in session.items):
        return
    build = session.config.stash[_BUILD] = _ToolModelBuild(_session_home(session.config))
    build.start()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Outside every other wrapper, pytest-timeout's included: the wait for the build is no test's time."""
    build = item.config.stash.get(_BUILD, None)
    if build is not None and _needs_tool_model(item):
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        build.wait(reporter.write_line if reporter is not None else print)
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    build = session.config.stash.get(_BUILD, None)
    if build is not None:
        build.stop()


@pytest.fixture(scope="session")
def sdk_home(pytestconfig: pytest.Config) -> Path:
    """A private ROLLOUT_SDK_HOME for the session (the tiny model is built there once)."""
    return _session_home(pytestconfig)


@pytest.fixture(scope="session")
def tiny_model(sdk_home: Path) -> Path:
    from rollout_sdk.models.tiny import ensure_tiny_model

    return ensure_tiny_model(sdk_home)


@pytest.fixture(scope="session")
def tool_model(pytestconfig: pytest.Config, sdk_home: Path) -> Path:
    """The trained tool model (built beside the first tests: ``_ToolModelBuild``)."""
    from rollout_sdk.tasks import ensure_tool_model

    build = pytestconfig.stash.get(_BUILD, None)
    if build is not None and build.error is not None:
        raise RuntimeError(build.error)
    if build is not None and build.path is not None:
        return build.path
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
    """Read the server's stdout until its READY line (a handshake, not a sleep).

    It reads the pipe's bytes itself (``os.read``): a buffered ``readline`` can take the READY line into
    its buffer together with the line before it, where ``select`` no longer sees it (a server started
    beside others, ``_Spawner.many``, has written both by the time it is read)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = b""
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        seen += chunk
        for line in seen.split(b"\n")[:-1]:
            if line.startswith(b"READY "):
                return line.split()[1].decode()
    proc.kill()
    raise RuntimeError(f"server did not become ready; output:\n{seen.decode(errors='replace')}")


class _Spawner:
    """Starts ``python -m rollout_sdk serve ...`` processes; ``close()`` stops every one.

    ``spawn(*args)`` starts one and waits for its READY line; ``spawn.many(n, *args)`` starts n at once and
    then waits for each (their start-ups overlap: a CPU-engine server takes seconds to import and load)."""

    def __init__(self, sdk_home: Path) -> None:
        self.sdk_home = sdk_home
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        env = dict(os.environ, ROLLOUT_SDK_HOME=str(self.sdk_home), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_sdk", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.procs.append(proc)
        return proc

    def __call__(self, *args: str, timeout: float = 300) -> ServerProcess:  # a hang guard: loaded machines
        proc = self.start(*args)
        return ServerProcess(proc, _wait_ready(proc, timeout))

    def many(self, n: int, *args: str, timeout: float = 300) -> list[ServerProcess]:
        started = [self.start(*args) for _ in range(n)]
        return [ServerProcess(p, _wait_ready(p, timeout)) for p in started]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            with contextlib.suppress(Exception):
                assert p.stdout is not None
                p.stdout.close()


@pytest.fixture
def spawn_server(sdk_home: Path) -> Iterator[_Spawner]:
    """Server processes for one test (``_Spawner``), all stopped at its teardown."""
    spawner = _Spawner(sdk_home)
    yield spawner
    spawner.close()


@pytest.fixture(scope="module")
def module_spawn_server(sdk_home: Path) -> Iterator[_Spawner]:
    """Server processes shared by a module's tests (``_Spawner``), stopped after its last test: for the
    tests that leave a server as they found it (a CPU-engine server costs seconds of CPU to start)."""
    spawner = _Spawner(sdk_home)
    yield spawner
    spawner.close()


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
