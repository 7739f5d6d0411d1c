"""Multi-turn tool-using rollouts, GRPO style, on the embedded CPU engine.

    python examples/tool_agent.py               # the trained tool model (built once, minutes) on the CPU engine
    python examples/tool_agent.py --random      # the tiny model with random weights: no tool calls, reward 0
    python examples/tool_agent.py --scripted    # a scripted engine that calls the tools, to see every path

Three tools (a calculator over a safe expression evaluator, a unit converter, a slow async lookup with a
timeout and a concurrency cap), three questions, ``--group-size`` trajectories per question (a GRPO group)
rewarded by an async reward function as each one finishes.  It prints a line per trajectory, the tool
registry's counters, one trajectory's tokens split into model spans (loss mask 1) and spans the loop added
(loss mask 0), and a final ``SUMMARY {json}`` line.

By default the model is the *tool model* (``rollout-sdk make-model tool``: a tiny Qwen2 trained on CPU to
delegate arithmetic to a ``calculator``; the first run trains it, a few minutes, then it is cached): it
gets three held-back multiplication questions, sees all three tools, calls the calculator and answers
from its result.  ``--random`` runs the tiny model with random weights instead: it almost never writes a
``<tool_call>``, so each trajectory is one model turn cut at ``--max-new-tokens`` (finish ``length``) with
reward 0.  ``--scripted`` runs the same agent against an in-process server around a FakeEngine whose
responder answers each conversation with a fixed script of exact token ids (tool calls in the Qwen2.5 /
Hermes format), so every tool path runs: two calls over two turns, two parallel calls of which one times
out, a call with bad arguments that the model then fixes.  See docs/agents.md.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import collections
import contextlib
import itertools
import json
import math
import operator
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal

from rollout_sdk import CpuEngineConfig, EngineServer, GenerateRequest, RolloutClient, SamplingParams
from rollout_sdk.agents import (
    AgentConfig,
    ToolAgent,
    ToolRegistry,
    Trajectory,
    group_stats,
    rollout_group,
    tool,
)
from rollout_sdk.demos.progress import phase
from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
from rollout_sdk.models import load_tokenizer
from rollout_sdk.tasks import calculator as calculator_task
from rollout_sdk.tasks.tool_model import ensure_tool_model_async

IM_END = 151645  # Qwen2.5's <|im_end|>: the end of an assistant turn, an EOS of the engine

# -- tools ----------------------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses over numbers; no names, calls or attributes (no eval)."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    tree = ast.parse(expression, mode="eval")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and type(node.value) is not bool:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("exponent or base too large")
            result: int | float = _BINARY[type(node.op)](left, right)
            return result
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            result = _UNARY[type(node.op)](ev(node.operand))
            return result
        raise ValueError(f"unsupported syntax: {ast.unparse(node)!r}")

    value = ev(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


@tool(timeout_s=2.0)
def calculator(expression: str) -> int | float:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "3 * (4 + 5)".
    """
    return safe_eval(expression)  # a sync tool: the registry runs it in a worker thread


Unit = Literal["m", "km", "mi", "ft", "g", "kg", "lb"]
_UNITS: dict[str, tuple[str, float]] = {  # unit -> (dimension, size in the SI unit)
    "m": ("length", 1.0),
    "km": ("length", 1000.0),
    "mi": ("length", 1609.344),
    "ft": ("length", 0.3048),
    "g": ("mass", 0.001),
    "kg": ("mass", 1.0),
    "lb": ("mass", 0.45359237),
}


@tool
def convert_units(value: float, from_unit: Unit, to_unit: Unit) -> float:
    """Convert a length or a mass from one unit to another.

    Args:
        value: the quantity to convert.
        from_unit: its unit.
        to_unit: the unit wanted (same dimension).
    """
    (dim_from, size_from), (dim_to, size_to) = _UNITS[from_unit], _UNITS[to_unit]
    if dim_from != dim_to:
        raise ValueError(f"cannot convert {dim_from} ({from_unit}) to {dim_to} ({to_unit})")
    return round(value * size_from / size_to, 4)


_POPULATION = {"paris": 2_102_650, "tokyo": 13_960_000, "lagos": 15_388_000}
_SLOW = {"atlantis": 30.0}  # a backend that hangs for this city: the tool's timeout cuts it


@tool(timeout_s=0.5, max_concurrency=2)
async def lookup_population(city: str) -> dict[str, Any]:
    """Look up the population of a city (a slow remote service).

    Args:
        city: the city's name, e.g. "Paris".
    """
    await asyncio.sleep(_SLOW.get(city.lower(), 0.2))
    if city.lower() not in _POPULATION:
        raise LookupError(f"no population data for {city!r}")
    return {"city": city, "population": _POPULATION[city.lower()]}


def make_registry() -> ToolRegistry:
    return ToolRegistry([calculator, convert_units, lookup_population])


# -- the task -------------------------------------------------------------------------------------

SAMPLES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "How many miles is 3 * (4 + 5) km?"}], "answer": "16.78"},
    {"messages": [{"role": "user", "content": "Which has more people, Paris or Atlantis?"}], "answer": "Paris"},
    {"messages": [{"role": "user", "content": "What is 2 to the power of 10?"}], "answer": "1024"},
]


def trained_samples() -> list[dict[str, Any]]:
    """Questions of the kind the tool model was trained on (products of two-digit numbers), held back from
    its training."""
    return [
        {"messages": s["messages"], "answer": str(s["answer"])}
        for s in calculator_task.samples(3, seed=1, split="test")
    ]


def final_answer(traj: Trajectory) -> str:
    """The content of the last assistant message (what the model said when it stopped)."""
    return next((m.get("content") or "" for m in reversed(traj.messages) if m["role"] == "assistant"), "")


async def reward(traj: Trajectory, sample: Mapping[str, Any]) -> float:
    """1 for the right answer in the final turn, minus 0.1 per failed or malformed tool call."""
    await asyncio.sleep(0.01)  # stands in for an async verifier (a sandbox, a judge model, ...)
    correct = traj.finish_reason == "stop" and sample["answer"] in final_answer(traj)
    penalty = 0.1 * (traj.metrics.get("tool_errors", 0.0) + traj.metrics.get("parse_errors", 0.0))
    return round(float(correct) - penalty, 4)


# -- the scripted engine --------------------------------------------------------------------------


def call(name: str, **arguments: Any) -> str:
    """A tool call as Qwen2.5 writes it (and as its chat template renders it back)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPTS: dict[str, list[str]] = {  # question -> the assistant's turns, in order
    SAMPLES[0]["messages"][0]["content"]: [
        call("calculator", expression="3 * (4 + 5)"),
        call("convert_units", value=27, from_unit="km", to_unit="mi"),
        "3 * (4 + 5) = 27 km, which is about 16.78 miles.",
    ],
    SAMPLES[1]["messages"][0]["content"]: [
        call("lookup_population", city="Paris") + "\n" + call("lookup_population", city="Atlantis"),
        "Paris has about 2.1 million people; the lookup for Atlantis timed out, so Paris is my answer.",
    ],
    SAMPLES[2]["messages"][0]["content"]: [
        call("calculator", expr="2 ** 10"),  # wrong argument name: the registry refuses and says why
        call("calculator", expression="2 ** 10"),
        "2 to the power of 10 is 1024.",
    ],
}


class ScriptedResponder:
    """FakeEngine responder: turn k of a conversation gets the k-th scripted assistant turn, as exact ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.outputs = {
            question: [[*tokenizer.encode(text, add_special_tokens=False), IM_END] for text in turns]
            for question, turns in SCRIPTS.items()
        }

    def __call__(self, req: GenerateRequest) -> list[int]:
        text = self.tokenizer.decode(req.input_ids)
        k = text.count("<|im_start|>assistant") - 1  # assistant turns so far, not counting this one
        for question, outputs in self.outputs.items():
            if question in text:
                return outputs[min(k, len(outputs) - 1)]
        return [*self.tokenizer.encode("I do not know.", add_special_tokens=False), IM_END]


@contextlib.asynccontextmanager
async def open_client(mode: str, tokenizer: Any, model_path: str | None) -> AsyncIterator[RolloutClient]:
    if mode == "trained":
        async with RolloutClient(engine=CpuEngineConfig(model_path=model_path)) as client:  # the tool model
            yield client
        return
    if mode == "random":
        async with RolloutClient() as client:  # the embedded CPU engine, tiny Qwen2 model (random weights)
            yield client
        return
    engine = FakeEngine(FakeEngineConfig(eos_token_ids=(IM_END,)), responder=ScriptedResponder(tokenizer))
    async with EngineServer(engine) as server, RolloutClient(servers=[server.address]) as client:
        yield client


# -- output ---------------------------------------------------------------------------------------


def describe_calls(traj: Trajectory) -> str:
    calls = [f"{c.name}:{'ok' if c.ok else c.error_kind}" for t in traj.turns for c in t.tool_calls]
    calls += [f"parse_error:{e.split(':')[0]}" for t in traj.turns for e in t.parse_errors]
    return "[" + " ".join(calls) + "]"


def show_spans(traj: Trajectory, tokenizer: Any, say: Callable[..., None]) -> None:
    """The trajectory's tokens: the prompt's last turn, then each run of equal loss mask, decoded."""
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    prompt = tokenizer.decode(traj.prompt_ids)
    cut = prompt.rfind("<|im_start|>user")
    say(f"[prompt  | {len(traj.prompt_ids)} tokens; system prompt and tool schemas not shown]")
    _indented(prompt[cut:] if cut >= 0 else prompt[-300:], say)
    rows = zip(traj.response_ids, traj.loss_mask, traj.logprobs, strict=True)
    for mask, run in itertools.groupby(rows, key=lambda row: row[1]):
        span = list(run)
        ids = [tok for tok, _, _ in span]
        if mask:
            lp = sum(lp for _, _, lp in span)
            say(f"[model   | loss_mask 1 | {len(ids)} tokens | logprob sum {lp:.2f}]")
        else:
            assert all(lp == 0.0 for _, _, lp in span)
            say(f"[context | loss_mask 0 | {len(ids)} tokens | added by the loop: end of turn, tool results]")
        _indented(tokenizer.decode(ids), say)


def _indented(text: str, say: Callable[..., None]) -> None:
    for line in text.split("\n"):
        say(f"    | {line}")


# -- main -----------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    def say(*parts: object) -> None:
        print(*parts, flush=True)

    t0 = time.perf_counter()
    mode = "scripted" if args.scripted else "random" if args.random else "trained"
    model_path = None
    if mode == "trained":
        say("tool agent: loading the trained tool model (the first run trains it: a few minutes, a progress bar)")
        model_path = str(await ensure_tool_model_async())  # in a worker thread; Ctrl-C stops the training
    async with phase("tool agent: loading the tokenizer"):  # a first line at once, then one every few seconds
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)  # blocking: off the event loop
    registry = make_registry()
    samples = trained_samples() if mode == "trained" else SAMPLES
    config = AgentConfig(
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens or {"scripted": 128, "random": 32, "trained": 48}[mode],
        sampling=SamplingParams(temperature=1.0),  # no seed: the samples of a group must differ
        # Re-rendering the conversation must give back the exact tokens when the model's text is what the
        # template would write (the script's is); a real model's free text rarely is, see docs/agents.md.
        drift_check=args.scripted,
    )
    agent = ToolAgent(tokenizer, registry, config)
    engine = {
        "scripted": "scripted FakeEngine",
        "random": "embedded CPU engine (tiny Qwen2, random weights)",
        "trained": f"embedded CPU engine (the trained tool model, {model_path})",
    }[mode]
    say(f"tool agent: {len(samples)} questions x {args.group_size} samples on the {engine}")
    say(f"tools: {', '.join(registry.names)}")

    async with contextlib.AsyncExitStack() as stack:
        async with phase("starting the engine"):
            client = await stack.enter_async_context(open_client(mode, tokenizer, model_path))
        t1 = time.perf_counter()
        async with phase("running the agents"):
            groups = await asyncio.gather(
                *(
                    rollout_group(
                        client, agent, sample, group_size=args.group_size, reward=reward, sample_index=i, timeout=60.0
                    )
                    for i, sample in enumerate(samples)
                )
            )
        rollout_s = time.perf_counter() - t1

    say("")
    say("trajectories")
    for i, group in enumerate(groups):
        say(f"group {i}: {samples[i]['messages'][-1]['content']!r} (answer {samples[i]['answer']!r})")
        for k, traj in enumerate(group):
            say(
                f"  #{k} turns={len(traj.turns)} tool_calls={describe_calls(traj)} finish={traj.finish_reason} "
                f"model_tokens={traj.num_model_tokens} context_tokens={len(traj.loss_mask) - traj.num_model_tokens} "
                f"reward={traj.reward:.2f} drift={'none' if traj.drift is None else 'YES'}"
            )
            if traj.drift is not None:
                say(f"     {traj.drift}")
        rewards = [t.reward or 0.0 for t in group]
        mean = sum(rewards) / len(rewards)
        say(f"  group reward mean {mean:.2f}, advantages {[round(r - mean, 2) for r in rewards]}")
    if args.scripted:
        say("(scripted: every sample of a group follows the same script, so the advantages are 0)")

    stats = registry.stats()
    say("")
    say(
        f"tool registry: calls={stats['calls']} ok={stats['ok']} timeouts={stats['timeouts']} "
        f"errors={json.dumps(stats['errors'])}"
    )
    for name, s in stats["tools"].items():
        errors = {kind: n for kind, n in s["errors"].items() if n}
        say(f"  {name:<18} calls={s['calls']} ok={s['ok']} errors={errors} latency_total={s['latency_s_total']:.2f}s")

    trajs = [t for g in groups for t in g]
    shown = max(trajs, key=lambda t: len(t.turns))
    say("")
    say(f"trajectory {shown.id[:8]} (group {shown.sample_index}): turns={len(shown.turns)}, {shown.finish_reason}")
    show_spans(shown, tokenizer, say)

    totals = group_stats(groups)
    summary = {
        "mode": mode,
        **{k: int(v) for k, v in totals.items()},
        "finish": dict(collections.Counter(t.finish_reason for t in trajs)),
        "mean_reward": round(sum(t.reward or 0.0 for t in trajs) / len(trajs), 4),
        "drift": sum(t.drift is not None for t in trajs),
        "registry": {k: stats[k] for k in ("calls", "ok", "errors", "timeouts")},
        "rollout_s": round(rollout_s, 2),
        "total_s": round(time.perf_counter() - t0, 2),
    }
    say("")
    say("SUMMARY " + json.dumps(summary))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    how = p.add_mutually_exclusive_group()
    how.add_argument("--scripted", action="store_true", help="a scripted engine that calls the tools")
    how.add_argument("--random", action="store_true", help="the tiny model with random weights (no tool model)")
    p.add_argument(
        "--group-size", "--samples", type=int, default=4, dest="group_size", help="trajectories per question (a group)"
    )
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="per model turn (default 48; random 32; scripted 128)"
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # random models write anything
    raise SystemExit(asyncio.run(main(parse_args())))
