"""The rollout-sdk command.

  rollout-sdk demo            tool-using agent rollouts on the CPU engine (the trained tool model)
  rollout-sdk demo --rl       GRPO on CPU: the tool model learns to delegate, success printed per step
  rollout-sdk serve           one engine server (cpu, sglang or fake) until Ctrl-C / SIGTERM
  rollout-sdk make-model      build a local model (tiny, tool, tool-undertrained); print its directory
  rollout-sdk gateway         an OpenAI-compatible API in front of the engines (docs/gateway.md)

Many servers (DP x TP) are launched with torchrun:
  torchrun --standalone --nproc-per-node 4 -m rollout_sdk.launch --tp 2 --engine sglang --model DIR
(see docs/launch.md).  Every option below mirrors a field of a config class of the Python API.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from ._cli_config import add_config_args, add_sglang_args, config_from_args, sglang_fields
from .client import ClientConfig
from .demo import DemoConfig, run_demo
from .engines.cpu import CpuEngineConfig
from .engines.fake import FakeEngineConfig
from .errors import ConfigError, RolloutError
from .rl_demo import GrpoConfig, run_grpo
from .server import ServerConfig

__all__ = ["main", "run_async"]


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on uvloop where available (installed per call, not at import)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(coro)
    return uvloop.run(coro)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-sdk", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run N prompts x n samples and print throughput and a trajectory")
    d.add_argument("--servers", nargs="*", default=None, help="server addresses (default: embedded CPU engine)")
    d.add_argument("--json", default=None, help="also write the numbers to this file")
    d.add_argument("--rl", action="store_true", help="run GRPO on the under-trained tool model instead")
    add_config_args(d, DemoConfig, title="demo")
    add_config_args(d, GrpoConfig, prefix="rl-", title="demo --rl")
    add_config_args(d, ClientConfig, prefix="client-", title="client")
    add_config_args(d, CpuEngineConfig, prefix="engine-", title="embedded CPU engine")

    s = sub.add_parser("serve", help="serve one engine over ZMQ until SIGTERM/SIGINT")
    s.add_argument("--engine", choices=["cpu", "sglang", "fake"], default="cpu")
    s.add_argument("--model", default=None, help="model directory (cpu default: the embedded tiny model)")
    s.add_argument("--address-file", default=None, help="write the bound address (tcp://host:port) here once serving")
    add_config_args(s, ServerConfig, title="server")
    add_config_args(s, CpuEngineConfig, prefix="cpu-", title="cpu engine (--engine cpu)")
    add_config_args(s, FakeEngineConfig, prefix="fake-", title="fake engine (--engine fake)")
    add_sglang_args(s)

    from .gateway import cli as gateway_cli

    gateway_cli.add_parser(sub)

    m = sub.add_parser("make-model", help="build a local model (offline) and print its directory")
    m.add_argument(
        "which",
        nargs="?",
        choices=["tiny", "tool", "tool-undertrained"],
        default="tiny",
        help="tiny: random weights (seconds); tool: trained on CPU for the calculator task (minutes, once)",
    )
    m.add_argument("--home", default=None, help="cache root (default $ROLLOUT_SDK_HOME or ~/.cache/rollout_sdk)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _command(args)
    except KeyboardInterrupt:
        print("rollout-sdk: interrupted", file=sys.stderr)
        return 130
    except (RolloutError, OSError, ValueError) as exc:  # expected situations: one line, not a traceback
        logging.getLogger("rollout_sdk.cli").debug("failed", exc_info=exc)
        print(f"rollout-sdk {args.command}: error: {exc}", file=sys.stderr)
        return 2


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
                client=config_from_args(ClientConfig, args, prefix="client-"),
            )
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    if args.command == "serve":
        return int(run_async(_serve(args)))
    if args.command == "gateway":
        from .gateway import cli as gateway_cli

        _quiet_transformers()
        return int(run_async(gateway_cli.run(args)))
    if args.command == "make-model":
        from .models import ensure_tiny_model, ensure_tool_model

        if args.which == "tiny":
            print(ensure_tiny_model(args.home))
        else:
            print(ensure_tool_model(args.home, stage="trained" if args.which == "tool" else "undertrained"))
        return 0
    return 2  # pragma: no cover


def _quiet_transformers() -> None:
    """A command whose output is a report: no weight-loading progress bars (a CLI may set this; a library not)."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    except Exception:  # transformers missing or changed: the bars are cosmetic
        pass


def make_engine(kind: str, args: argparse.Namespace) -> Any:
    if kind == "cpu":
        from .engines.cpu import CpuEngine

        cpu = config_from_args(CpuEngineConfig, args, prefix="cpu-")
        return CpuEngine(dataclasses.replace(cpu, model_path=args.model) if args.model else cpu)
    if kind == "fake":
        from .engines.fake import FakeEngine

        return FakeEngine(config_from_args(FakeEngineConfig, args, prefix="fake-"))
    from .engines.sglang import SglangEngine, SglangEngineConfig

    fields = sglang_fields(args)
    if args.model:
        fields["model_path"] = args.model
    if not fields.get("model_path"):
        raise ConfigError("--model", None, "is required with --engine sglang (a model directory or hub name)")
    return SglangEngine(SglangEngineConfig(**fields))


async def _serve(args: argparse.Namespace) -> int:
    from .server import EngineServer

    server = EngineServer(make_engine(args.engine, args), config_from_args(ServerConfig, args))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)

    def ready(address: str) -> None:
        if args.address_file:
            import os

            tmp = args.address_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(address)
            os.replace(tmp, args.address_file)
        print(f"READY {address}", flush=True)

    await server.serve(on_ready=ready)
    await _exit_if_threads_hang(loop, grace_s=1.0)
    return 0


async def _exit_if_threads_hang(loop: asyncio.AbstractEventLoop, *, grace_s: float) -> None:
    """Keep the shutdown bound when a thread (a collective stuck in ``to_thread``) cannot be stopped:
    asyncio would wait for it without a limit at exit, so give it ``grace_s`` and then leave anyway."""
    try:
        await asyncio.wait_for(loop.shutdown_default_executor(), grace_s)
    except TimeoutError:
        import logging
        import os

        logging.getLogger("rollout_sdk.server").warning("a worker thread is stuck; exiting without it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
