"""Shared fixtures: the tiny model (built once per session, offline), server processes, in-process servers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import sys
import time
import typing
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
    # the modules with tests that need the tool model run last (the build overlaps the others: _ToolModelBuild),
    # the modules with slow tests first (under xdist a long module started last would end the run alone)
    late = {_module_name(item) for item in items if _needs_tool_model(item)}
    slow = {_module_name(item) for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: (_module_name(item) in late, _module_name(item) not in slow))
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (tests/gpu runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # an xdist hook (absent under `-p no:xdist`)
def pytest_xdist_make_scheduler(config: pytest.Config, log: typing.Any) -> typing.Any:
    """``--dist loadfile`` (a module's tests on one worker: they share its module-scoped servers) in the
    order collected (``--no-loadscope-reorder``), with ``tests/gpu`` as one unit: each of its tests takes
    a share of the one GPU's memory, so they run one at a time."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Scheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            scope = str(super()._split_scope(nodeid))
            return "tests/gpu" if scope.startswith("tests/gpu/") else scope

    return _Scheduling(config, log)


_HOME = pytest.StashKey[Path]()


def _session_home(config: pytest.Config) -> Path:
    """This session's ROLLOUT_SDK_HOME: ``$ROLLOUT_SDK_TEST_HOME`` (a cache kept between runs), else a
    fresh temporary directory (a fresh clone: every model is built once, in it)."""
    if _HOME not in config.stash:
        given = getattr(config, "workerinput", {}).get(_HOME_KEY) or os.environ.get("ROLLOUT_SDK_TEST_HOME")
        home = Path(given) if given else config._tmp_path_factory.mktemp("sdk_home")  # type: ignore[attr-defined]
        os.environ["ROLLOUT_SDK_HOME"] = str(home)
        config.stash[_HOME] = home
    return config.stash[_HOME]


#: the session home, handed by the xdist controller to its workers (one home, one build of each model)
_HOME_KEY = "rollout_sdk_test_home"


@pytest.hookimpl(optionalhook=True)  # an xdist hook (absent under `-p no:xdist`)
def pytest_configure_node(node: typing.Any) -> None:
    node.workerinput[_HOME_KEY] = str(_session_home(node.config))


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
    test's per-test timeout and failed it.  Here it runs beside the tests that do not need it, those that
    need it run last, and the wait for it happens before their timeout starts (``pytest_runtest_protocol``
    below), saying so.

    Once per session, also under pytest-xdist, where every worker makes one of these: the first to lock
    ``tool-model-build.lock`` in the session's home starts the training, whose process holds that lock until
    it exits; the others wait for the lock, then read the cache.  Each of those holds a shared lock on
    ``tool-model-build.wanted`` until it has its model: the builder's session can end first (xdist has no
    more tests for it), and it leaves the training running while another process still wants it.
    """

    def __init__(self, home: Path) -> None:
        self.home = home
        self.log = home / "tool-model-build.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock: typing.IO[str] | None = None  # the builder's tool-model-build.lock (its process shares it)
        self.wanted: typing.IO[str] | None = None  # a waiter's shared lock on tool-model-build.wanted
        self.path: Path | None = None
        self.error: str | None = None

    def start(self) -> None:
        from rollout_sdk.tasks.tool_model import cached_tool_model

        self.path = cached_tool_model(self.home)
        if self.path is not None:
            return
        self.wanted = open(self.home / "tool-model-build.wanted", "a")  # noqa: SIM115 - held until wait()
        fcntl.flock(self.wanted, fcntl.LOCK_SH)  # before the race for the build lock: none misses a waiter
        lock = open(self.home / "tool-model-build.lock", "a")  # noqa: SIM115 - the build's process holds it
        if not _try_flock(lock, fcntl.LOCK_EX):  # another process trains it (another xdist worker)
            lock.close()
            return
        self._release_wanted()
        self.path = cached_tool_model(self.home)  # trained while this one raced for the lock
        if self.path is not None:
            lock.close()
            return
        self.lock = lock
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_sdk", "make-model", "tool", "--home", str(self.home)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=dict(os.environ, ROLLOUT_SDK_HOME=str(self.home)),
                preexec_fn=_training_preexec(),  # stop() sends it Ctrl-C
                pass_fds=(lock.fileno(),),  # the lock is held until it has exited, whichever process ends first
            )

    def wait(self, say: Callable[[str], None]) -> None:
        if self.proc is not None:
            self._wait_own(say)
        elif self.wanted is not None:
            self._wait_other(say)

    def _wait_own(self, say: Callable[[str], None]) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            say(f"\nwaiting for the tool model's training (started with the session; progress in {self.log})")
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout=_BUILD_GUARD_S)
        except subprocess.TimeoutExpired:  # a hang guard (minutes are normal; an hour is not)
            self.stop(others_may_wait=False)
            code = -1
        self.proc = None
        self._release_lock()
        self._read_cache(f"exit {code}", say, t0)

    def _wait_other(self, say: Callable[[str], None]) -> None:
        t0 = time.monotonic()
        with open(self.home / "tool-model-build.lock", "a") as lock:
            if not _try_flock(lock, fcntl.LOCK_SH):
                say(f"\nwaiting for the tool model's training (by another process; progress in {self.log})")
            while not _try_flock(lock, fcntl.LOCK_SH) and time.monotonic() - t0 < _BUILD_GUARD_S:
                time.sleep(_BUILD_POLL_S)  # a poll on the lock, not a wait for the training's time
        self._release_wanted()
        self._read_cache("its process ended", say, t0)

    def _read_cache(self, how: str, say: Callable[[str], None], t0: float) -> None:
        from rollout_sdk.tasks.tool_model import cached_tool_model

        self.path = cached_tool_model(self.home)
        if self.path is not None:
            say(f"tool model ready (waited {time.monotonic() - t0:.0f}s)")
            return
        tail = self.log.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
        self.error = f"training the tool model failed ({how}); the end of {self.log}:\n" + "\n".join(tail)

    def stop(self, *, others_may_wait: bool) -> None:
        """End this process's part: with ``others_may_wait``, a training still running is left to finish
        while another process wants the model (up to the guard); otherwise it is stopped."""
        self._release_wanted()
        if self.proc is not None and others_may_wait:
            deadline = time.monotonic() + _BUILD_GUARD_S
            while self.proc.poll() is None and _others_want(self.home) and time.monotonic() < deadline:
                time.sleep(_BUILD_POLL_S)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: it stops at its next step and caches nothing
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._release_lock()

    def _release_wanted(self) -> None:
        if self.wanted is not None:
            self.wanted.close()  # closing drops the flock
            self.wanted = None

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.close()  # the build's process keeps the lock until it exits (never LOCK_UN: shared)
            self.lock = None


def _training_preexec() -> Callable[[], None]:
    """The training's ``preexec_fn``: Ctrl-C as from a terminal (``default_sigint``), and Ctrl-C when the
    process that started it dies without its cleanup (an xdist worker killed by its controller) on Linux."""
    parent = os.getpid()
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: nothing but the call after the fork
    except (OSError, AttributeError):  # not Linux
        return default_sigint

    def preexec() -> None:
        default_sigint()
        prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the call
            os.kill(os.getpid(), signal.SIGINT)

    return preexec


def _try_flock(f: typing.IO[str], mode: int) -> bool:
    try:
        fcntl.flock(f, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _others_want(home: Path) -> bool:
    """Whether another process holds its shared lock on ``tool-model-build.wanted`` (waits for the model)."""
    with open(home / "tool-model-build.wanted", "a") as wanted:
        return not _try_flock(wanted, fcntl.LOCK_EX)


_BUILD = pytest.StashKey[_ToolModelBuild]()
#: the longest the tests that need the tool model wait for its build
_BUILD_GUARD_S = 3600.0
#: how often a process waiting on another's build polls its lock
_BUILD_POLL_S = 0.5


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    build = session.config.stash.get(_BUILD, None)
    if build is not None:
        build.stop(others_may_wait=exitstatus != pytest.ExitCode.INTERRUPTED)
    for line in open_transports():
        sys.stderr.write(f"conftest: a transport is still open at the end of the session: {line}\n")


def open_transports() -> list[str]:
    """The asyncio transports still open, each with its protocol's class: what the interpreter would report
    at exit as ``ResourceWarning: unclosed transport``, after pytest's last line and with no owner (issue
    37: LangChain's process-wide httpx client; the tests now hand it one they close).  Named here, at the
    end of the session, so a new leak says where it comes from."""
    import asyncio
    import gc
    import warnings

    found = []
    with warnings.catch_warnings():  # isinstance() on some of torch's objects warns of a deprecated name
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, asyncio.BaseTransport) and not obj.is_closing():
                protocol = obj.get_protocol()
                found.append(f"{obj!r} of {type(protocol).__module__}.{type(protocol).__qualname__}")
    return found


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


def start_cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """``python -m rollout_sdk <args>`` from the repository root, its stdout and stderr merged into one text
    pipe (read it with :func:`_wait_ready` or the caller's own reader); the caller stops it."""
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_sdk", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )


class _Spawner:
    """Starts ``python -m rollout_sdk serve ...`` processes; ``close()`` stops every one.

    ``spawn(*args)`` starts one and waits for its READY line; ``spawn.many(n, *args)`` starts n at once and
    then waits for each (their start-ups overlap: a CPU-engine server takes seconds to import and load)."""

    def __init__(self, sdk_home: Path) -> None:
        self.sdk_home = sdk_home
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        env = dict(os.environ, ROLLOUT_SDK_HOME=str(self.sdk_home), PYTHONUNBUFFERED="1")
        proc = start_cli("serve", *args, env=env)
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
