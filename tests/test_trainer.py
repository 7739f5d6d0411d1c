"""Embedding in a trainer, under real torchrun (gloo, CPU engine): weight updates, versions, pause modes,
partial rollouts, refused updates.  The job is tests/jobs/trainer_checks.py; this asserts its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory, sdk_home, tiny_model) -> dict:
    out = tmp_path_factory.mktemp("trainer") / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "jobs" / "trainer_checks.py"),
            "--engine",
            "cpu",
            "--model",
            str(tiny_model),
            "--report",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "exception" not in data, data.get("exception")
    return data


def test_update_changes_outputs_to_a_reference_models(report) -> None:
    assert report["servers"] == ["dp0", "dp1"]
    assert all(report["changed"])
    assert all(report["equal_reference"])
    assert report["update_stats"]["buckets"] >= 2  # flattened buckets, not one collective per tensor


def test_versions_tag_results_on_every_server(report) -> None:
    assert report["before_versions"] == [0]
    assert report["after_versions"] == [1]
    assert report["after_servers"] == ["dp0", "dp1"]


def test_refused_updates_leave_the_old_weights_serving(report) -> None:
    errors = report["bad_update_errors"]
    assert "unknown parameter 'model.no_such.weight'" in errors[0]["message"]
    assert "shape (2, 2)" in errors[1]["message"]
    assert all(e["applied"] is False for e in errors)
    assert all(report["still_serving_old"])
    assert report["version_after_refused"] == [1]


def test_update_during_100_in_flight_with_hold_loses_none(report) -> None:
    assert report["hold_errors"] == []
    assert report["hold_ok"] == 100
    assert report["hold_spanning"] == 100  # every request has tokens from v1, then from v2


def test_abort_returns_partials_that_resume_to_completion(report) -> None:
    assert report["abort_partial"] == 50
    assert report["abort_completed"] == 50
    assert report["abort_segments"] == [[2, 3]]
    assert report["abort_logprobs_aligned"]


def test_staleness_bound_is_enforced(report) -> None:
    assert report["staleness_refused"]
    assert "max_staleness=2" in report["staleness_message"]
