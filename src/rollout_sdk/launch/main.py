"""The torchrun entry: options derived from the configs, then :func:`run_job` on this rank."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..engines.fake import FakeEngineConfig
from ..engines.registry import EngineConfigs
from ..errors import ConfigError
from ..protocol.engine_config import CpuEngineConfig
from .args import (
    LOG_LEVELS,
    OneLineErrors,
    add_config_args,
    add_sglang_args,
    config_from_args,
    log_level,
    sglang_fields,
)
from .job import LaunchConfig, Main, preflight, run_job
from .layout import Layout

__all__ = ["main", "parse_launch_args", "run"]


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrors(
        prog="python -m rollout_sdk.launch",
        description="Run under torchrun: every rank calls this; TP leaders serve engines; rank 0 may drive.",
    )
    p.add_argument("--driver", default=None, help="module:function of an async main() to run on rank 0")
    p.add_argument(
        "--log-level",
        type=log_level,
        default=os.environ.get("ROLLOUT_SDK_LOG_LEVEL", "INFO"),
        help=f"one of {', '.join(LOG_LEVELS)} (default: $ROLLOUT_SDK_LOG_LEVEL or INFO)",
    )
    add_config_args(p, LaunchConfig, title="launch")
    add_config_args(p, CpuEngineConfig, prefix="cpu-", title="cpu engine (--engine cpu)")
    add_config_args(p, FakeEngineConfig, prefix="fake-", hidden=True)  # test hooks: accepted, not listed
    add_sglang_args(p)
    return p


def parse_launch_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parse the launch options; unknown arguments are left for the caller's own parser."""
    return _parser().parse_known_args(argv)


def _configs(args: argparse.Namespace) -> tuple[LaunchConfig, EngineConfigs]:
    return config_from_args(LaunchConfig, args), EngineConfigs(
        cpu=config_from_args(CpuEngineConfig, args, prefix="cpu-"),
        fake=config_from_args(FakeEngineConfig, args, prefix="fake-"),
        sglang=sglang_fields(args),
    )


def _load_driver(spec: str) -> Main:
    module, _, func = spec.partition(":")
    fn: Any = getattr(importlib.import_module(module), func or "main")
    return fn  # type: ignore[no-any-return]


def run(main: Main | None = None, argv: Sequence[str] | None = None) -> int:
    """Run this torchrun rank: parse the launch options from ``argv`` (default ``sys.argv``), serve, and
    on rank 0 run ``main`` (an ``async def`` taking no arguments) as the driver.  Returns the exit code.

    Example driver script (``torchrun --standalone --nproc-per-node 4 driver.py --tp 2``)::

        from rollout_sdk import RolloutClient
        from rollout_sdk.launch import run

        async def main():
            async with RolloutClient() as client:      # finds every server of the job
                ...

        if __name__ == "__main__":
            raise SystemExit(run(main))
    """
    args, _ = parse_launch_args(argv)
    try:
        Layout.from_env(args.tp)  # not under torchrun: one line that says so, not a traceback
    except ConfigError as exc:
        print(f"rollout_sdk.launch: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [rank {os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s",
    )
    if main is None and args.driver:
        main = _load_driver(args.driver)
    try:
        cfg, engines = _configs(args)
        preflight(cfg)
    except ConfigError as exc:  # a setup mistake (e.g. a multi-node job without a secret): one line, no trace
        print(f"rollout-sdk: {exc}", file=sys.stderr)
        return 2
    # torch loads here, past the checks: a rank that refuses to start says so without importing it
    from torch.distributed.elastic.multiprocessing.errors import record  # lazy: cli-start

    code = record(run_job)(main, cfg, engines)
    return int(code or 0)


def main() -> int:
    return run()
