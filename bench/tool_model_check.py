"""Success rates of the tool model through the real path (CPU engine server, ZMQ, RolloutClient,
ToolAgent, the calculator): the trained stage greedy on held-back questions, the under-trained stage
sampled (the GRPO example's start) and greedy.  Prints a table.

    python bench/tool_model_check.py [--home DIR]      # builds the model first if it is not cached
"""

from __future__ import annotations

import argparse
import asyncio
import time

from transformers import AutoTokenizer

from rollout_sdk import RolloutClient
from rollout_sdk.engines.cpu import CpuEngineConfig
from rollout_sdk.tasks import calculator as task
from rollout_sdk.tasks import ensure_tool_model


async def rate(path: str, temperature: float, n: int, k: int, split: str) -> tuple[float, float]:
    tok = AutoTokenizer.from_pretrained(path)
    agent = task.make_agent(tok, temperature=temperature, seed=1)
    async with RolloutClient(engine=CpuEngineConfig(model_path=path)) as client:
        groups = await task.run_groups(client, agent, task.samples(n, seed=3, split=split), group_size=k)
    trajs = [t for g in groups for t in g]
    called = sum(1 for t in trajs if any(c.name == "calculator" for u in t.turns for c in u.tool_calls))
    return sum(t.reward or 0.0 for t in trajs) / len(trajs), called / len(trajs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--home", default=None)
    args = p.parse_args()
    rows = []
    for stage, temperature, n, k, split in [
        ("trained", 0.0, 100, 1, "test"),
        ("undertrained", 1.0, 32, 8, "train"),
        ("undertrained", 0.0, 50, 1, "test"),
    ]:
        path = str(ensure_tool_model(args.home, stage=stage))
        t0 = time.perf_counter()
        success, called = asyncio.run(rate(path, temperature, n, k, split))
        rows.append(
            (
                stage,
                "greedy" if temperature == 0 else f"T={temperature:g}",
                f"{n} {split} x {k}",
                success,
                called,
                time.perf_counter() - t0,
            )
        )
    print(f"{'model':<13} {'decoding':<8} {'instances':<14} {'success':>8} {'called':>7} {'seconds':>8}")
    for stage, dec, inst, success, called, secs in rows:
        print(f"{stage:<13} {dec:<8} {inst:<14} {success:>8.1%} {called:>7.1%} {secs:>8.1f}")


if __name__ == "__main__":
    main()
