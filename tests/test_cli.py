"""The command line a new user types (issue 37): every mistake is one line before any work starts, --help
is a page a reader can use, a typo gets a suggestion, and Ctrl-C during a server's start-up ends it without
READY."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_sdk.launch.args import field_help
from rollout_sdk.launch.cli import _parser
from rollout_sdk.launch.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the command in this process: a check that came after start-up would start an engine here (and
    print that it does); the checks come first, so it returns at once with exit code 2."""
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "starting" not in err and "loading" not in err
    return lines[0]


def test_an_abbreviation_is_not_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(["serve", "--fake-die-after-request", "1"], capsys)
    assert "unrecognized arguments: --fake-die-after-request" in line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--log-level", "bogus", "demo"], "'bogus' is not a log level"),
        (["serve", "--address-file", "/no/such/dir/addr"], "no directory '/no/such/dir'"),
        (["gateway", "--address-file", "/no/such/dir/addr"], "no directory '/no/such/dir'"),
        (["serve", "--model", "/no/such/dir"], "--model: '/no/such/dir' is not a directory"),
        (["serve", "--engine", "sglang", "--model", "/no/such/dir"], "'/no/such/dir' is not a directory"),
        (["serve", "--engine", "sglang"], "--engine sglang needs --model"),
        (["demo", "--servers", "127.0.0.1:36471"], "did you mean 'tcp://127.0.0.1:36471'?"),
        (["gateway", "--servers", "localhost"], "'localhost' is not a server address"),
        (["demo", "--json", "/no/such/dir/x.json"], "no directory '/no/such/dir'"),
        (["demo", "--prompts", "0"], "--prompts=0: must be >= 1"),
        (["demo", "--rl", "--rl-steps", "0"], "--rl-steps=0: must be >= 1"),
        (["serve", "--port", "99999"], "65535"),
        (["gateway", "--port", "70000"], "65535"),
        (["gateway", "--trajectories-jsonl", "/no/such/dir/t.jsonl"], "no directory '/no/such/dir'"),
        (["serve", "--cpu-max-running", "0"], "--cpu-max-running"),
        (["secret", "--out", "/no/such/dir/secret"], "no directory '/no/such/dir'"),
        (["serve", "--potr", "1"], "did you mean --port?"),
        (["gateway", "--max-sesions", "3"], "did you mean --max-sessions?"),
        (["demo", "--group-szie", "3"], "did you mean --group-size?"),
        (["serv"], "did you mean 'serve'?"),
    ],
)
def test_a_mistake_is_one_line_before_any_work(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(argv, capsys)
    assert says in line, line
    assert line.startswith("rollout-sdk")


def test_a_typo_never_suggests_a_hidden_test_hook(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(["serve", "--fake-die-after-requestz", "1"], capsys)
    assert "unrecognized arguments" in line and "did you mean" not in line, line


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    option=st.sampled_from(["--port", "--prompts", "--group-size", "--temperature", "--max-new-tokens", "--seed"]),
    value=st.one_of(st.text(max_size=12), st.sampled_from(["nan", "inf", "-1", "1e400", "0x10", "", " "])),
)
def test_any_value_of_a_number_option_is_accepted_or_refused_in_one_line(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Property: whatever a user types as a number, the parse (and the configs built from it) either
    succeeds or ends in one line naming the option; never a traceback."""
    command = "serve" if option == "--port" else "demo"
    argv = [command, f"{option}={value}"]
    from rollout_sdk.launch.cli import _check

    code: object = None
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        code = exc.code
    if code is not None:
        assert code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and option in err, err
        return
    problem = _check(args)
    assert problem is None or option in problem, problem


def _help(*argv: str) -> str:
    with pytest.raises(SystemExit):
        _parser().parse_args([*argv, "--help"])
    return ""


@pytest.mark.parametrize("command", ["demo", "serve", "gateway", "make-model", "secret", "credentials"])
def test_every_listed_option_has_help_and_test_hooks_are_hidden(command: str) -> None:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    listed = [a for a in sub._actions if a.help != argparse.SUPPRESS and a.option_strings]
    for action in listed:
        text = (action.help or "").replace("(default: %(default)s)", "")
        words = text.split("(default:")[0].strip()
        assert words, f"{command} {action.option_strings[0]} has no help beyond its default"
        assert not action.option_strings[0].startswith("--fake-"), action.option_strings
    hidden = {a.option_strings[0] for a in sub._actions if a.help == argparse.SUPPRESS and a.option_strings}
    if command == "serve":
        assert "--fake-die-after-requests" in hidden and "--fake-hang-start" in hidden
        assert "--fake-die-after-requests" in sub._option_string_actions  # hidden, still accepted
    if command == "demo":  # the deprecated spellings are accepted, not listed
        assert {"--samples", "--rl-group"} <= hidden
        assert "--group-size" not in hidden and "--rl-group-size" not in hidden
        titles = [g.title for g in sub._action_groups]
        assert "demo (without --rl)" in titles and "demo --rl (GRPO)" in titles


def test_help_is_grouped_and_usage_is_short(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n", 1)[0]
    assert len(usage.splitlines()) == 1, usage
    for title in ("server:", "cpu engine (--engine cpu):", "sglang engine (--engine sglang):"):
        assert title in out
    assert "--fake-die" not in out and "--fake-hang" not in out


def test_field_help_reads_the_configs_comments() -> None:
    from rollout_sdk.demos.generate import DemoConfig

    docs = field_help(DemoConfig)
    assert docs["prompts"].startswith("distinct questions")
    assert docs["samples"].startswith("deprecated")


# -- Ctrl-C during start-up --------------------------------------------------------------------------


def test_ctrl_c_during_serve_start_up_ends_it_without_ready(tmp_path: Path) -> None:
    """A script waiting for READY must never see a server that is already going away: a SIGINT while the
    engine starts (the fake engine holds its start until cancelled) ends the process without READY."""
    from test_first_use import interrupt_when

    addr = tmp_path / "addr"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "rollout_sdk", "serve", "--engine", "fake", "--fake-hang-start", "--address-file"]
    # the guard: unfixed, the start never ends
    code, out = interrupt_when([*argv, str(addr)], b"start() held", env=env, guard_s=120)
    assert code == 0, out
    assert "READY" not in out
    assert "Traceback" not in out
    assert not addr.exists()


def test_exit_process_flushes_runs_atexit_and_keeps_the_code() -> None:
    """The entry points leave through exit_process (no interpreter finalization: 7-12 s of torch teardown
    on a loaded machine): what is printed and registered still happens, and the exit code is kept."""
    code = (
        "import atexit, logging, sys\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "logging.basicConfig()\n"
        "logging.getLogger('x').warning('a log line')\n"
        "print('unflushed', end='')\n"
        "from rollout_sdk.launch.cli import exit_process\n"
        "exit_process(3)\n"
        "print('never')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 3, proc
    assert "unflushed" in proc.stdout and "atexit ran" in proc.stdout and "never" not in proc.stdout
    assert "a log line" in proc.stderr


def test_the_entry_points_leave_through_exit_process() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rollout-sdk"] == "rollout_sdk.launch.cli:entry"
    assert "entry()" in (ROOT / "src" / "rollout_sdk" / "__main__.py").read_text()
    assert "exit_process(main())" in (ROOT / "src" / "rollout_sdk" / "launch" / "__main__.py").read_text()
    # the torchrun script docs/launch.md runs on every rank (SIGINT to exit 5.5 s -> 1.7 s at a load of 7)
    assert "exit_process(run(None))" in (ROOT / "launch" / "serve.py").read_text()


def test_serve_says_every_few_seconds_that_its_engine_still_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """The still-starting ticker speaks while its block blocks the thread that runs it (as an engine's import
    and model load block serve's loop), and stops when the block ends (issue 37: no silent start)."""
    import time

    from rollout_sdk.launch.cli import _still_starting

    seen = ""
    with _still_starting("the cpu engine", every_s=0.01):
        deadline = time.monotonic() + 60
        while "still starting" not in seen:  # this thread is busy: only the ticker's own thread can print
            assert time.monotonic() < deadline, "the ticker never spoke"
            seen += capsys.readouterr().err
            time.sleep(0.005)  # a poll of captured output, not a duration
    import threading

    assert not [t for t in threading.enumerate() if t.name == "still-starting"]  # joined: nothing prints after
    assert "the cpu engine: still starting (" in seen


def test_blocking_phase_speaks_while_its_block_holds_the_thread() -> None:
    """blocking_phase (an example's `import torch`, the tiny model's build): a start line, a line every few
    seconds from its own thread while the block holds the caller's, a done line; the thread is joined
    (issue 37: 14-21 s silent imports and builds at a load of 4-7)."""
    import io
    import threading

    from rollout_sdk.demos.progress import blocking_phase

    ticked = threading.Event()

    class Out(io.StringIO):
        def write(self, s: str) -> int:
            if "still running" in s:
                ticked.set()
            return super().write(s)

    out = Out()
    with blocking_phase("loading torch", every_s=0.01, out=out):
        assert ticked.wait(60), "the phase never spoke while its block held the thread"
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading torch ..." and "loading torch ... still running (" in lines[1]
    assert lines[-1].startswith("loading torch: done in ")
    assert not [t for t in threading.enumerate() if t.name == "phase-loading torch"]  # joined
    quiet = io.StringIO()
    with blocking_phase("imported by a test", out=quiet, enabled=False):
        pass
    assert quiet.getvalue() == ""
