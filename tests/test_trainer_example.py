"""examples/custom_trainer.py: a trainer loop embedding the SDK learns, with engine and trainer in step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_custom_trainer_learns_and_keeps_engine_in_sync(sdk_home, tiny_model) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_trainer.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=dict(os.environ, ROLLOUT_SDK_HOME=str(sdk_home)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"step (\d+): reward ([\d.]+)  engine/trainer logprob gap ([\d.e+-]+)", proc.stdout)
    assert len(steps) == 3
    rewards = [float(r) for _, r, _ in steps]
    gaps = [float(g) for _, _, g in steps]
    # the engine serves exactly the trainer's weights after every update: same logprobs
    assert max(gaps) < 1e-4
    # and the policy learns the toy task
    assert rewards[-1] > rewards[0] + 0.2
    assert "weight version of a new result: 3" in proc.stdout
