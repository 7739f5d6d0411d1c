"""GRPO that teaches the tool model to call its calculator, on CPU, through RolloutClient + ToolAgent.

    python examples/grpo_tools.py                 # 12 steps, 8 questions x 8 trajectories each
    python examples/grpo_tools.py --steps 4       # shorter
    rollout-sdk demo --rl                         # the same loop

It starts from the under-trained tool model (``ensure_tool_model(stage="undertrained")``: it calls the
calculator only part of the time), samples groups of trajectories with real tool calls, computes
group-relative advantages from a 0/1 reward, takes one policy-gradient step with the trainer's own
logprobs, and pushes the new weights into the engine (``client.update_weights``, gloo) every step.  It
prints success rate, reward, tool-call rate and the engine/trainer logprob gap per step.  The loop is
:func:`rollout_sdk.demos.grpo.run_grpo` (read it: about 100 lines).
"""

from __future__ import annotations

import argparse
import asyncio

from rollout_sdk.demos.grpo import GrpoConfig, run_grpo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=GrpoConfig.steps)
    p.add_argument("--prompts", type=int, default=GrpoConfig.prompts)
    p.add_argument("--group-size", "--group", type=int, default=GrpoConfig.group_size, dest="group_size")
    p.add_argument("--lr", type=float, default=GrpoConfig.lr)
    p.add_argument("--eval-instances", type=int, default=GrpoConfig.eval_instances)
    a = p.parse_args()
    config = GrpoConfig(
        steps=a.steps, prompts=a.prompts, group_size=a.group_size, lr=a.lr, eval_instances=a.eval_instances
    )
    try:
        asyncio.run(run_grpo(config))
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
