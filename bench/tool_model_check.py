"""Success rates of the tool model through the real path (CPU engine server, ZMQ, RolloutClient,
ToolAgent, the calculator): the trained stage greedy on held-back questions, the under-trained stage
sampled (the GRPO example's start) and greedy.  Then the trained stage through the gateway as a newcomer
calls it (``tests/gateway_agents/calculator_agent.py``: the real ``openai`` client for chat completions and
Responses, ``anthropic`` for Messages), with the docs' hand-written calculator definition and with every
held-back definition (``rollout_sdk.tasks.calculator_schemas.HELD_BACK``), greedy and at temperature 1.
Prints two tables.

    python bench/tool_model_check.py [--home DIR] [--questions N]   # builds the model first if not cached
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import harness
from transformers import AutoTokenizer

from rollout_sdk import RolloutClient
from rollout_sdk.engines.cpu import CpuEngineConfig
from rollout_sdk.tasks import calculator as task
from rollout_sdk.tasks import ensure_tool_model
from rollout_sdk.tasks.calculator_schemas import HELD_BACK, HeldBackTool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


async def rate(path: str, temperature: float, n: int, k: int, split: str) -> tuple[float, float]:
    tok = AutoTokenizer.from_pretrained(path)
    agent = task.make_agent(tok, temperature=temperature, seed=1)
    async with RolloutClient(engine=CpuEngineConfig(model_path=path)) as client:
        groups = await task.run_groups(client, agent, task.samples(n, seed=3, split=split), group_size=k)
    trajs = [t for g in groups for t in g]
    called = sum(1 for t in trajs if any(c.name == "calculator" for u in t.turns for c in u.tool_calls))
    return sum(t.reward or 0.0 for t in trajs) / len(trajs), called / len(trajs)


async def through_gateway(path: str, n: int) -> list[tuple[str, str, str, int, int, int, float]]:
    """(definition, API, decoding, questions, parsed calls, solved, seconds) per definition, API, decoding."""
    import anthropic
    import openai

    from gateway_agents.calculator_agent import solve_chat, solve_messages, solve_responses
    from rollout_sdk.gateway import Gateway

    rows = []
    async with RolloutClient(engine=CpuEngineConfig(model_path=path)) as client, Gateway(client) as gw:

        async def one(api: str, tool: HeldBackTool, sample: dict[str, Any], key: str, temperature: float) -> Any:
            c: Any
            if api == "messages":
                c = anthropic.AsyncAnthropic(base_url=gw.url.removesuffix("/v1"), api_key=key, max_retries=0)
                solve, spelled = solve_messages, tool.messages()
            else:
                c = openai.AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0)
                solve, spelled = (solve_chat, tool.chat()) if api == "chat" else (solve_responses, tool.responses())
            try:
                q = sample["messages"][0]["content"]
                return await solve(  # type: ignore[operator]
                    c, gw.model_name, spelled, q, sample["answer"], temperature=temperature, system=tool.system
                )
            finally:
                await c.close()

        for d, tool in enumerate(HELD_BACK):
            samples = task.samples(n if d == 0 else max(n // 4, 10), seed=500 + d, split="test")
            for api in ("chat", "responses", "messages"):
                for temperature in (0.0, 1.0):
                    t0 = time.perf_counter()
                    outs = await asyncio.gather(
                        *(one(api, tool, s, f"{api}-{d}-{temperature}-{k}", temperature) for k, s in enumerate(samples))
                    )
                    rows.append(
                        (
                            tool.label,
                            api,
                            "greedy" if temperature == 0 else "T=1",
                            len(outs),
                            sum(o.arguments is not None for o in outs),
                            sum(o.solved for o in outs),
                            time.perf_counter() - t0,
                        )
                    )
                    print(*rows[-1], flush=True)
    return rows


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--home", default=None)
    p.add_argument("--questions", type=int, default=100, help="held-back questions per API (docs' definition)")
    p.add_argument("--gateway-only", action="store_true")
    args = p.parse_args()
    path = str(ensure_tool_model(args.home))
    t0 = time.perf_counter()
    gw_rows = harness.run(through_gateway(path, args.questions), uvloop=False)
    print(f"\nthrough the gateway ({time.perf_counter() - t0:.0f} s)")
    table = [
        [label, api, dec, n, f"{parsed / n:.1%}", f"{solved / n:.1%}"]
        for label, api, dec, n, parsed, solved, _ in gw_rows
    ]
    print(harness.table(["definition", "API", "decoding", "questions", "parsed", "solved"], table, left=(0, 1, 2)))
    if args.gateway_only:
        return
    rows = []
    for stage, temperature, n, k, split in [
        ("trained", 0.0, 100, 1, "test"),
        ("undertrained", 1.0, 32, 8, "train"),
        ("undertrained", 0.0, 50, 1, "test"),
    ]:
        path = str(ensure_tool_model(args.home, stage=stage))
        t0 = time.perf_counter()
        success, called = harness.run(rate(path, temperature, n, k, split), uvloop=False)
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
    table = [
        [stage, dec, inst, f"{success:.1%}", f"{called:.1%}", f"{secs:.1f}"]
        for stage, dec, inst, success, called, secs in rows
    ]
    print(harness.table(["model", "decoding", "instances", "success", "called", "seconds"], table, left=(0, 1, 2)))


if __name__ == "__main__":
    main()
