"""The examples run end to end, as a user would run them (a subprocess, the session's private model home)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOOL_AGENT = ROOT / "examples" / "tool_agent.py"
# `timeout` below is a hang guard: a CPU engine starting on a loaded 2-core machine takes minutes


def _run(home: Path, *args: str, timeout: float = 240) -> tuple[str, dict[str, Any]]:
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(home), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(TOOL_AGENT), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(lines) == 1, proc.stdout
    return proc.stdout, json.loads(lines[0].removeprefix("SUMMARY "))


def test_tool_agent_scripted_runs_every_tool_path(sdk_home: Path, tiny_model: Path) -> None:
    out, summary = _run(sdk_home, "--scripted", "--group-size", "2")
    assert summary["mode"] == "scripted"
    # 3 questions x 2 samples; per sample: calculator + convert_units, 2 parallel lookups (one times out),
    # a calculator call with a wrong argument name and then a right one
    assert summary["trajectories"] == 6
    assert summary["finish"] == {"stop": 6}
    assert summary["turns"] == 2 * (3 + 2 + 3)
    assert summary["tool_calls"] == 12
    assert summary["tool_errors"] == 4
    assert summary["parse_errors"] == 0
    assert summary["registry"]["calls"] == 12
    assert summary["registry"]["ok"] == 8
    assert summary["registry"]["errors"] == {"unknown_tool": 0, "bad_arguments": 2, "raised": 0, "timeout": 2}
    assert summary["drift"] == 0
    assert summary["mean_reward"] == round((1.0 + 0.9 + 0.9) / 3, 4)
    assert summary["context_tokens"] > 0 and summary["model_tokens"] > 0
    # per-trajectory lines name each call and its outcome
    assert out.count("turns=3 tool_calls=[calculator:ok convert_units:ok] finish=stop") == 2
    assert out.count("turns=2 tool_calls=[lookup_population:ok lookup_population:timeout] finish=stop") == 2
    assert out.count("turns=3 tool_calls=[calculator:bad_arguments calculator:ok] finish=stop") == 2
    assert out.count("reward=1.00") == 2 and out.count("reward=0.90") == 4
    assert "  lookup_population  calls=4 ok=2 errors={'timeout': 2}" in out
    # the trajectory shown: model spans (mask 1) hold the calls, the loop's spans (mask 0) the tool results
    shown = out.split("\ntrajectory ", 1)[1]
    assert shown.count("[model   | loss_mask 1") == 3
    assert shown.count("[context | loss_mask 0") == 2
    assert '    | {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}' in shown
    assert "    | <tool_response>\n    | 27\n    | </tool_response><|im_end|>" in shown
    assert "    | <tool_response>\n    | 16.777\n    | </tool_response><|im_end|>" in shown


def test_tool_agent_on_the_trained_tool_model_by_default(sdk_home: Path, tool_model: Path) -> None:
    out, summary = _run(sdk_home, "--group-size", "2")
    assert summary["mode"] == "trained"
    assert f"trained tool model, {tool_model}" in out
    assert summary["trajectories"] == 6 and summary["parse_errors"] == 0
    # it sees all three tools and calls the calculator (sampled at temperature 1: most, not all, solve)
    assert summary["registry"]["calls"] == summary["tool_calls"] >= 1
    assert "calculator:ok" in out and summary["mean_reward"] > 0
    assert "[model   | loss_mask 1" in out and "<tool_response>" in out


def test_tool_agent_on_the_random_tiny_model(sdk_home: Path, tiny_model: Path) -> None:
    out, summary = _run(sdk_home, "--random", "--group-size", "2", "--max-new-tokens", "16", "--max-turns", "2")
    assert summary["mode"] == "random"
    assert summary["trajectories"] == 6
    assert sum(summary["finish"].values()) == 6
    assert set(summary["finish"]) <= {"stop", "length", "budget", "max_turns"}
    assert summary["model_tokens"] >= 6
    assert summary["registry"]["calls"] == summary["tool_calls"]
    assert "[model   | loss_mask 1" in out
    assert "tool registry: calls=" in out
