"""The rollout-sdk command.

  rollout-sdk demo            tool-using agent rollouts on the CPU engine (the trained tool model)
  rollout-sdk demo --rl       GRPO on CPU: the tool model learns to delegate, success printed per step
  rollout-sdk serve           one engine server (cpu, sglang or fake) until Ctrl-C / SIGTERM
  rollout-sdk make-model      build a local model (tiny, tiny-vl, tool, tool-undertrained); print its directory
  rollout-sdk gateway         an OpenAI-compatible API in front of the engines (docs/gateway.md)
  rollout-sdk secret          write a new job secret to a file (mode 0600)
  rollout-sdk credentials     write one role's client keys (from the job secret) to a file (mode 0600)

Many servers (DP x TP) are launched with torchrun:
  torchrun --standalone --nproc-per-node 4 -m rollout_sdk.launch --tp 2 --engine sglang --model DIR
(see docs/launch.md).  Every option below mirrors a field of a config class of the Python API.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._aio import ticking
from ..auth import JobSecret
from ..client import ClientConfig
from ..client.scheduler import SchedulerConfig
from ..demos.generate import DemoConfig, run_demo
from ..demos.grpo import GrpoConfig, run_grpo
from ..engines import registry
from ..engines.fake import FakeEngineConfig
from ..engines.registry import EngineConfigs
from ..errors import ConfigError, RolloutError
from ..metrics import start_metrics_endpoint
from ..protocol.engine_config import CpuEngineConfig
from ..server import EngineServer, ServerConfig
from ..server.metrics import ServerMetrics
from .args import (
    LOG_LEVELS,
    OneLineErrors,
    add_config_args,
    add_sglang_args,
    config_from_args,
    existing_dir,
    log_level,
    port_number,
    server_address,
    sglang_fields,
    writable_file,
)

__all__ = ["THREADS_GRACE_S", "entry", "exit_process", "leave_if_threads_hang", "main", "run_async"]

#: seconds worker threads get after a server stopped before the process leaves without them
THREADS_GRACE_S = 0.5


def run_async(
    coro: Coroutine[Any, Any, Any],
    *,
    threads_grace_s: float | None = None,
    before_hard_exit: Callable[[], None] | None = None,
) -> Any:
    """Run ``coro`` on uvloop where available (installed per call, not at import).

    With ``threads_grace_s`` (the ``serve`` command, a torchrun rank) the exit is bounded: worker threads
    get that long after ``coro`` ends, and a thread that cannot be joined is abandoned by leaving the
    process (:func:`leave_if_threads_hang`), not waited for as asyncio and the interpreter would.
    ``before_hard_exit`` runs just before such a leave (no ``finally`` runs after it): the cleanup that
    must not be skipped, such as removing a job's key file."""
    if threads_grace_s is not None:
        coro = _bounded_exit(coro, threads_grace_s, before_hard_exit)
    try:
        import uvloop  # optional: uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _bounded_exit(
    coro: Coroutine[Any, Any, Any], grace_s: float, before_hard_exit: Callable[[], None] | None
) -> Any:
    # a default executor of our own, so that its idle threads can be told to leave at the end
    executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="rollout-sdk")
    asyncio.get_running_loop().set_default_executor(executor)
    code = 1
    try:
        result = await coro
        code = result if isinstance(result, int) else 0
        return result
    finally:
        await leave_if_threads_hang(executor, grace_s=grace_s, code=code, before_exit=before_hard_exit)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _live_threads() -> list[threading.Thread]:
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


async def leave_if_threads_hang(
    executor: concurrent.futures.ThreadPoolExecutor,
    *,
    grace_s: float,
    code: int = 0,
    before_exit: Callable[[], None] | None = None,
) -> None:
    """Keep the shutdown bound when a thread (a collective stuck in ``to_thread``) cannot be stopped.

    Python cannot stop a thread, and both asyncio (``shutdown_default_executor``: on Python 3.11 it joins
    the thread even when cancelled) and the interpreter's exit (it joins every non-daemon thread) would
    wait for it without a limit.  So: idle workers are told to leave; the others get ``grace_s``; if one is
    still running then, the process leaves with ``os._exit(code)`` after ``before_exit`` (errors logged,
    never raised) and flushing its logs and streams.
    The last resort, and the only one: whatever that thread was doing is abandoned (docs/reliability.md).
    """
    executor.shutdown(wait=False)
    loop = asyncio.get_running_loop()
    joined: asyncio.Future[None] = loop.create_future()

    def join_all() -> None:  # in a daemon thread: it is abandoned too when a thread never ends
        for thread in _live_threads():
            thread.join()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_resolve, joined)

    threading.Thread(target=join_all, name="rollout-sdk-join", daemon=True).start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(joined, grace_s)
    stuck = _live_threads()
    if not stuck:
        return

    logging.getLogger("rollout_sdk.server").warning(
        "%d worker thread(s) still running %.1fs after shutdown (%s): exiting without them",
        len(stuck),
        grace_s,
        ", ".join(t.name for t in stuck[:4]),
    )
    if before_exit is not None:
        try:
            before_exit()
        except Exception:  # the exit must happen: a failed cleanup is logged, not raised
            logging.getLogger("rollout_sdk.server").exception("cleanup before the hard exit failed")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_process(code: int) -> typing.NoReturn:
    """End this process now that its work and its own cleanup are done: logs and streams flushed, ``atexit``
    handlers run, then ``os._exit`` without the interpreter's finalization.

    Why: finalizing a process that imported torch tears down every module and torch's thread pools, and on
    a loaded machine that alone took 7-12 s after a ``serve`` had stopped in 0.1 s (issue 37: SIGINT to
    exit 12.3 s at a load of 12, 0.6 s with this; docs/benchmarks.md).  Only for process entry points
    (``rollout-sdk``, ``python -m rollout_sdk``, ``python -m rollout_sdk.launch``), never from a library call.
    """
    logging.shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)


def entry() -> typing.NoReturn:
    """The ``rollout-sdk`` console script: :func:`main`, then :func:`exit_process`."""
    exit_process(main())


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="rollout-sdk", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="WARNING", type=log_level, help=f"one of {', '.join(LOG_LEVELS)}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        usage="%(prog)s [--rl] [options]",
        help="agent rollouts with real calculator calls on the trained tool model (--rl: GRPO on CPU)",
        description="Without --rl: N held-back questions x a group of trajectories each, through ToolAgent; "
        "prints success, throughput, latency and one trajectory.  With --rl: GRPO steps on the under-trained "
        "tool model; only the --rl-* options apply then (--group-size is the rollout demo's group, "
        "--rl-group-size the GRPO group).",
    )
    d.add_argument(
        "--servers",
        nargs="*",
        type=server_address,
        default=None,
        help="engine servers, tcp://host:port each (default: an embedded CPU engine)",
    )
    d.add_argument("--json", type=writable_file, default=None, help="also write the numbers to this file")
    d.add_argument("--rl", action="store_true", help="run GRPO on the under-trained tool model instead")
    add_config_args(d, DemoConfig, title="demo (without --rl)")
    add_config_args(d, GrpoConfig, prefix="rl-", title="demo --rl (GRPO)", description="apply only with --rl")
    add_config_args(d, ClientConfig, prefix="client-", title="client")
    add_config_args(d, SchedulerConfig, prefix="client-", title="client scheduler")
    add_config_args(d, CpuEngineConfig, prefix="engine-", title="embedded CPU engine (without --servers)")

    s = sub.add_parser(
        "serve",
        usage="%(prog)s [--engine cpu|sglang|fake] [--model DIR] [options]",
        help="serve one engine over ZMQ until SIGTERM/SIGINT; prints READY tcp://host:port",
        description="Serve one engine over ZMQ until SIGTERM/SIGINT.  Prints READY tcp://host:port once the "
        "model is loaded and the socket is bound (nothing if stopped before that).",
    )
    s.add_argument(
        "--engine",
        choices=["cpu", "sglang", "fake"],
        default="cpu",
        help="cpu: HF transformers on CPU; sglang: SGLang on GPUs (needs --model); fake: a deterministic "
        "stand-in for tests (its --fake-* options are not listed)",
    )
    s.add_argument(
        "--model",
        default=None,
        help="model directory (sglang: or a hub name); default for cpu: the embedded tiny model",
    )
    s.add_argument(
        "--address-file",
        type=writable_file,
        default=None,
        help="write the bound address (tcp://host:port) here once serving",
    )
    s.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve Prometheus /metrics on this port (0: a free one, printed as METRICS <url>); off by default",
    )
    s.add_argument("--metrics-host", default=None, help="interface of the /metrics endpoint (default: --host)")
    s.add_argument(
        "--secret-file", default=None, help="job secret: require CURVE keys (default: $ROLLOUT_SDK_SECRET_FILE)"
    )
    add_config_args(s, ServerConfig, title="server", extra_help=_SERVER_HELP)
    add_config_args(s, CpuEngineConfig, prefix="cpu-", title="cpu engine (--engine cpu)")
    add_config_args(s, FakeEngineConfig, prefix="fake-", hidden=True)  # test hooks: accepted, not listed
    add_sglang_args(s)

    from . import gateway_cli  # lazy: cli-start

    gateway_cli.add_parser(sub)

    m = sub.add_parser("make-model", help="build a local model (offline) and print its directory")
    m.add_argument(
        "which",
        nargs="?",
        choices=["tiny", "tiny-vl", "tool", "tool-undertrained"],
        default="tiny",
        help="tiny: random weights (seconds); tiny-vl: a Qwen2.5-VL-shaped one (seconds); "
        "tool: trained on CPU for the calculator task (minutes, once); tool-undertrained: its --rl start",
    )
    m.add_argument("--home", default=None, help="cache root (default $ROLLOUT_SDK_HOME or ~/.cache/rollout_sdk)")
    _add_key_commands(sub)
    return p


#: ServerConfig fields whose source comment is shared with a neighbour, or absent
_SERVER_HELP = {
    "dp_rank": "this server's data-parallel rank (names it in stats; torchrun sets it)",
    "tp_size": "tensor-parallel size of the engine this server leads (torchrun sets it)",
    "stall_window_s": "the stall detector's window in seconds (none: the detector is off)",
    "stall_ratio": "tokens/s per running request below this fraction of recent is a stall (see --stall-window-s)",
    "stall_loop_lag_s": "a server event-loop tick later than this is a stall (see --stall-window-s)",
}


def _add_key_commands(sub: Any) -> None:
    k = sub.add_parser("secret", help="write a new random job secret to --out (mode 0600, never overwritten)")
    k.add_argument("--out", required=True, type=writable_file, help="the file to create (it must not exist)")
    c = sub.add_parser("credentials", help="write one role's client keys, derived from the job secret")
    c.add_argument(
        "--role",
        choices=["generate", "control"],
        required=True,
        help="generate: may only generate; control: may also update weights, pause, stop",
    )
    c.add_argument("--out", required=True, type=writable_file, help="the file to write the keys to")
    c.add_argument("--secret-file", default=None, help="default: $ROLLOUT_SDK_SECRET_FILE / $ROLLOUT_SDK_SECRET")


def _key_command(args: argparse.Namespace) -> int:
    if args.command == "secret":
        JobSecret.generate().write(args.out)
        print(f"wrote a job secret to {args.out}: set ROLLOUT_SDK_SECRET_FILE={args.out} on every node")
        return 0
    secret = JobSecret.read(args.secret_file) if args.secret_file else JobSecret.from_env()
    if secret is None:
        print("rollout-sdk: no job secret: pass --secret-file or set ROLLOUT_SDK_SECRET_FILE", file=sys.stderr)
        return 2
    secret.credentials(args.role).save(args.out)
    print(f"wrote {args.role} credentials to {args.out}: set ROLLOUT_SDK_CREDENTIALS={args.out} for the client")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _check(args)
    if problem is not None:  # every argument is checked before any work starts, in one line
        print(f"rollout-sdk {args.command}: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.INFO:  # the embedded engine's start speaks (discovery's INFO lines)
        logging.getLogger("rollout_sdk.discovery").setLevel(logging.INFO)
    try:
        return _command(args)
    except KeyboardInterrupt:
        print("rollout-sdk: interrupted", file=sys.stderr)
        return 130
    except (RolloutError, OSError, ValueError) as exc:  # expected situations: one line, not a traceback
        logging.getLogger("rollout_sdk.launch.cli").debug("failed", exc_info=exc)
        print(f"rollout-sdk {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> str | None:
    """What argparse's per-option types cannot see (options that depend on each other), checked before any
    work: None when the command line is good, else the one line that says what is wrong."""
    if args.command == "gateway":
        from . import gateway_cli  # lazy: cli-start

        return gateway_cli.check(args)
    if args.command == "demo":
        try:
            config_from_args(GrpoConfig, args, prefix="rl-") if args.rl else config_from_args(DemoConfig, args)
            config_from_args(ClientConfig, args, prefix="client-")
            config_from_args(SchedulerConfig, args, prefix="client-")
            config_from_args(CpuEngineConfig, args, prefix="engine-")
        except ConfigError as exc:
            return str(exc)
        return None
    if args.command != "serve":
        return None
    if args.engine == "sglang" and not args.model:
        return "--engine sglang needs --model (a model directory or hub name)"
    if args.engine == "cpu" and args.model is not None:
        try:
            existing_dir(args.model)
        except argparse.ArgumentTypeError as exc:
            return f"--model: {exc}"
    if (
        args.engine == "sglang"
        and args.model.startswith(("/", ".", "~"))
        and not os.path.isdir(os.path.expanduser(args.model))
    ):
        return f"--model: {args.model!r} is not a directory"
    try:  # every config, built (and so checked) now rather than after the model loaded
        engine_configs(args.engine, args)
        _server_config(args)
    except (ConfigError, OSError) as exc:
        return str(exc)
    return None


def _command(args: argparse.Namespace) -> int:
    if args.command == "demo" and args.rl:
        run_async(run_grpo(config_from_args(GrpoConfig, args, prefix="rl-")))
        return 0
    if args.command == "demo":
        report = run_async(
            run_demo(
                config_from_args(DemoConfig, args),
                servers=args.servers or None,
                engine=config_from_args(CpuEngineConfig, args, prefix="engine-"),
                client=config_from_args(
                    ClientConfig,
                    args,
                    prefix="client-",
                    scheduler=config_from_args(SchedulerConfig, args, prefix="client-"),
                ),
            )
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    if args.command == "serve":
        try:
            config = _server_config(args)
        except ConfigError as exc:  # e.g. --host 0.0.0.0 without a secret: one line saying how to fix it
            print(f"rollout-sdk: {exc}", file=sys.stderr)
            return 2
        return int(run_async(_serve(args, config), threads_grace_s=THREADS_GRACE_S))
    if args.command == "gateway":
        from . import gateway_cli  # lazy: cli-start

        _quiet_transformers()
        return int(run_async(gateway_cli.run(args)))
    if args.command in ("secret", "credentials"):
        try:
            return _key_command(args)
        except (ConfigError, FileExistsError) as exc:
            print(f"rollout-sdk: {exc}", file=sys.stderr)
            return 2
    if args.command == "make-model":
        from ..models import ensure_tiny_model  # lazy: cli-start
        from ..tasks import ensure_tool_model  # lazy: cli-start

        if args.which == "tiny":
            print(ensure_tiny_model(args.home))
        elif args.which == "tiny-vl":
            from ..models import ensure_tiny_vl_model  # lazy: cli-start

            print(ensure_tiny_vl_model(args.home))
        else:
            print(ensure_tool_model(args.home, stage="trained" if args.which == "tool" else "undertrained"))
        return 0
    return 2  # pragma: no cover


def _quiet_transformers() -> None:
    """A command whose output is a report: no weight-loading progress bars (a CLI may set this; a library not)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging  # lazy: cli-start

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    except Exception:  # transformers missing or changed: the bars are cosmetic
        pass


def engine_configs(kind: str, args: argparse.Namespace) -> Any:
    """The engine configuration ``rollout-sdk serve --engine kind`` runs, from its command line (checked)."""
    configs = EngineConfigs()
    if kind == "cpu":
        configs.cpu = config_from_args(CpuEngineConfig, args, prefix="cpu-")
    elif kind == "fake":
        configs.fake = config_from_args(FakeEngineConfig, args, prefix="fake-")
    else:
        configs.sglang = sglang_fields(args)
    return configs


#: seconds between the lines that say ``serve``'s engine is still starting (under ~5 s with jitter: issue 37)
STILL_STARTING_EVERY_S = 4.0


@contextlib.contextmanager
def _still_starting(label: str, *, every_s: float = STILL_STARTING_EVERY_S) -> typing.Iterator[None]:
    """A line on stderr every ``every_s`` seconds until the block ends (the engine's import and model load
    hold the event loop: :func:`~rollout_sdk._aio.ticking` says it from a thread)."""

    def say(elapsed: float) -> None:
        print(f"{label}: still starting ({elapsed:.0f}s)", file=sys.stderr, flush=True)

    with ticking(every_s, say, name="still-starting"):
        yield


def make_engine(kind: str, args: argparse.Namespace) -> Any:
    """The engine ``rollout-sdk serve --engine kind`` runs, from its command line (engines.registry)."""
    return registry.make_engine(kind, engine_configs(kind, args), model=args.model)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    secret = JobSecret.read(args.secret_file) if args.secret_file else JobSecret.from_env()
    return config_from_args(ServerConfig, args, auth=secret.server_auth() if secret is not None else None)


async def _serve(args: argparse.Namespace, config: ServerConfig) -> int:
    metrics = endpoint = None
    if args.metrics_port is not None:
        metrics = ServerMetrics()
        host = args.metrics_host or config.host
        endpoint = await asyncio.to_thread(start_metrics_endpoint, metrics.registry, host=host, port=args.metrics_port)
        print(f"METRICS {endpoint.url}", flush=True)
    starting = contextlib.ExitStack()  # a line every few seconds from here until READY (or a failure)
    if args.engine != "fake":  # READY comes after the model is loaded: seconds on CPU, minutes for SGLang
        print(f"starting the {args.engine} engine (loading the model)...", file=sys.stderr, flush=True)
        starting.enter_context(_still_starting(f"the {args.engine} engine"))
    try:
        server = EngineServer(make_engine(args.engine, args), config, metrics=metrics)
    except BaseException:
        starting.close()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)

    def ready(address: str) -> None:
        if args.address_file:
            tmp = args.address_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(address)
            os.replace(tmp, args.address_file)
        starting.close()  # the still-starting lines end before READY
        print(f"READY {address}", flush=True)

    try:
        await server.serve(on_ready=ready)
    finally:
        starting.close()
        if endpoint is not None:
            await endpoint.aclose()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
