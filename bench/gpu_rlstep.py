"""An RL step as users run it, on one engine start: raw SGLang (naive and at its best), SGLang's HTTP
server, and rollout-sdk, alternating, with prefill accounting (issue 39).

    python bench/gpu_rlstep.py --shape 0.5b --plan grpo2048x8:raw,sdk,sdkoff long:raw,rawcap,http,sdk \\
        short:raw,http,sdk grpo:raw,sdk --http --json $OUT/rlstep-0.5b.json
    python bench/gpu_rlstep.py --shape 7b --plan grpo4096x8:raw,sdk grpo:raw,sdk --json $OUT/rlstep-7b.json
    python bench/gpu_rlstep.py --shape 0.5b --engines 2 --plan grpo2048x8:raw,sdk --json $OUT/rlstep-2e.json
    python bench/gpu_rlstep.py --engine fake --quick        # CPU dry run of every path (fake engine)
    python bench/gpu_rlstep.py --engine standin --quick     # CPU: SGLang's tokenizer manager, stand-in scheduler

Sides (every request submitted at once unless said; temperature 1, ``ignore_eos``, logprobs on):

* ``raw``: ``sglang.Engine.async_generate`` + ``asyncio.gather`` in this process, on the very engine the SDK
  serves: a user's naive call (with two engines: requests dealt round-robin);
* ``rawcap``: the same, at most ``cuda_graph_max_bs`` requests in flight (a semaphore): raw at its best
  setting for long decodes;
* ``http``: ``python -m sglang.launch_server`` with the same arguments and KV pool, driven with aiohttp
  ``POST /generate`` from the client process (the slime / AReaL path);
* ``sdk``: a ``RolloutClient`` in its own process -> ZMQ -> EngineServer -> the engine, with the SDK's
  defaults (group members tagged with their ``group_id``: placed together, the prompt prefilled once;
  the decode window at the CUDA-graph batch);
* ``sdkoff``: the same client with both levers switched off on the engine for the pass;
* ``sdkpin`` (``agent``): the SDK keeping each session's KV through its tool waits (``keep_kv_s`` and
  wait hints) without session admission; ``sdk`` adds admission (``--session-admission``, a fraction of the
  KV pool), ``sdkoff`` neither;
* ``sdkflat`` (``--serve N``): the same requests without their ``group_id``: each sample placed on its own
  (least load), as before issue 39.

``--serve N`` runs N engines as ``python -m rollout_sdk serve --engine sglang`` processes on the one GPU (as
users deploy them; SGLang supports one engine per process) instead of one in this process: only the
``sdk`` and ``sdkflat`` sides run there, and a group's prefill pass is inferred from its members' results
(a server whose members took the prompt from the cache prefilled it once).

Workloads (bench/workloads/, a module each; deterministic from name, shape and pass; prompts are fresh
random ids in every pass, so no pass is served from another's prefix cache and no flush is needed: "fresh"
cache state; ``--cache flush`` flushes before every pass instead):

* ``grpoPxG`` (e.g. ``grpo2048x8``, ``grpo8192x16``): 64 prompts of P tokens x G samples, lognormal output
  lengths (median 300, capped at 2,048: the long tail of GRPO); ``grpoPxGfN``: N output tokens each;
* ``grpo``: 64 prompts of 128-512 tokens x 8, the same lengths (the pass measured since issue 20);
* ``long``: 1,024 x 512 prompt / 512 new tokens (0.5B; 256 x 512 / 1,024 at 7B);
* ``short``: 8,192 (0.5B) or 4,096 (7B) x 64 / 16;
* ``agent``: 256 sessions x 4 turns at once, a 2,048-token first prompt growing by each turn's 128
  output tokens and a 64-token tool result, tool waits uniform in 1-10 s (``--quick``: 10-100 ms);
* ``update``: ``grpo2048x8`` with a weight-version change half way (pause-retract, version bump, resume:
  the SDK's exact update path without the copy; raw: SGLang's ``pause_generation(retract)`` /
  ``continue_generation``).

Per pass: wall, output tokens/s, **prefill tokens computed** (prompt minus ``cached_tokens`` per
request, plus the SDK's prefill-only passes) against the ideal (each distinct prompt once), the
HTTP server's scheduler counter (``sglang:realtime_tokens_total{mode="prefill_compute"}``, with
``--metrics``) as a cross-check of that accounting, and requests / output tokens per engine.  Medians and min-max over
the repetitions, and per-repetition ratios, are printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import harness  # noqa: E402  (bench/harness/: the client process's pipe, the rotation, the tables)
from peers import http_server, shapes  # noqa: E402  (bench/peers/: SGLang's HTTP server, the model)
from peers.raw import RawGenerate, raw_generate  # noqa: E402  (bench/peers/: raw SGLang in this process)
from workloads import Out, Work, inferred_group_prefills, load_cv, make_work, summarize  # noqa: E402
from workloads.agent import run_agent  # noqa: E402
from workloads.update import mid_update  # noqa: E402

T0 = time.perf_counter()
MODES = ("raw", "rawcap", "http", "sdk", "sdkoff", "sdkflat", "sdkpin")


def log(msg: str) -> None:
    print(f"[rlstep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the client process (sdk, sdkoff and http sides) ----------------------------------------------------


async def client_main(a: argparse.Namespace) -> None:
    from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
    from rollout_sdk.protocol import SessionHint

    pipe = await harness.Pipe.open()
    session: Any = None
    if a.http_url:
        import aiohttp

        session = aiohttp.ClientSession(
            # uvicorn closes a connection idle for 5 s: an agent's tool wait is longer, so never reuse one that
            # old (a reused closed connection is ServerDisconnectedError)
            connector=aiohttp.TCPConnector(limit=20000, keepalive_timeout=2.0),
            timeout=aiohttp.ClientTimeout(total=None),
        )
    servers = a.client.split(",")
    async with RolloutClient(servers=servers, connect_timeout_s=300) as client:
        pipe.reply({"ready": True})
        async for cmd in pipe:
            work = make_work(
                cmd["workload"],
                shape=a.shape,
                quick=a.quick,
                vocab=cmd["vocab"],
                salt=cmd["salt"],
                shape_salt=cmd.get("shape_salt"),
            )
            http = cmd["mode"] == "http"
            flat = cmd["mode"] == "sdkflat"
            keep = cmd["mode"] in ("sdk", "sdkpin") and a.keep_kv_s > 0

            async def gen(
                prompt: list[int],
                n: int,
                group: str | None,
                sid: str | None,
                http: bool = http,
                flat: bool = flat,
                keep: bool = keep,
            ) -> Out:
                if http:
                    out = await http_server.generate(session, a.http_url, prompt, n)
                    meta = out.get("meta_info", {})
                    return (
                        len(out.get("output_ids") or []),
                        int(meta.get("prompt_tokens") or len(prompt)),
                        int(meta.get("cached_tokens") or 0),
                        "http",
                        list(out.get("output_ids") or []),
                    )
                r = await client.generate(
                    GenerateRequest(
                        input_ids=prompt,
                        group_id=None if flat else group,
                        session_id=sid,
                        keep_kv_s=a.keep_kv_s if keep and sid else None,
                        sampling=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True),
                    )
                )
                return len(r.output_ids), r.prompt_tokens, r.cached_tokens, r.server_id, list(r.output_ids)

            async def hint(sid: str, wait_s: float | None, ended: bool, keep: bool = keep) -> None:
                if keep:
                    await client.session_hints([SessionHint(session_id=sid, wait_s=wait_s, ended=ended)])

            t0 = time.perf_counter()
            turn_s: list[float] = []
            try:
                if work.sessions:
                    outs = await run_agent(work, gen, turn_s, cmd["vocab"], hint if a.hints else None)
                else:
                    outs = list(
                        await asyncio.gather(*(gen(it.prompt, it.max_new, it.group, None) for it in work.items))
                    )
            except Exception as exc:  # one side's failure must not lose the others' passes
                pipe.reply({"error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            row = summarize(work, outs, time.perf_counter() - t0, turn_s)
            if a.serve and not work.sessions:
                row["prefill_results"] = row["prefill"]
                row["prefill"] += inferred_group_prefills(work, outs)
                groups_split: dict[str, set[str]] = {}
                for it, o in zip(work.items, outs, strict=True):
                    if it.group:
                        groups_split.setdefault(it.group, set()).add(o[3])
                row["groups_split"] = sum(len(v) > 1 for v in groups_split.values())
            row["client_window"] = client.scheduler.window()
            pipe.reply(row)
    if session is not None:
        await session.close()


# -- the orchestrating process: engines, raw sides, the HTTP server ---------------------------------------


def kv_tokens(a: argparse.Namespace) -> int:
    """The KV pool in tokens, of all engines together (``--max-total-tokens``, else per shape)."""
    return a.max_total_tokens or (3_000_000 if a.shape != "7b" else 600_000)


def make_engines(a: argparse.Namespace, model: str) -> list[Any]:
    """``--engines`` engines in this process: SGLang on dummy weights (the KV pool split between them), the
    stand-in (SGLang's tokenizer manager over a stand-in scheduler), or the fake."""
    engines: list[Any] = []
    if a.engine == "sglang":
        from rollout_sdk.engines.sglang import SglangEngine

        per = kv_tokens(a) // a.engines
        for e in range(a.engines):
            mem = a.mem_fraction / (a.engines - e) if a.engines > 1 else a.mem_fraction
            extra = {"max_total_tokens": per, **json.loads(a.extra)}
            cfg = shapes.dummy_engine_config(
                a, model, mem_fraction_static=mem, session_admission=a.session_admission or None, extra=extra
            )
            engines.append(SglangEngine(cfg))
    elif a.engine == "standin":
        from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
        from rollout_sdk.engines.sglang.standin import StandinEngine, StandinScheduler

        for _ in range(a.engines):
            engines.append(  # noqa: PERF401
                SglangEngine(
                    SglangEngineConfig(
                        model_path=model,
                        freeze_gc=False,
                        decode_window=a.graph_bs,
                        session_admission=a.session_admission or None,
                    ),
                    launcher=StandinEngine.launcher(StandinScheduler(step_s=0.001, max_running=4096)),
                )
            )
    else:
        from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig

        for _ in range(a.engines):
            engines.append(  # noqa: PERF401
                FakeEngine(
                    FakeEngineConfig(
                        step_base_s=0.002,
                        step_per_seq_s=2e-6,
                        max_batch=a.graph_bs,
                        prefix_cache=True,
                        step_per_prefill_token_s=2e-7,
                        prefill_once_min_tokens=256,
                        kv_capacity_tokens=a.max_total_tokens or None,
                        session_admission=a.session_admission or None,
                    )
                )
            )
    return engines


async def raw_pass(
    a: argparse.Namespace, work: Work, engines: list[Any], raws: list[RawGenerate], *, cap: int | None
) -> dict[str, Any]:
    """``raw`` / ``rawcap``: every request submitted at once to SGLang in this process (``raws``: one raw call
    per engine), dealt round-robin as a naive user would (``cap``: at most that many in flight per engine)."""
    sem = asyncio.Semaphore(cap * len(raws)) if cap else None
    counter = iter(range(1 << 62))

    async def gen(prompt: list[int], n: int, group: str | None, sid: str | None) -> Out:
        i = next(counter) % len(raws)
        sid = sid if a.engine == "fake" else None  # the fake models SGLang's prefix cache of sessions: LRU for raw
        if sem is None:
            o = await raws[i](prompt, n, sid)
        else:
            async with sem:
                o = await raws[i](prompt, n, sid)
        return len(o.output_ids), o.prompt_tokens, o.cached_tokens, f"e{i}", o.output_ids

    t0 = time.perf_counter()
    turn_s: list[float] = []
    update = None
    if work.name == "update":
        raw_sglang = a.engine in ("sglang", "standin")
        update = asyncio.create_task(mid_update(engines, after_s=a.update_after_s, raw_sglang=raw_sglang))
    if work.sessions:
        outs = await run_agent(work, gen, turn_s, engines[0].limits.vocab_size)
    else:
        outs = list(await asyncio.gather(*(gen(it.prompt, it.max_new, it.group, None) for it in work.items)))
    row = summarize(work, outs, time.perf_counter() - t0, turn_s)
    if update is not None:
        row["update"] = await update
    return row


async def server_main(a: argparse.Namespace) -> dict[str, Any]:
    from rollout_sdk import EngineServer, ServerConfig

    plan = parse_plan(a.plan)
    res: dict[str, Any] = {
        "shape": a.shape,
        "engine": a.engine,
        "engines": a.engines,
        "cache": a.cache,
        "reps": a.reps,
        "plan": a.plan,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "passes": [],
    }
    if a.serve:
        return await fleet_main(a, plan, res)
    want_http = any("http" in modes for _, modes in plan)
    http_proc: Any = None
    http_url = ""
    fake_runner: Any = None
    model = ""
    if a.engine == "sglang":
        model = shapes.model_dir(a.shape)
        if want_http:  # first, so the in-process engines size themselves from what the HTTP server left free
            t0 = time.perf_counter()
            log_path = os.path.join(a.log_dir, f"rlstep-http-{a.shape}.log")
            extra = ["--enable-metrics"] if a.metrics else []
            http_proc, http_url = await http_server.start(model, a, kv_tokens(a), log_path, extra=extra)
            res["http_start_s"] = round(time.perf_counter() - t0, 1)
            log(f"HTTP server ready in {res['http_start_s']}s")
    elif a.engine == "standin":
        from rollout_sdk.models import ensure_tiny_model

        model = str(await asyncio.to_thread(ensure_tiny_model))
    engines = make_engines(a, model)
    servers = [EngineServer(eng, ServerConfig(server_id=f"e{i}", drain_timeout_s=5)) for i, eng in enumerate(engines)]
    client: harness.ClientProc | None = None
    stack = contextlib.AsyncExitStack()
    try:
        t0 = time.perf_counter()
        for s in servers:
            await stack.enter_async_context(s)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        vocab = engines[0].limits.vocab_size
        if a.engine in ("sglang", "standin"):
            window = engines[0].decode_window
            res["decode_window"] = window.size if window is not None else None
            snaps = await engines[0].tm.get_loads() if a.engine == "sglang" else []
            if snaps:
                res["engine_max_running"] = int(snaps[0].max_running_requests)
                res["engine_kv_tokens"] = int(snaps[0].max_total_num_tokens)
        else:
            fake_runner, http_url = (await http_server.fake_server(engines[0])) if want_http else (None, "")
        log(f"{len(engines)} engine(s) ready in {res['engine_start_s']}s: {json.dumps(res)[:400]}")

        raws = [raw_generate(eng, sglang=a.engine in ("sglang", "standin")) for eng in engines]
        argv = [sys.executable, os.path.abspath(__file__), "--client", ",".join(s.address for s in servers)]
        argv += ["--shape", a.shape] + (["--http-url", http_url] if http_url else []) + (["--quick"] if a.quick else [])
        client = await harness.ClientProc(argv).started()
        sides = Sides(a, engines)

        async def one_pass(mode: str, wname: str, rep: int) -> dict[str, Any]:
            salt = f"{rep}-{mode}"  # fresh prompts per pass, the same lengths for every side of a rep
            work = make_work(wname, shape=a.shape, quick=a.quick, vocab=vocab, salt=salt, shape_salt=str(rep))
            if a.cache == "flush" and a.engine != "fake":
                await sides.flush(http_url if a.engine == "sglang" else "")
            metrics = a.metrics and a.engine == "sglang" and mode == "http"  # SGLang's own server's counter
            counter0 = http_server.prefill_counter(http_url) if metrics else None
            fake0 = sum(getattr(e, "prefill_tokens", 0) for e in engines)
            once0 = sides.once_tokens()
            t = time.perf_counter()
            if mode in ("raw", "rawcap"):
                row = await raw_pass(a, work, engines, raws, cap=a.graph_bs if mode == "rawcap" else None)
            else:
                assert client is not None
                sides.admission(mode == "sdk")
                if mode == "sdkoff":
                    sides.levers(False)
                try:
                    update = None
                    if wname == "update":
                        update = asyncio.create_task(mid_update(engines, after_s=a.update_after_s))
                    row = await client.run(mode=mode, workload=wname, vocab=vocab, salt=salt, shape_salt=str(rep))
                    if "error" in row:
                        return row
                    if update is not None:
                        row["update"] = await update
                finally:
                    if mode == "sdkoff":
                        sides.levers(True)
                row["prefill"] += sides.once_tokens() - once0
            if a.engine == "fake":  # the fake counts what it computes itself, prefill-only passes included
                row["prefill_results"] = row["prefill"]
                row["prefill"] = sum(getattr(e, "prefill_tokens", 0) for e in engines) - fake0
            if counter0 is not None:
                c1 = http_server.prefill_counter(http_url)
                row["prefill_sched"] = None if c1 is None else round(c1 - counter0)
            row["wall_s"] = round(time.perf_counter() - t, 3)
            return with_load(row)

        stopped = await harness.run_plan(
            plan, a.reps, one_pass, lambda row: record(a, res, row), budget_s=a.budget_s, started=T0
        )
        if stopped:
            res["stopped_early"] = stopped
    finally:
        if client is not None:
            client.close()
        if fake_runner is not None:
            await fake_runner.cleanup()
        await stack.aclose()
        if http_proc is not None:
            harness.stop_group(http_proc)
    res["summary"] = summary(res)
    return res


class Sides:
    """What a side switches on the engines in this process between passes."""

    def __init__(self, a: argparse.Namespace, engines: list[Any]) -> None:
        self.fake = a.engine == "fake"
        self.engines = engines

    async def flush(self, http_url: str) -> None:
        """``--cache flush``: every engine's prefix cache (and the HTTP server's) emptied before a pass."""
        for eng in self.engines:
            await eng.flush_cache()
        if http_url:
            await http_server.flush(http_url)

    def admission(self, on: bool) -> None:
        """sdk: session admission at --session-admission; sdkpin and sdkoff: none (sessions' KV kept or not
        is the client's choice, keep_kv_s)."""
        for eng in self.engines:
            book = getattr(eng, "sessions", None)
            if book is not None:
                if not hasattr(eng, "_bench_budget"):
                    eng._bench_budget = book.budget_tokens
                book.budget_tokens = eng._bench_budget if on else None

    def levers(self, on: bool) -> None:
        """sdkoff: the decode window and prefill-once switched off on every engine for one pass (between
        passes only: nothing holds a place in the window then)."""
        names = ("prefill_once",) if self.fake else ("_window", "_prefill")
        for eng in self.engines:
            if on:
                for k, v in eng.__dict__.pop("_bench_saved", {}).items():
                    setattr(eng, k, v)
            else:
                eng._bench_saved = {k: getattr(eng, k) for k in names}
                for k in names:
                    setattr(eng, k, None)

    def once_tokens(self) -> int:
        """Prompt tokens the SDK's prefill-only passes computed so far (the fake counts every token itself)."""
        if self.fake:
            return 0
        return sum(getattr(e, "prefill_once_tokens", 0) for e in self.engines)


def with_load(row: dict[str, Any]) -> dict[str, Any]:
    """A side's row with its prefill against the ideal and its load spread over the engines."""
    if "prefill" in row:
        row["prefill_x"] = round(row["prefill"] / max(1, row["prefill_ideal"]), 3)
        row["load_cv_requests"] = load_cv(row["per_engine"], 0)
        row["load_cv_tokens"] = load_cv(row["per_engine"], 1)
    return row


_LOGGED = ("s", "tok_s", "prefill_x", "prefill_sched", "load_cv_requests", "load_cv_tokens", "groups_split",
           "turn_p50_s", "turn_p99_s", "reprefill_frac", "ok", "error")  # fmt: skip


def record(a: argparse.Namespace, res: dict[str, Any], row: dict[str, Any]) -> None:
    """A pass's row into the results (rewritten at once with ``--json``: a killed run keeps what it had) and
    the log."""
    res["passes"].append(row)
    shown = {k: row[k] for k in _LOGGED if k in row}
    log(f"rep {row['rep']} {row['workload']:12s} {row['mode']:6s} {json.dumps(shown)}")
    if a.json:
        harness.write_json(a.json, res)


async def fleet_main(a: argparse.Namespace, plan: list[tuple[str, list[str]]], res: dict[str, Any]) -> dict[str, Any]:
    """``--serve N``: N engine server processes on the one GPU, the SDK's sides only."""
    import gpu_fleet

    bad = [m for _, ms in plan for m in ms if m not in ("sdk", "sdkflat")]
    if bad:
        raise SystemExit(f"--serve runs the sdk and sdkflat sides only, not {sorted(set(bad))}")
    per = kv_tokens(a) // a.serve
    model = shapes.model_dir(a.shape) if a.engine == "sglang" else "fake"

    class Engines(gpu_fleet.Fleet):
        def engine_args(self) -> str:
            return json.dumps(
                {
                    "model_path": model,
                    "load_format": "dummy",
                    "attention_backend": a.attn,
                    "sampling_backend": a.sampling,
                    "mem_fraction_static": 0.9,  # of the memory free at start; the KV pool is capped in tokens
                    "enable_memory_saver": False,
                    "cuda_graph_max_bs": a.graph_bs,
                    "extra": {"disable_prefill_cuda_graph": True, "max_total_tokens": per},
                }
            )

    client: harness.ClientProc | None = None
    t0 = time.perf_counter()
    with Engines([a.serve], model, a.graph_bs, a.log_dir, a.engine) as fleet:
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        log(f"{a.serve} engine servers ready in {res['engine_start_s']}s: {fleet.addresses}")
        vocab = 151936
        argv = [sys.executable, os.path.abspath(__file__), "--client", ",".join(fleet.addresses.values())]
        argv += ["--shape", a.shape, "--serve", str(a.serve)] + (["--quick"] if a.quick else [])
        client = await harness.ClientProc(argv).started()

        async def one_pass(mode: str, wname: str, rep: int) -> dict[str, Any]:
            t = time.perf_counter()
            row = await client.run(mode=mode, workload=wname, vocab=vocab, salt=f"{rep}-{mode}", shape_salt=str(rep))
            row["wall_s"] = round(time.perf_counter() - t, 3)
            return with_load(row)

        try:
            stopped = await harness.run_plan(
                plan, a.reps, one_pass, lambda row: record(a, res, row), budget_s=a.budget_s, started=T0
            )
            if stopped:
                res["stopped_early"] = stopped
        finally:
            client.close()
    res["summary"] = summary(res)
    return res


# -- the plan and the summary ---------------------------------------------------------------------------


def parse_plan(items: list[str]) -> list[tuple[str, list[str]]]:
    plan = []
    for item in items:
        name, _, modes = item.partition(":")
        ms = modes.split(",") if modes else ["raw", "sdk"]
        bad = [m for m in ms if m not in MODES]
        if bad:
            raise SystemExit(f"--plan {item}: unknown side(s) {bad}; sides: {', '.join(MODES)}")
        plan.append((name, ms))
    return plan


_KEYS = ("s", "tok_s", "prefill_x", "prefill_sched", "load_cv_tokens", "turn_p50_s", "turn_p99_s", "reprefill_frac")


#: the ratios of tok/s the summary gives, where both sides ran
_RATIOS = [
    (n, d)
    for n in ("sdk", "sdkpin", "sdkoff", "http")
    for d in ("raw", "rawcap", "http", "sdkoff", "sdkflat", "sdkpin")
]


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Per workload: per side the span (median, min, max) over repetitions of each of _KEYS, the ratios of
    tok/s per repetition, whether every pass was ``ok``."""

    def spans(reps: dict[int, dict[str, Any]]) -> dict[str, Any]:
        out = {}
        for k in _KEYS:
            v = [p[k] for p in reps.values() if p.get(k) is not None]
            out[k] = harness.span(v) if v else None
        return out

    return harness.plan_summary(res["passes"], spans, _RATIOS)


def table(res: dict[str, Any]) -> str:
    cell = harness.span_cell
    lines = [
        f"shape {res['shape']} ({res['engine']} x{res['engines']}), cache {res['cache']}, decode window "
        f"{res.get('decode_window')}, engine max_running {res.get('engine_max_running', '-')}, reps {res['reps']}, "
        f"{res['date']}",
        f"{'workload':13s} {'side':7s} {'s':>20s} {'tok/s':>24s} {'prefill x ideal':>20s} {'sched':>12s} {'cv':>7s}",
    ]
    for w, row in res["summary"].items():
        for mode in MODES:
            m = row.get(mode)
            if not m:
                continue
            sched = m.get("prefill_sched")
            cv = m.get("load_cv_tokens")
            sched_s = "{:,.0f}".format(sched["median"]) if sched else "-"
            cv_s = "{:.3f}".format(cv["median"]) if cv else "-"
            lines.append(
                f"{w:13s} {mode:7s} {cell(m['s'], '{:.2f}'):>20s} {cell(m['tok_s'], '{:,.0f}'):>24s} "
                f"{cell(m['prefill_x'], '{:.2f}'):>20s} {sched_s:>12s} {cv_s:>7s}"
            )
            if m.get("turn_p50_s"):
                lines.append(
                    f"{'':13s} {'':7s} turn p50 {cell(m['turn_p50_s'], '{:.2f}')} s, p99 "
                    f"{cell(m.get('turn_p99_s'), '{:.2f}')} s, re-prefilled per resumed turn "
                    f"{cell(m.get('reprefill_frac'), '{:.3f}')}"
                )
        ratios = [f"{k} {cell(v, '{:.2f}')}" for k, v in row.items() if "/" in k]
        if ratios:
            lines.append(f"{'':13s} ratios (tok/s, per rep): " + "; ".join(ratios) + f"; all ok: {row['all_ok']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b", choices=["0.5b", "7b"])
    ap.add_argument("--engine", default="sglang", choices=["sglang", "standin", "fake"])
    ap.add_argument("--engines", type=int, default=1, help="engines in this process (the fake and stand-in only)")
    ap.add_argument("--serve", type=int, default=0, help="N engine server processes on the one GPU instead")
    ap.add_argument("--plan", nargs="*", default=None, help="WORKLOAD:side,side,... (default: every workload, raw,sdk)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default="fresh", choices=["fresh", "flush"])
    ap.add_argument("--metrics", action="store_true", help="read SGLang's prefill counter as a cross-check")
    ap.add_argument("--quick", action="store_true", help="tiny workloads (CPU dry runs)")
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--sampling", default="pytorch")
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--http-mem-fraction", type=float, default=0.4)
    ap.add_argument("--max-total-tokens", type=int, default=0)
    ap.add_argument("--graph-bs", type=int, default=512)
    ap.add_argument("--max-running", type=int, default=0)
    ap.add_argument("--update-after-s", type=float, default=None, help="default: 2 s (0.02 s with --quick)")
    ap.add_argument("--keep-kv-s", type=float, default=60.0, help="agent: the sdk sides' keep_kv_s (0: none)")
    ap.add_argument("--hints", type=int, default=1, help="agent: the sdk sides send tool-wait and end hints")
    ap.add_argument("--session-admission", type=float, default=0.9, help="sdk side: fraction of the KV pool")
    ap.add_argument("--extra", default="{}", help="JSON: more SGLang server args for the engine (e.g. HiCache)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--http-url", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.update_after_s is None:
        a.update_after_s = 0.02 if a.quick else 2.0
    if a.plan is None:
        a.plan = ["grpo2048x8:raw,rawcap,http,sdk,sdkoff", "grpo:raw,sdk", "long:raw,rawcap,http,sdk", "short:raw,sdk",
                  "agent:raw,sdk", "update:raw,sdk"]  # fmt: skip
    run = harness.loop_runner()
    if a.client:
        run(client_main(a))
        return
    with harness.sigterm_as_interrupt():
        res = run(server_main(a))
    if a.json:
        harness.write_json(a.json, res)
    print(table(res), flush=True)


if __name__ == "__main__":
    main()
