"""Launch under torchrun: DP x TP servers, discovery through the job's c10d store, optional driver.

    torchrun --standalone --nproc-per-node 4 -m rollout_sdk.launch --tp 2               # a standalone rollout service
    torchrun --standalone --nproc-per-node 4 my_driver.py --tp 2                         # my_driver.py calls run(main)

See docs/launch.md.
"""

from .job import LaunchConfig, run_job
from .layout import Layout
from .main import parse_launch_args, run

__all__ = ["LaunchConfig", "Layout", "parse_launch_args", "run", "run_job"]
