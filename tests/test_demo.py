"""The README's main job: `rollout-sdk demo` on the embedded default."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path, sdk_home, tool_model) -> None:
    out_json = tmp_path / "demo.json"
    env = dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_sdk",
            "demo",
            "--prompts",
            "4",
            "--group-size",
            "2",
            "--no-progress",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for needle in ("model: a", "calculator", "throughput", "tok/s", "p50", "loss_mask", "logprobs", "embedded-0"):
        assert needle in text, needle
    report = json.loads(out_json.read_text())
    assert report["trajectories"] == 8
    assert report["groups"] == 4
    assert report["tool_calls"] > 0
    assert report["model_tokens_per_s"] > 0


def test_demo_and_grpo_configs_refuse_values_that_would_break_them() -> None:
    import math

    import pytest

    from rollout_sdk.demos.generate import DemoConfig
    from rollout_sdk.demos.grpo import GrpoConfig
    from rollout_sdk.errors import ConfigError

    for field, value in (("prompts", 0), ("group_size", -3), ("max_new_tokens", 0), ("show", -1)):
        with pytest.raises(ConfigError, match=f"{field}={value}"):
            DemoConfig(**{field: value})
    for field, value in (("steps", 0), ("prompts", 0), ("group_size", 1), ("eval_instances", -1)):
        with pytest.raises(ConfigError, match=f"{field}={value}"):
            GrpoConfig(**{field: value})
    for lr in (0.0, -1e-3, math.nan, math.inf):
        with pytest.raises(ConfigError, match="lr="):
            GrpoConfig(lr=lr)
    GrpoConfig(group_size=2, eval_instances=0)  # the smallest that works
    with pytest.warns(DeprecationWarning, match="group_size"):  # the old names still work, and say so
        assert GrpoConfig(group=3).group_size == 3
    with pytest.warns(DeprecationWarning, match="group_size"):
        assert DemoConfig(samples=5).group_size == 5
