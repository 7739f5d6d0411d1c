"""The command line every benchmark shares: the common flags, mode defaults, and running the workload.

Each script keeps its own flags; the shared ones are spelled and defaulted here once::

    p = harness.parser(__doc__, quick="one seed (about 1 minute)", json="load_balance")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="(full 0 1 2, quick 0)")
    args = p.parse_args(argv)
    harness.by_mode(args, seeds=([0, 1, 2], [0]))
    report = harness.run(drive(args), uvloop=not args.no_uvloop)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from harness.procs import sigterm_as_interrupt

T = TypeVar("T")

#: bench/results/, where a benchmark's JSON goes by default
RESULTS = Path(__file__).resolve().parent.parent / "results"


def parser(
    doc: str | None = None,
    *,
    quick: str | bool = False,
    json: str | None = None,
    json_type: type = str,
    json_flag: str = "--json",
    reps: int | None = None,
    reps_help: str | None = None,
    uvloop: str | bool = False,
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` whose description is the script's docstring, with the shared flags asked for.

    ``quick``: add ``--quick`` (a string is its help).  ``json``: add ``json_flag`` defaulting to
    ``bench/results/<json>.json`` (``json_type`` ``str`` or ``Path``, as the script always had it).
    ``reps``: add ``--reps`` with that default.  ``uvloop``: add ``--no-uvloop``.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if reps is not None:
        p.add_argument("--reps", type=int, default=reps, help=reps_help)
    if quick:
        p.add_argument("--quick", action="store_true", help=quick if isinstance(quick, str) else None)
    if json is not None:
        default = RESULTS / f"{json}.json"
        p.add_argument(
            json_flag,
            type=json_type,
            default=json_type(default),
            help=f"write the numbers here (default {default})",
        )
    if uvloop:
        p.add_argument(
            "--no-uvloop",
            action="store_true",
            help=uvloop if isinstance(uvloop, str) else "run on the default asyncio loop",
        )
    return p


def add_quiet(p: argparse.ArgumentParser, what: str = "cell") -> None:
    """``--wait-quiet`` and ``--retries`` (see :func:`harness.passes.until_quiet`)."""
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help=f"before each {what}, wait up to this many seconds for other processes to use < 20%% of a core; "
        f"measure a {what} again (--retries) when they used more during it",
    )
    p.add_argument("--retries", type=int, default=2, help=f"with --wait-quiet: extra attempts per {what}")


def by_mode(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> argparse.Namespace:
    """Fill each flag left at ``None`` with its ``(full, quick)`` default, by ``args.quick``."""
    quick = bool(getattr(args, "quick", False))
    for name, (full, fast) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, fast if quick else full)
    return args


def mode_facts(args: argparse.Namespace) -> dict[str, str]:
    """The shared flags' part of a result's meta: the event loop (``--no-uvloop``) and the mode (``--quick``)."""
    return {"loop": "asyncio" if args.no_uvloop else "uvloop", "mode": "quick" if args.quick else "full"}


def run(main: Coroutine[Any, Any, T], *, uvloop: bool = True) -> T:
    """Run the workload's coroutine (on uvloop unless told not to, or not installed).  SIGTERM unwinds like
    Ctrl-C, so the ``finally`` blocks stop every process the benchmark started; then the script exits 130."""
    try:
        with sigterm_as_interrupt():
            return loop_runner(uvloop)(main)
    except KeyboardInterrupt:
        print("interrupted; stopping every process this benchmark started", file=sys.stderr)
        raise SystemExit(130) from None


def loop_runner(uvloop: bool = True) -> Callable[[Coroutine[Any, Any, T]], T]:
    """``uvloop.run`` where wanted and installed, else ``asyncio.run``."""
    if uvloop:
        try:
            import uvloop as _uvloop  # optional: the bench extra
        except ImportError:
            pass
        else:
            return _uvloop.run
    return asyncio.run
