"""A standalone rollout service: every torchrun rank runs this; TP leaders serve engines until SIGTERM.

    torchrun --standalone --nproc-per-node 4 launch/serve.py --tp 2 --engine cpu
    torchrun --standalone --nproc-per-node 8 launch/serve.py --tp 2 --engine sglang --model /models/qwen2.5-7b

Clients elsewhere connect with the job's store address (MASTER_ADDR:MASTER_PORT, printed at start):
    RolloutClient(discovery=StoreDiscovery("host:port"))   or   ROLLOUT_SDK_STORE=host:port

The rank leaves through ``exit_process`` once it has stopped (as ``python -m rollout_sdk.launch`` does): the
interpreter's finalization of torch alone took seconds per rank on a loaded machine (issue 37).
"""

from rollout_sdk.launch import run
from rollout_sdk.launch.cli import exit_process

if __name__ == "__main__":
    exit_process(run(None))
