"""Gateway overhead: OpenAI chat calls through ``rollout-sdk gateway`` against the same turns on ``RolloutClient``.

What is measured
----------------
``S`` sessions, ``C`` of them at a time, each ``K`` model turns of ``G`` tokens (an agent that re-sends its
whole history every turn, as black-box agents do).  Two ways of running the same turns against the same
engine server (a ``rollout-sdk serve --engine fake`` process in instant mode: it answers at once, so what
is measured is the software in front of it):

a. **direct** -- ``RolloutClient.generate`` in this process, token ids in and out; between turns the
   context grows by the output plus a fixed 12-token glue, as a token-level agent loop's would.
b. **gateway** -- a ``rollout-sdk gateway --servers <engine>`` process; this process sends OpenAI
   ``/v1/chat/completions`` requests with aiohttp (one connection pool, one session key per session).
   Per request the gateway parses JSON, checks fields, normalises and hashes the messages, matches the
   session, renders only the new messages with the chat template, tokenizes them on its tokenizer thread,
   calls its ``RolloutClient``, decodes the output, and records the turn.

Cells alternate (direct, gateway, direct, ...) ``--reps`` times; the table shows medians.  "added ms" is
the gateway's median latency minus the direct median at the same concurrency.  Both load generators run
on the same 2 cores as the servers, so absolute rates are this machine's.

    python bench/gateway.py                 # C = 1, 64, 500 (S = max(C, 200)), K = 3, G = 16, 3 reps
    python bench/gateway.py --quick
    python bench/gateway.py --api responses      # the same turns through /v1/responses (or --api messages)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import pct

ROOT = Path(__file__).resolve().parent.parent


async def run_direct(address: str, sessions: int, conc: int, turns: int, gen: int) -> dict[str, float]:
    from rollout_sdk import RolloutClient, SamplingParams

    lat: list[float] = []
    sem = asyncio.Semaphore(conc)
    sp = SamplingParams(max_new_tokens=gen)
    async with RolloutClient(servers=[address]) as client:

        async def one(i: int) -> None:
            async with sem:
                ids = [151644, 8948, 198, *range(1000 + i % 50, 1030 + i % 50), 151645, 198, 151644, 77091, 198]
                for _ in range(turns):
                    t = time.perf_counter()
                    r = await client.generate(ids, sampling=sp, session_id=f"s{i}")
                    lat.append(time.perf_counter() - t)
                    ids = (
                        ids
                        + r.output_ids
                        + [151645, 198, 151644, 872, 198, 1000, 1001, 151645, 198, 151644, 77091, 198]
                    )

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        wall = time.perf_counter() - t0
    return {"rps": len(lat) / wall, "p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3}


def _call(api: str, history: list[dict[str, Any]], gen: int) -> tuple[str, dict[str, Any]]:
    """The path and body of one call of ``api`` carrying ``history`` (what that API's client sends)."""
    if api == "responses":
        return "responses", {"model": "policy", "input": history, "max_output_tokens": gen}
    return ("messages" if api == "messages" else "chat/completions"), {
        "model": "policy",
        "messages": history,
        "max_tokens": gen,
    }


def _reply(api: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply as that API's client re-sends it with the next call."""
    if api == "responses":
        return list(data["output"])
    if api == "messages":
        return [{"role": "assistant", "content": data["content"]}]
    return [data["choices"][0]["message"]]


async def run_gateway(
    url: str, sessions: int, conc: int, turns: int, gen: int, rep: int, api: str = "chat"
) -> dict[str, float]:
    import aiohttp

    lat: list[float] = []
    sem = asyncio.Semaphore(conc)
    connector = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(i: int) -> None:
            async with sem:
                key = f"bench-{rep}-{conc}-{i}"
                msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Question number {i}: what is 2+2?"}]
                for k in range(turns):
                    path, body = _call(api, msgs, gen)
                    t = time.perf_counter()
                    async with http.post(f"{url}/{path}", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                        data = await r.json()
                        if r.status != 200:
                            raise RuntimeError(f"gateway answered {r.status}: {data}")
                    lat.append(time.perf_counter() - t)
                    msgs = [*msgs, *_reply(api, data), {"role": "user", "content": f"and then {k}?"}]
                async with http.post(f"{url}/sessions/{key}/finish") as r:
                    assert r.status == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        wall = time.perf_counter() - t0
    return {"rps": len(lat) / wall, "p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3}


async def main(args: argparse.Namespace) -> None:
    py = sys.executable
    with harness.ServerProcs.session("bench-gateway-", keep_logs=True) as procs:
        logdir = procs.logdir
        _, engine = procs.spawn("engine", harness.fake_server_argv())
        gw_argv = [py, "-m", "rollout_sdk", "gateway", "--servers", engine, "--model-name", "policy"]
        # this benchmark does not collect trajectories: let the gateway write them, so sessions are freed
        gw_argv += ["--trajectories-jsonl", str(logdir / "trajectories.jsonl")]
        _, url = procs.spawn("gateway", gw_argv, timeout=180)
        harness.log(f"engine {engine}, gateway {url}, logs in {logdir}")
        rows = []
        for conc in args.concurrency:
            sessions = max(conc, args.sessions)

            async def direct(rep: int, conc: int = conc, sessions: int = sessions) -> dict[str, float]:
                return await run_direct(engine, sessions, conc, args.turns, args.gen)

            async def gateway(rep: int, conc: int = conc, sessions: int = sessions) -> dict[str, float]:
                cell = await run_gateway(url, sessions, conc, args.turns, args.gen, rep, args.api)
                harness.log(f"C={conc} rep {rep}: gateway {cell}")
                return cell

            cells = await harness.alternate(args.reps, {"direct": direct, "gateway": gateway})
            d, g = (harness.medians(cells[m], ("rps", "p50", "p99")) for m in ("direct", "gateway"))
            rows.append(
                [
                    conc,
                    sessions,
                    f"{d['rps']:.0f}",
                    f"{g['rps']:.0f}",
                    f"{g['rps'] / d['rps']:.2f}",
                    f"{d['p50']:.2f}",
                    f"{g['p50']:.2f}",
                    f"{g['p50'] - d['p50']:.2f}",
                    f"{g['p99']:.1f}",
                ]
            )
        print(
            f"\nsessions x {args.turns} turns x {args.gen} tokens, {args.api} API, fake instant engine, medians of "
            f"{args.reps} reps (alternating)\n"
        )
        header = ["concurrent sessions", "sessions", "direct req/s", "gateway req/s", "gateway/direct"]
        header += ["direct p50 ms", "gateway p50 ms", "added p50 ms", "gateway p99 ms"]
        print(harness.markdown(header, rows, numeric=range(len(header))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, reps=3, quick="C = 1, 32; 40 sessions; 1 rep")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 500])
    p.add_argument("--sessions", type=int, default=200, help="sessions per cell (at least the concurrency)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument(
        "--api",
        choices=["chat", "responses", "messages"],
        default="chat",
        help="the API the agents call: chat completions, the Responses API, Anthropic's Messages API",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.sessions, args.reps = [1, 32], 40, 1
    return args


if __name__ == "__main__":
    harness.run(main(parse_args()), uvloop=False)
