"""Multi-turn overlap: agent trajectories with tool calls, the SDK's agent loop against a turn-synchronous loop.

What is measured
----------------
``N`` trajectories (GRPO groups: ``N / group`` prompts x ``group`` samples), each ``K`` model turns: turns
1..K-1 each call one tool, ``lookup``, that sleeps ``T`` seconds, and turn K answers.  Wall time of:

a. **agent loop** -- the SDK's ``rollout_group`` + ``ToolAgent``: every trajectory is its own coroutine,
   so one trajectory's tool call overlaps other trajectories' generation.
b. **turn-synchronous** -- generate turn k for the whole batch, wait for all; run all tool calls, wait for
   all; then turn k+1.  Implemented with the *same* client, servers, ``ToolAgent`` code and tools: the
   agent is wrapped so that its context's ``generate`` passes an ``asyncio.Barrier`` over all ``N``
   trajectories before the turn (everyone's tools are done) and after it (everyone's turn is generated).
   Only the synchronisation differs.

The tool latency ``T`` is swept as a multiple of **W**, the time the engines need to generate one turn of
the whole batch under the cost model (below): the generation phase of one turn of (b).

The engine and its cost model
-----------------------------
``D`` fake-engine servers, each a separate process (this script re-executed with ``--child-serve``: the
``serve`` CLI cannot take a responder) running ``FakeEngine`` in *batched* mode with a responder that
scripts the turns, as tests/test_agents.py does, with the real tokenizer (``rollout_sdk.models.
load_tokenizer()``, Qwen2.5 token space and chat template; ``ROLLOUT_SDK_HOME`` picks where the tiny model
is built, e.g. ``/tmp/rsdk-home``).  The responder counts the assistant turns in the prompt and returns
that turn's tokens: every model turn is exactly ``G`` tokens (filler, then a Hermes ``<tool_call>`` or the
answer, then ``<|im_end|>``, the EOS).  Each engine step decodes one token for each running request (at
most ``max_batch``; the rest wait FIFO) and takes ``step_s = step_base_s + step_per_seq_s * batch``.
Defaults: ``step_base_s = 2 ms``, ``step_per_seq_s = 0.02 ms``, ``max_batch = 32``, ``D = 2``, ``N = 256``,
``K = 4``, ``G = 48``.  So a batch of 256 requests needs 256 / (2 x 32) = 4 waves, a request's turn takes
``g = G x step(32)`` and one turn of the batch ``W = 4 g`` (about 0.6 s).

Timers (uvloop's ``asyncio.sleep``) have millisecond resolution, so the executed step time is
*calibrated* (per batch size, on one server) and a discrete-event simulation of the cost model with those
step times gives each case's "model" time: no client CPU, no transport.  The gap between measured and
model is the client's own work (chat-template rendering, parsing, tokenising: reported as client CPU).

What to expect from the cost model
----------------------------------
Turn-synchronous: ``K W + (K-1) T``.  The agent loop can do no better than
``max(K W, K g + (K-1) T)``: the engines must still do all the decoding (``K W``), and one trajectory
still has to go through its own turns and tools.  Both parts are inside the turn-synchronous time, so
**the ratio can never be below 0.5** with fixed tool latency and fixed turn lengths; it is best
(``K W / (K W + (K-1) T)``, 4/7 = 0.57 for K=4) when ``(K-1) T`` is about ``K W - K g``, i.e. ``T ~ W``
with many waves, and it tends to 1 when tools are much shorter (nothing to hide) or much longer (the tools
are the critical path) than a turn, or when the engines are not saturated (``N <= D x max_batch``: every
trajectory's turns already run together).  With N=256 (4 waves) the model gives 0.68 at ``T = W``.
Variance is what makes the turn-synchronous loop pay more: it waits for the slowest tool at every
barrier (a sum of maxima, against the agent loop's maximum of sums); the ``tools lognormal`` row shows it.

Two effects beyond the cost model show up in the measurement and are reported:

* the client's own work per turn (chat-template rendering of the tool results, parsing, tokenising;
  ~0.6-0.9 ms of client CPU per trajectory-turn here) is on the critical path between the phases of the
  turn-synchronous loop (~0.15 s per phase for 256 trajectories), but overlaps the engines in the agent
  loop, so measured ratios come out a little below the model's;
* with the client's *default* session affinity, a whole batch of turns arriving at once moves sessions
  between servers on transient in-flight counts (``affinity_slack=8``), and the per-server session counts
  drift apart turn after turn; the turn-synchronous loop then has a server with more than its share (an
  extra partial wave per turn).  The main rows use sticky sessions (``affinity_slack=2**30``) for both
  loops, so that only the overlap is compared; one row uses the default.

Run::

    ROLLOUT_SDK_HOME=/tmp/rsdk-home python bench/multiturn.py            # full, ~2 minutes
    ROLLOUT_SDK_HOME=/tmp/rsdk-home python bench/multiturn.py --quick    # N=128, 3 rows, ~25 s
    python bench/multiturn.py --tool-multiples 0.25 0.5 1 2 4 --repeats 1
    python bench/multiturn.py --wait-quiet 120   # on a shared machine: runs wait for / repeat on quiet

Numbers go to ``--json`` (default ``bench/results/multiturn.json``); the table is printed last.
Every process this script starts is stopped at the end, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import heapq
import itertools
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harness
from harness import ServerProcs, interpolate, log
from harness.stats import StepFn
from workloads import tool_agent  # bench/workloads/: the scripted tool-calling agent

if TYPE_CHECKING:
    from rollout_sdk import RolloutClient
    from rollout_sdk.agents import Agent, RolloutContext, Trajectory
    from rollout_sdk.protocol import GenerateResult

TARGET_RATIO = 0.5


# -- results -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row: ``n`` trajectories, tool latency ``tool_multiple`` x W, lognormal jitter ``sigma`` (0: fixed),
    and the client's session affinity: ``sticky`` (a session never leaves its server) or ``default``."""

    n: int
    tool_multiple: float
    sigma: float = 0.0
    affinity: str = "sticky"

    @property
    def label(self) -> str:
        jitter = f", tools lognormal s={self.sigma:g}" if self.sigma else ""
        affinity = ", default affinity" if self.affinity == "default" else ""
        return f"N={self.n}, T={self.tool_multiple:g}W{jitter}{affinity}"


@dataclass
class Cell:
    case: Case
    tool_s: float
    waves: int
    turn_gen_s: float  # W (model)
    request_turn_s: float  # g (model)
    agent_s: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    agent_cpu_s: list[float] = field(default_factory=list)
    sync_cpu_s: list[float] = field(default_factory=list)
    #: requests each server completed in the last run of each mode (sessions drifting apart show here)
    agent_requests_per_server: list[int] = field(default_factory=list)
    sync_requests_per_server: list[int] = field(default_factory=list)
    #: turn-synchronous phases of the last repeat: generation phases, tool(+client) phases, seconds
    sync_gen_phases_s: list[float] = field(default_factory=list)
    sync_tool_phases_s: list[float] = field(default_factory=list)
    model_agent_s: float | None = None
    model_sync_s: float | None = None
    #: CPU of other processes on the machine during each run, % of one core
    foreign_cpu_pct: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.mean(self.agent_s) / statistics.mean(self.sync_s)


@dataclass
class Report:
    meta: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    cells: list[Cell] = field(default_factory=list)


# -- the server child ------------------------------------------------------------------------------------


def child_serve(spec_path: str, server_id: str) -> int:
    """``--child-serve``: one EngineServer around a scripted FakeEngine, until SIGTERM (like ``serve``)."""
    from rollout_sdk.launch.cli import run_async

    spec = json.loads(Path(spec_path).read_text())
    return int(run_async(_child_main(spec, server_id)))


async def _child_main(spec: dict[str, Any], server_id: str) -> int:
    from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig
    from rollout_sdk.server import EngineServer, ServerConfig

    respond = tool_agent.responder(spec["outputs"], spec["assistant_marker"])
    config = FakeEngineConfig(
        eos_token_ids=(tool_agent.IM_END,),
        step_base_s=spec["step_base_s"],
        step_per_seq_s=spec["step_per_seq_s"],
        max_batch=spec["max_batch"],
    )
    server = EngineServer(FakeEngine(config, responder=respond), ServerConfig(server_id=server_id))
    await harness.serve(server, stop_signals=(signal.SIGTERM, signal.SIGINT))
    return 0


def child_server(procs: ServerProcs, spec: Path, server_id: str) -> str:
    """Start this script as a server (``--child-serve``, the scripted fake engine); its address."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child-serve", str(spec), "--server-id", server_id]
    return procs.spawn(server_id, argv)[1]


# -- the turn-synchronous loop ----------------------------------------------------------------------------


def make_turn_sync(inner: Agent, barrier: asyncio.Barrier, phases: list[float]) -> Agent:
    """``inner`` with every model turn between two barriers over the whole batch."""
    from rollout_sdk.agents import Agent, RolloutContext

    class BarrierContext(RolloutContext):
        async def generate(self, *args: Any, **kwargs: Any) -> GenerateResult:
            """RolloutContext.generate between two barriers (its arguments passed through as they come)."""
            if await barrier.wait() == 0:  # everyone's tools are done: the generation phase starts
                phases.append(time.perf_counter())
            result = await super().generate(*args, **kwargs)
            if await barrier.wait() == 0:  # everyone's turn is generated: the tool phase starts
                phases.append(time.perf_counter())
            return result

    class TurnSync(Agent):
        async def run(self, ctx: RolloutContext, sample: Any) -> Trajectory:
            wrapped = BarrierContext(ctx.generator, session_id=ctx.session_id, member=ctx.member, timeout=ctx.timeout)
            try:
                return await inner.run(wrapped, sample)
            except BaseException:
                await barrier.abort()  # never leave the others waiting
                raise

    return TurnSync()


# -- the cost model, simulated -----------------------------------------------------------------------------


def simulate(n: int, turns: int, g: int, tool_s: float, d: int, step: StepFn, max_batch: int, sync: bool) -> float:
    """Wall time of ``n`` trajectories under the cost model (trajectory i on server i % d, FIFO engines).

    A request arriving while its server sleeps through a step joins at the next step; an idle server
    starts at once.  ``sync``: turn k+1 starts for everyone ``tool_s`` after the last turn k finished.
    """
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, kind 0=arrive 1=step end, server or traj)
    seq = 0

    def push(t: float, kind: int, who: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, who))

    waiting: list[collections.deque[int]] = [collections.deque() for _ in range(d)]
    running: list[list[list[int]]] = [[] for _ in range(d)]  # [trajectory, tokens left]
    busy = [False] * d
    turn = [0] * n
    finished_turn = [0] * turns
    end = 0.0

    def start_step(s: int, now: float) -> None:
        while len(running[s]) < max_batch and waiting[s]:
            running[s].append([waiting[s].popleft(), g])
        busy[s] = bool(running[s])
        if busy[s]:
            push(now + step(len(running[s])), 1, s)

    for i in range(n):
        push(0.0, 0, i)
    while heap:
        now, _, kind, who = heapq.heappop(heap)
        if kind == 0:
            s = who % d
            waiting[s].append(who)
            if not busy[s]:
                start_step(s, now)
            continue
        s = who
        left: list[list[int]] = []
        for r in running[s]:
            r[1] -= 1
            if r[1]:
                left.append(r)
                continue
            i = r[0]
            k = turn[i]
            turn[i] += 1
            end = max(end, now)
            if k + 1 >= turns:
                continue
            if not sync:
                push(now + tool_s, 0, i)
            else:
                finished_turn[k] += 1
                if finished_turn[k] == n:
                    for j in range(n):
                        push(now + tool_s, 0, j)
        running[s] = left
        start_step(s, now)
    return end


# -- measurement -------------------------------------------------------------------------------------------


async def calibrate(client: RolloutClient, tokens: int, sizes: Sequence[int]) -> dict[int, float]:
    """Executed step time for b requests: (wall(tokens) - wall(8)) / (tokens - 8) on one server."""
    from rollout_sdk import SamplingParams

    async def wall(b: int, n: int) -> float:
        sp = SamplingParams(max_new_tokens=n)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.generate([1, 2, 3 + i], sampling=sp) for i in range(b)))
        return time.perf_counter() - t0

    await wall(2, 4)
    out: dict[int, float] = {}
    for b in sizes:
        out[b] = (await wall(b, tokens) - await wall(b, 8)) / (tokens - 8)
    return out


async def run_all(args: argparse.Namespace, report: Report, procs: ServerProcs, workdir: Path) -> None:
    from rollout_sdk import RolloutClient
    from rollout_sdk.agents import AgentConfig, ToolAgent
    from rollout_sdk.models import load_tokenizer

    log("loading the tokenizer")
    tok = await asyncio.to_thread(load_tokenizer)
    marker = tok.encode("<|im_start|>assistant", add_special_tokens=False)
    assert len(marker) == 2 and marker[0] == tool_agent.IM_START, marker
    outputs = tool_agent.turn_outputs(tok, args.turns, args.tokens_per_turn)
    spec = workdir / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "outputs": outputs,
                "assistant_marker": marker,
                "step_base_s": args.step_base_s,
                "step_per_seq_s": args.step_per_seq_s,
                "max_batch": args.max_batch,
            }
        )
    )
    log(f"starting {args.servers} scripted fake servers")
    addrs = [await asyncio.to_thread(child_server, procs, spec, f"s{i}") for i in range(args.servers)]

    clock = tool_agent.ToolClock()
    registry = tool_agent.make_registry(clock)
    config = AgentConfig(
        max_turns=args.turns + 2,
        max_new_tokens=args.tokens_per_turn + 16,
        max_response_tokens=1 << 20,
        keep_messages=False,
    )
    agent = ToolAgent(tok, registry, config)
    async with RolloutClient(servers=[addrs[0]]) as one:
        log("calibrating the executed step time")
        cal = await calibrate(one, args.tokens_per_turn, sorted({1, args.max_batch // 2, args.max_batch}))
    report.calibration = {
        "step_s": cal,
        "nominal_step_s": {b: args.step_base_s + args.step_per_seq_s * b for b in cal},
    }
    log("  " + ", ".join(f"b={b}: {1e3 * s:.2f} ms" for b, s in cal.items()))
    step = interpolate(cal)

    async with contextlib.AsyncExitStack() as stack:
        clients = {
            # sticky: a session never moves (the affinity test always passes); default: ClientConfig's
            # affinity_margin / affinity_slack, which move a session when its server looks busier
            "sticky": await stack.enter_async_context(RolloutClient(servers=addrs, affinity_slack=1 << 30)),
            "default": await stack.enter_async_context(RolloutClient(servers=addrs)),
        }
        clock.set(0.001, 0.0, 0, 0)
        for c in clients.values():
            tool_agent.check(
                await tool_agent.run_agents(c, agent, tool_agent.questions(16, 4), 4), 16, args.turns
            )  # warm every path

        for case in args.cases:
            client = clients[case.affinity]
            n = case.n
            capacity = args.servers * args.max_batch
            waves = math.ceil(n / capacity)
            per_server = math.ceil(n / args.servers)
            g = args.tokens_per_turn * step(min(per_server, args.max_batch))
            w_gen = waves * g
            tool_s = case.tool_multiple * w_gen
            cell = Cell(case=case, tool_s=tool_s, waves=waves, turn_gen_s=w_gen, request_turn_s=g)
            if not case.sigma:
                sim = (n, args.turns, args.tokens_per_turn, tool_s, args.servers, step, args.max_batch)
                cell.model_agent_s = simulate(*sim, sync=False)
                cell.model_sync_s = simulate(*sim, sync=True)
            samples = tool_agent.questions(n, args.group)
            for rep in range(args.repeats):
                for mode in ("agent", "sync") if rep % 2 == 0 else ("sync", "agent"):

                    async def one_run(
                        mode: str = mode,
                        rep: int = rep,
                        tool_s: float = tool_s,
                        case: Case = case,
                        n: int = n,
                        client: Any = client,
                        samples: Any = samples,
                    ) -> tuple[Any, ...]:
                        clock.set(tool_s, case.sigma, n * (args.turns - 1), seed=rep)
                        phases: list[float] = []
                        runner = agent if mode == "agent" else make_turn_sync(agent, asyncio.Barrier(n), phases)
                        done0 = [s.completed for s in client.servers]
                        cpu0 = time.process_time()
                        t0 = time.perf_counter()
                        trajs = await tool_agent.run_agents(client, runner, samples, args.group)
                        wall = time.perf_counter() - t0
                        return phases, done0, t0, trajs, wall, time.process_time() - cpu0

                    got, foreign, _ = await harness.until_quiet(
                        one_run, wait_quiet_s=args.wait_quiet, retries=args.retries
                    )
                    phases, done0, t0, trajs, wall, cpu = got
                    if foreign is not None:
                        cell.foreign_cpu_pct.append(foreign)
                    tool_agent.check(trajs, n, args.turns)
                    per_server = [s.completed - d0 for s, d0 in zip(client.servers, done0, strict=True)]
                    if mode == "agent":
                        cell.agent_s.append(wall)
                        cell.agent_cpu_s.append(cpu)
                        cell.agent_requests_per_server = per_server
                    else:
                        cell.sync_s.append(wall)
                        cell.sync_cpu_s.append(cpu)
                        cell.sync_requests_per_server = per_server
                        marks = [t0, *phases[1:], t0 + wall]  # phases[0]: all lined up for turn 1 (= t0)
                        spans = [b - a for a, b in itertools.pairwise(marks)]
                        cell.sync_gen_phases_s = spans[0::2]
                        cell.sync_tool_phases_s = spans[1:-1:2]  # the last span: after the final turn
                    log(
                        f"{case.label:44s} T={1e3 * tool_s:6.0f} ms  {mode:5s} {wall:6.3f} s  client cpu {cpu:.2f} s"
                        f"  requests per server {per_server}"
                    )
            report.cells.append(cell)


# -- report --------------------------------------------------------------------------------------------------


def render(report: Report, args: argparse.Namespace) -> str:
    cal = report.calibration
    lines = [
        f"D={args.servers} servers x max_batch {args.max_batch}, K={args.turns} turns of G={args.tokens_per_turn} "
        "tokens; executed step (calibrated): "
        + ", ".join(f"b={b} {1e3 * s:.2f} ms" for b, s in cal["step_s"].items())
        + " (nominal "
        + ", ".join(f"{1e3 * s:.2f}" for s in cal["nominal_step_s"].values())
        + ")",
        "",
    ]
    hdr = (
        f"{'case':<44}{'W s':>6}{'T s':>7}{'agent loop s':>13}{'turn-sync s':>12}{'ratio':>7}"
        f"{'model: agent':>13}{'sync':>6}{'ratio':>6}{'sync gen/tool s':>17}{'req/server a|s':>18}{'cpu s a/s':>12}"
    )
    lines += [hdr, "-" * len(hdr)]
    for c in report.cells:
        m_agent = f"{c.model_agent_s:.2f}" if c.model_agent_s is not None else "-"
        m_sync = f"{c.model_sync_s:.2f}" if c.model_sync_s is not None else "-"
        m_ratio = f"{c.model_agent_s / c.model_sync_s:.2f}" if c.model_agent_s and c.model_sync_s else "-"
        phases = f"{sum(c.sync_gen_phases_s):.2f} / {sum(c.sync_tool_phases_s):.2f}"
        cpu = f"{statistics.mean(c.agent_cpu_s):.2f}/{statistics.mean(c.sync_cpu_s):.2f}"
        per_server = (
            "/".join(map(str, c.agent_requests_per_server)) + " | " + "/".join(map(str, c.sync_requests_per_server))
        )
        lines.append(
            f"{c.case.label:<44}{c.turn_gen_s:>6.3f}{c.tool_s:>7.3f}{statistics.mean(c.agent_s):>13.3f}"
            f"{statistics.mean(c.sync_s):>12.3f}{c.ratio:>7.2f}{m_agent:>13}{m_sync:>6}{m_ratio:>6}{phases:>17}"
            f"{per_server:>18}{cpu:>12}"
        )
    lines += [
        "",
        "W: the engines' time for one turn of the whole batch (cost model, calibrated steps); T: mean tool latency;",
        "ratio: agent loop / turn-synchronous (means over repeats); model: the cost-model simulation (no client",
        "work); sync gen/tool: turn-synchronous time in generation phases / in tool phases (tools + the client's",
        "work between turns); req/server: requests each server served in one run, agent loop | turn-synchronous;",
        "cpu: this process's CPU seconds per run, agent loop / turn-synchronous.  Sessions are sticky unless the",
        "row says 'default affinity' (ClientConfig's affinity_margin=0.5, affinity_slack=8).",
    ]
    foreign = [f for c in report.cells for f in c.foreign_cpu_pct]
    if foreign:
        lines.append(
            f"other processes on the machine used {statistics.mean(foreign):.0f}% of a core on average during the runs "
            f"(max {max(foreign):.0f}%)" + ("  << noisy: numbers may be distorted" if max(foreign) > 20 else "")
        )
    lines.append("")
    fixed = [c for c in report.cells if not c.case.sigma and c.case.n == args.trajectories]
    comparable = [c for c in fixed if c.case.tool_multiple == 1.0] or fixed
    for c in comparable:
        ok = c.ratio <= TARGET_RATIO
        model = f"{c.model_agent_s / c.model_sync_s:.2f}x" if c.model_agent_s and c.model_sync_s else "-"
        lines.append(
            f"target agent loop <= {TARGET_RATIO} x turn-synchronous at T ~ W ({c.case.label}): {c.ratio:.2f}x -> "
            f"{'met' if ok else 'NOT met'} (cost model: {model})"
        )
    k = args.turns
    lines.append(
        f"with fixed tool latency and turn length the cost model never goes below 0.5x (the agent loop still needs "
        f"K W of decoding and (K-1) T of tools on each trajectory's path; turn-synchronous is their sum); its best, "
        f"K/(2K-1) = {k / (2 * k - 1):.2f}x, needs T ~ W and many waves"
    )
    return "\n".join(lines)


def _parse_case(text: str) -> Case:
    parts = text.split(":")
    if len(parts) not in (2, 3, 4) or (len(parts) == 4 and parts[3] not in ("sticky", "default")):
        raise argparse.ArgumentTypeError("a case is N:T_multiple[:sigma[:sticky|default]]")
    sigma = float(parts[2]) if len(parts) > 2 else 0.0
    return Case(int(parts[0]), float(parts[1]), sigma, parts[3] if len(parts) == 4 else "sticky")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.parser(
        __doc__, quick="N=128, one repeat, no extra cases (about 25 s)", json="multiturn", json_type=Path
    )
    p.add_argument("--trajectories", "-n", type=int, default=None, help="N (full 256, quick 128)")
    p.add_argument("--group", type=int, default=8, help="trajectories per prompt (rollout_group n)")
    p.add_argument("--turns", type=int, default=4, help="K model turns per trajectory (K-1 tool calls)")
    p.add_argument("--tokens-per-turn", type=int, default=48, help="G tokens per model turn")
    p.add_argument("--tool-multiples", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="T / W")
    p.add_argument(
        "--extra-cases",
        type=_parse_case,
        nargs="*",
        default=None,
        help="more rows, N:T_multiple[:sigma[:sticky|default]] (full: 256:1:0.5 jittered tools, 64:1 engines "
        "not saturated, 256:1:0:default the client's default session affinity)",
    )
    p.add_argument("--repeats", type=int, default=None, help="runs per mode and case (full 2, quick 1)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--step-base-s", type=float, default=0.002)
    p.add_argument("--step-per-seq-s", type=float, default=0.00002)
    p.add_argument("--max-batch", type=int, default=32)
    harness.add_quiet(p, "run")
    p.add_argument("--no-uvloop", action="store_true", help="run the client on the default asyncio loop")
    p.add_argument("--child-serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--server-id", default="s0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_serve:
        return args
    harness.by_mode(args, trajectories=(256, 128), repeats=(2, 1))
    if args.extra_cases is None:
        n = args.trajectories
        args.extra_cases = [] if args.quick else [Case(n, 1.0, 0.5), Case(64, 1.0), Case(n, 1.0, 0.0, "default")]
    if args.trajectories % args.group:
        p.error("--trajectories must be a multiple of --group")
    if args.turns < 2:
        p.error("--turns must be >= 2 (at least one tool call)")
    args.cases = [Case(args.trajectories, m) for m in args.tool_multiples] + list(args.extra_cases)
    for c in args.cases:
        if c.n % args.group:
            p.error(f"case {c.label}: N must be a multiple of --group")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_serve:
        return child_serve(args.child_serve, args.server_id)
    report = Report()
    report.meta = {
        **harness.facts((*harness.machine.DISTS, "transformers")),
        **harness.mode_facts(args),
        "wait_quiet_s": args.wait_quiet,
        "rollout_sdk_home": os.environ.get("ROLLOUT_SDK_HOME"),
        "cost_model": {
            "step_base_s": args.step_base_s,
            "step_per_seq_s": args.step_per_seq_s,
            "max_batch": args.max_batch,
            "servers": args.servers,
        },
        "workload": {
            "turns": args.turns,
            "tokens_per_turn": args.tokens_per_turn,
            "group": args.group,
            "repeats": args.repeats,
        },
        "target": f"agent loop <= {TARGET_RATIO} x turn-synchronous when T ~ a turn's generation time",
    }
    t0 = time.perf_counter()
    with ServerProcs.session("multiturn-bench-") as procs:
        harness.run(run_all(args, report, procs, procs.logdir), uvloop=not args.no_uvloop)
    report.meta["runtime_s"] = round(time.perf_counter() - t0, 1)
    cells = []
    for c in report.cells:
        d = asdict(c)
        d["case"] = {**asdict(c.case), "label": c.case.label}
        d["ratio"] = c.ratio
        d["model_ratio"] = c.model_agent_s / c.model_sync_s if c.model_agent_s and c.model_sync_s else None
        cells.append(d)
    payload = {"meta": report.meta, "calibration": report.calibration, "cells": cells}
    harness.publish(args.json, payload, render(report, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
