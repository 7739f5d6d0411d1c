"""A driver launched by torchrun: rank 0 runs main() while every TP leader serves an engine.

    torchrun --standalone --nproc-per-node 4 examples/driver.py --tp 2 --requests 100

The launch options (--tp, --engine, --model, ...) are rollout_sdk.launch's; --requests is this script's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os

from rollout_sdk import RolloutClient, SamplingParams
from rollout_sdk.launch import parse_launch_args, run


def _own_args() -> argparse.Namespace:
    _, rest = parse_launch_args()
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--report", default=None, help="write a JSON summary here")
    return p.parse_args(rest)


async def main() -> None:
    args = _own_args()
    async with RolloutClient() as client:  # discovers every server of this job through the store
        prompts = [[151644, 872, 198, 1000 + i] for i in range(args.requests)]
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, seed=7)
        results = await asyncio.gather(*(client.generate(p, sampling=sampling) for p in prompts))
        per_server = collections.Counter(r.server_id for r in results)
        summary = {
            "servers": [s.server_id for s in client.servers],
            "requests": len(results),
            "per_server": dict(per_server),
            "tokens": sum(len(r.output_ids) for r in results),
            "rank": int(os.environ.get("RANK", "0")),
        }
    print("DRIVER", json.dumps(summary), flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    raise SystemExit(run(main))
