"""RL-shaped GPU benchmark: raw SGLang vs rollout-sdk vs SGLang's HTTP server, one engine start per shape.

    python bench/gpu_rl.py --shape 0.5b --reps 3 --http --profile short --json $OUT/rl-0.5b.json
    python bench/gpu_rl.py --shape 7b --reps 3 --http --json $OUT/rl-7b.json
    python bench/gpu_rl.py --engine fake --quick --http --profile short  # CPU dry run of every code path

Per shape (a Qwen2.5-shaped config with dummy weights) it starts, once each:

* **sdk / raw**: one ``SglangEngine`` behind an ``EngineServer`` in this process.  *raw* is
  ``sglang.Engine.async_generate`` + ``asyncio.gather`` on that very engine, in this process; *sdk* is a
  ``RolloutClient`` in **its own process** (``--client`` mode, driven over stdin/stdout) -> ZMQ -> the
  server -> the same engine.  The client runs with its defaults: admission from the engine's capacity.
* **http** (``--http``): ``python -m sglang.launch_server`` with the same engine arguments and the same
  KV pool (``max_total_tokens``), driven by aiohttp ``POST /generate`` with ``input_ids`` from the same
  client process (the path slime / AReaL-style trainers use).  It lives beside the in-process engine on
  the one GPU; only one of the two runs work at any time.

Workloads (token ids drawn from a fixed seed, the same in every mode; temperature 1, ``ignore_eos``,
logprobs on, every request submitted at once):

* ``grpo``: prompts x 8 samples, lognormal output lengths (median 300) capped at 2,048;
* ``short``: 8,192 requests x 64 prompt tokens x 16 new tokens;
* ``long``: fixed 512-token prompts and long fixed outputs;
* ``oversub``: 4x the engine's running-request limit at once (short prompts and outputs).

Each repetition runs every mode on every workload, the order of the modes rotating per repetition;
medians and min-max of output tokens/s and of the per-repetition ratios are printed last.
``--profile short long`` adds one cProfile'd pass of each per mode of this process's event loop (where
SGLang's tokenizer manager and the SDK server share one thread) and writes the top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import harness  # noqa: E402  (bench/harness/)
from harness import log, write_json  # noqa: E402
from peers import http_server, shapes  # noqa: E402  (bench/peers/: SGLang's HTTP server, the model)
from peers.raw import raw_generate  # noqa: E402  (bench/peers/: raw SGLang in this process)
from workloads.fixed import make_workload, summarize  # noqa: E402  (bench/workloads/)

WORKLOADS = ("grpo", "short", "long", "oversub")
T0 = time.perf_counter()


# -- the client process (sdk and http modes) --------------------------------------------------------


async def client_main(a: argparse.Namespace) -> None:
    from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams

    pipe = await harness.Pipe.open()
    nofile = pipe.nofile
    session: Any = None
    if a.http_url:
        import aiohttp

        http_limit = max(64, min(a.http_connections, nofile - 256))
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=http_limit, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
        )
    from rollout_sdk import AdmissionConfig

    admission = AdmissionConfig(queue_fraction=a.queue_fraction) if a.queue_fraction is not None else None
    async with RolloutClient(servers=[a.client], connect_timeout_s=120, admission=admission) as client:
        pipe.reply({"ready": True, "nofile": nofile})
        async for cmd in pipe:
            work = make_workload(
                cmd["workload"], shape=a.shape, max_running=cmd["max_running"], vocab=cmd["vocab"], quick=a.quick
            )
            t0 = time.perf_counter()
            if cmd["mode"] == "sdk":
                res = await asyncio.gather(
                    *(
                        client.generate(
                            GenerateRequest(
                                input_ids=p,
                                sampling=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True),
                            )
                        )
                        for p, n in work
                    )
                )
                outs = [(len(r.output_ids), len(r.logprobs or [])) for r in res]
            else:

                async def one(p: list[int], n: int) -> tuple[int, int]:
                    out = await http_server.generate(session, a.http_url, p, n)
                    lps = out.get("meta_info", {}).get("output_token_logprobs") or []
                    return len(out.get("output_ids") or []), len(lps)

                outs = list(await asyncio.gather(*(one(p, n) for p, n in work)))
            dt = time.perf_counter() - t0
            row = summarize(outs, [n for _, n in work], dt, req_s=True)
            st = client.stats()
            row["client_in_flight_window"] = client.scheduler.window()
            row["retried"] = st.retried
            pipe.reply(row)
    if session is not None:
        await session.close()


# -- the server process (raw mode, the engine, the orchestration) ----------------------------------


def profile_top(prof: cProfile.Profile, n: int = 40) -> list[dict[str, Any]]:
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {"fn": f"{os.path.basename(file)}:{line}:{fn}", "file": file, "calls": nc, "tottime": tt, "cumtime": ct}
        )
    rows.sort(key=lambda r: -r["tottime"])
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows[:n]]


def profile_groups(prof: cProfile.Profile) -> dict[str, float]:
    """Own time by package: where the event loop thread's time went."""
    st = pstats.Stats(prof)
    groups: dict[str, float] = {}
    for (file, _, fn), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
        if "rollout_sdk" in file:
            key = "rollout_sdk/" + os.path.basename(file)
        elif "/sglang/" in file:
            key = "sglang/" + os.path.basename(file)
        elif "zmq" in file:
            key = "zmq"
        elif "msgspec" in file:
            key = "msgspec"
        elif file.startswith("~") or file == "":
            key = f"builtin:{fn}"[:60]
        elif "asyncio" in file or "uvloop" in file:
            key = "asyncio/" + os.path.basename(file)
        else:
            key = "other/" + os.path.basename(file)
        groups[key] = groups.get(key, 0.0) + tt
    return dict(sorted(((k, round(v, 4)) for k, v in groups.items()), key=lambda kv: -kv[1])[:40])


async def server_main(a: argparse.Namespace) -> dict[str, Any]:
    from rollout_sdk import EngineServer, ServerConfig

    res: dict[str, Any] = {
        "shape": a.shape,
        "engine": a.engine,
        "reps": a.reps,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "passes": [],
    }
    http_proc: Any = None
    http_url = ""
    fake_runner: Any = None
    max_total_tokens = a.max_total_tokens or (3_000_000 if a.shape != "7b" else 600_000)
    res["max_total_tokens"] = max_total_tokens
    if a.engine == "sglang":
        from rollout_sdk.engines.sglang import SglangEngine

        model = shapes.model_dir(a.shape)
        if a.http:  # first, so the in-process engine sizes itself from what the HTTP server left free
            t0 = time.perf_counter()
            log_path = os.path.join(a.log_dir, f"http-{a.shape}.log")
            http_proc, http_url = await http_server.start(model, a, max_total_tokens, log_path)
            res["http_start_s"] = round(time.perf_counter() - t0, 1)
            log(f"HTTP server ready in {res['http_start_s']}s at {http_url}")
        engine: Any = SglangEngine(
            shapes.dummy_engine_config(
                a,
                model,
                max_running_requests=a.max_running or None,
                request_path=a.request_path,
                extra={"max_total_tokens": max_total_tokens},
            )
        )
    else:
        from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig

        engine = FakeEngine(FakeEngineConfig(step_base_s=0.002, step_per_seq_s=2e-6, max_batch=a.fake_max_batch))
    server = EngineServer(engine, ServerConfig(server_id=f"rl-{a.shape}", drain_timeout_s=5))
    t0 = time.perf_counter()
    client: harness.ClientProc | None = None
    try:
        async with server:
            res["engine_start_s"] = round(time.perf_counter() - t0, 1)
            vocab = engine.limits.vocab_size
            max_running = a.fake_max_batch
            if a.engine == "sglang":
                snaps = await engine._tm.get_loads()
                max_running = int(snaps[0].max_running_requests)
                res["engine_max_total_tokens"] = int(snaps[0].max_total_num_tokens)
            else:
                fake_runner, http_url = (await http_server.fake_server(engine)) if a.http else (None, "")
            res["max_running"] = max_running
            log(f"engine ready in {res['engine_start_s']}s; max_running={max_running} vocab={vocab}")
            argv = [sys.executable, os.path.abspath(__file__), "--client", server.address, "--shape", a.shape]
            argv += ["--http-url", http_url] if http_url else []
            argv += ["--quick"] if a.quick else []
            argv += ["--queue-fraction", str(a.queue_fraction)] if a.queue_fraction is not None else []
            client = await harness.ClientProc(argv).started()
            res["client_nofile"] = client.hello.get("nofile")

            raw = raw_generate(engine, sglang=a.engine == "sglang")

            async def raw_pass(work: list[tuple[list[int], int]]) -> list[tuple[int, int]]:
                outs = await asyncio.gather(*(raw(p, n, None) for p, n in work))
                return [(len(o.output_ids), o.logprobs) for o in outs]

            modes = ["raw", "sdk"] + (["sdktm"] if a.sdk_tm else []) + (["http"] if http_url else [])
            direct = getattr(engine, "_path", None)
            res["request_path"] = "direct" if direct is not None else "tokenizer_manager"
            log(f"SDK request path: {res['request_path']}")
            works = {
                w: make_workload(w, shape=a.shape, max_running=max_running, vocab=vocab, quick=a.quick)
                for w in a.workloads
            }

            async def flush() -> None:
                """Every pass starts from an empty prefix cache (the modes share prompts)."""
                if a.engine != "sglang":
                    return
                await engine.flush_cache()
                if http_url:
                    await http_server.flush(http_url)

            async def one_pass(mode: str, w: str) -> dict[str, Any]:
                await flush()
                cpu0 = harness.cpu_times(http_proc)
                t = time.perf_counter()
                if mode == "raw":
                    outs = await raw_pass(works[w])
                    row = summarize(outs, [n for _, n in works[w]], time.perf_counter() - t, req_s=True)
                elif mode == "sdktm":  # the same SDK path with the engine's direct path detached for this pass
                    assert client is not None
                    engine._path = None
                    try:
                        row = await client.run(mode="sdk", workload=w, max_running=max_running, vocab=vocab)
                    finally:
                        engine._path = direct
                else:
                    assert client is not None
                    row = await client.run(mode=mode, workload=w, max_running=max_running, vocab=vocab)
                wall = time.perf_counter() - t
                cpu1 = harness.cpu_times(http_proc)
                # CPU seconds per wall second: this process's event loop thread (tokenizer manager + SDK
                # server), SGLang's scheduler processes, the HTTP server's process tree
                row["cpu"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 3) for k in cpu1}
                return row

            works["warm"] = make_workload("warm", shape=a.shape, max_running=max_running, vocab=vocab, quick=a.quick)
            for mode in modes:  # warm-up: every mode once on a small workload
                await one_pass(mode, "warm")
            log("warm-up done")

            def record(row: dict[str, Any]) -> None:
                res["passes"].append(row)
                shown = {k: v for k, v in row.items() if k in ("s", "tok_s", "ok", "error")}
                w, mode = row["workload"], row["mode"]
                log(f"rep {row['rep']} {w:8s} {mode:4s} {json.dumps(shown)} win={row.get('client_in_flight_window')}")
                if a.json:
                    write_json(a.json, res)

            stopped = await harness.run_plan(
                [(w, modes) for w in a.workloads],
                a.reps,
                lambda mode, w, rep: one_pass(mode, w),
                record,
                budget_s=a.budget_s,
                started=T0,
                margin=1.15,
            )
            if stopped:
                res["stopped_early"] = stopped
            res["profile"] = {}
            for w in a.profile:  # cProfile of this process's event loop thread, one extra pass per mode
                if w not in works:
                    continue
                w_s = max((p.get("s", 0) for p in res["passes"] if p["workload"] == w), default=0.0)
                left = a.budget_s - (time.perf_counter() - T0)
                if left < 2.5 * w_s + 5:
                    res["profile"][w] = f"skipped: {left:.0f}s of --budget-s left"
                    continue
                for mode in ("raw", "sdk"):
                    prof = cProfile.Profile()
                    prof.enable()
                    row = await one_pass(mode, w)
                    prof.disable()
                    res["profile"][f"{w}-{mode}"] = {
                        "pass": row,
                        "groups": profile_groups(prof),
                        "top": profile_top(prof),
                    }
                    log(f"profile {w} {mode}: {json.dumps(row)} groups {json.dumps(profile_groups(prof))[:1500]}")
                    if a.json:
                        write_json(a.json, res)
    finally:
        if client is not None:
            client.close()
        if fake_runner is not None:
            await fake_runner.cleanup()
        if http_proc is not None:
            harness.stop_group(http_proc)
    res["summary"] = summary(res)
    return res


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Per workload: per mode the span of tok/s over repetitions, the ratios per repetition, all ``ok``."""
    pairs = (("sdk", "raw"), ("http", "raw"), ("sdk", "http"), ("sdktm", "raw"), ("sdk", "sdktm"))
    return harness.plan_summary(
        res["passes"], lambda reps: harness.span([p["tok_s"] for p in reps.values()], None), pairs
    )


def table(res: dict[str, Any]) -> str:
    cell = harness.span_cell
    tm = any("sdktm" in row for row in res["summary"].values())
    header = ["workload", "raw tok/s", "sdk tok/s", "http tok/s", "sdk/raw", "sdk/http", "ok"]
    header += ["sdk(TM) tok/s", "sdk/sdk(TM)"] if tm else []
    rows = []
    for w, row in res["summary"].items():
        rows.append([w, *(cell(row.get(m)) for m in ("raw", "sdk", "http"))])
        rows[-1] += [cell(row.get("sdk/raw"), "{:.3f}"), cell(row.get("sdk/http"), "{:.2f}"), row["all_ok"]]
        rows[-1] += [cell(row.get("sdktm")), cell(row.get("sdk/sdktm"), "{:.3f}")] if tm else []
    title = (
        f"shape {res['shape']} ({res['engine']}), max_running={res.get('max_running')}, "
        f"KV tokens={res.get('engine_max_total_tokens', '-')}, reps={res['reps']}, {res['date']}"
    )
    return title + "\n" + harness.table(header, rows)


def main() -> None:
    ap = harness.parser(__doc__, reps=3)
    ap.add_argument("--shape", default="0.5b", choices=["0.5b", "7b"])
    ap.add_argument("--engine", default="sglang", choices=["sglang", "fake"])
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--http", action="store_true", help="also measure SGLang's HTTP server")
    ap.add_argument("--profile", nargs="*", default=[], choices=WORKLOADS, help="cProfile one extra pass of these")
    ap.add_argument("--quick", action="store_true", help="tiny workloads (dry runs)")
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--sampling", default="pytorch")
    ap.add_argument("--mem-fraction", type=float, default=0.7, help="of the memory free when the engine starts")
    ap.add_argument("--http-mem-fraction", type=float, default=0.4)
    ap.add_argument("--max-total-tokens", type=int, default=0, help="KV pool of both engines (0: per shape)")
    ap.add_argument("--graph-bs", type=int, default=512)
    ap.add_argument(
        "--max-running", type=int, default=0, help="the engines' max_running_requests (0: SGLang's own choice)"
    )
    ap.add_argument("--http-connections", type=int, default=20000)
    ap.add_argument("--request-path", default="direct", choices=["direct", "tokenizer_manager"])
    ap.add_argument("--sdk-tm", action="store_true", help="also the SDK through SGLang's tokenizer manager (sdktm)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--queue-fraction", type=float, default=None, help="the SDK client's AdmissionConfig")
    ap.add_argument("--fake-max-batch", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop repeating when the next rep would not fit")
    ap.add_argument("--json", default=None)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--http-url", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    run = harness.loop_runner()
    if a.client:
        run(client_main(a))
        return
    with harness.sigterm_as_interrupt():  # SIGTERM (timeout) unwinds: the HTTP server is stopped
        res = run(server_main(a))
    if a.json:
        write_json(a.json, res)
    print(table(res), flush=True)


if __name__ == "__main__":
    main()
