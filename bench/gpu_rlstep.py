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

Workloads (deterministic from name, shape and pass; prompts are fresh random ids in every pass, so no
pass is served from another's prefix cache and no flush is needed: "fresh" cache state; ``--cache
flush`` flushes before every pass instead):

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
import math
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import gpu_rl  # noqa: E402  (bench/gpu_rl.py: client process plumbing, the HTTP server's argv)
import harness  # noqa: E402  (bench/harness/)

T0 = time.perf_counter()
MODES = ("raw", "rawcap", "http", "sdk", "sdkoff", "sdkflat", "sdkpin")


def log(msg: str) -> None:
    print(f"[rlstep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- workloads ----------------------------------------------------------------------------------------


@dataclass
class Item:
    prompt: list[int]
    max_new: int
    group: str | None = None


@dataclass
class Work:
    name: str
    items: list[Item] = field(default_factory=list)
    #: agent workloads: sessions of turns instead of items
    sessions: list[list[int]] = field(default_factory=list)
    turns: int = 0
    turn_new: int = 0
    tool_tokens: int = 0
    waits: list[list[float]] = field(default_factory=list)

    @property
    def ideal_prefill(self) -> int:
        if self.sessions:  # each turn's new tokens only: the first prompt, then the tool's result and the last
            # output token per turn (the model's other tokens are in the cache from decoding them)
            return sum(len(s) for s in self.sessions) + len(self.sessions) * (self.turns - 1) * (self.tool_tokens + 1)
        seen: set[tuple[str | None, int]] = set()
        total = 0
        for it in self.items:
            key = (it.group, len(it.prompt)) if it.group else (None, id(it))
            if key not in seen:
                seen.add(key)
                total += len(it.prompt)
        return total


def make_work(name: str, *, shape: str, quick: bool, vocab: int, salt: str) -> Work:
    """Deterministic from (name, shape, salt): the salt makes each pass's prompts fresh."""
    rnd = random.Random(f"{name}-{shape}-{salt}")
    big = shape != "7b"

    def ids(n: int) -> list[int]:
        return [rnd.randrange(1000, vocab - 1000) for _ in range(n)]

    def tail_len() -> int:  # GRPO's long tail: lognormal, median 300, at most 2,048
        return int(min(2048, max(16, rnd.lognormvariate(math.log(300), 1.0))))

    w = Work(name)
    base = name.removeprefix("update")
    if base.startswith("grpo") and "x" in base:
        shape_part, _, fixed = base[4:].partition("f")  # grpoPxG: long-tailed lengths; grpoPxGfN: N tokens each
        p, g = (int(x) for x in shape_part.split("x"))
        prompts = 8 if quick else 64
        p = min(p, 512) if quick else p
        for i in range(prompts):
            prompt = ids(p)
            w.items += [
                Item(prompt, 32 if quick else (int(fixed) if fixed else tail_len()), f"{salt}-g{i}") for _ in range(g)
            ]
    elif name == "update":
        w = make_work("grpo2048x8", shape=shape, quick=quick, vocab=vocab, salt=f"update-{salt}")
        w.name = name
        return w
    elif name == "grpo":
        for i in range(16 if quick else (64 if big else 32)):
            prompt = ids(rnd.randrange(128, 513))
            w.items += [Item(prompt, 32 if quick else tail_len(), f"{salt}-g{i}") for _ in range(8)]
    elif name == "long":
        n, o = (32, 64) if quick else ((1024, 512) if big else (256, 1024))
        w.items = [Item(ids(64 if quick else 512), o) for _ in range(n)]
    elif name == "short":
        w.items = [Item(ids(64), 16) for _ in range(256 if quick else (8192 if big else 4096))]
    elif name == "agent":
        n = 16 if quick else 256
        w.turns, w.turn_new, w.tool_tokens = 4, (16 if quick else 128), (8 if quick else 64)
        w.sessions = [ids(128 if quick else 2048) for _ in range(n)]
        lo, hi = (0.01, 0.1) if quick else (1.0, 10.0)
        w.waits = [[rnd.uniform(lo, hi) for _ in range(w.turns - 1)] for _ in range(n)]
        w.items = [Item(s, w.turn_new) for s in w.sessions]  # (for counting only)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return w


def tool_ids(session: int, turn: int, n: int, vocab: int) -> list[int]:
    rnd = random.Random(f"tool-{session}-{turn}")
    return [rnd.randrange(1000, vocab - 1000) for _ in range(n)]


# -- one side's pass: (output tokens, prompt tokens, cached tokens, engine) per request ------------------

Out = tuple[int, int, int, str, list[int] | None]  # output tokens, prompt, cached, engine, output ids (agents)


def summarize(work: Work, outs: list[Out], dt: float, turn_s: list[float] | None = None) -> dict[str, Any]:
    toks = sum(o[0] for o in outs)
    prefill = sum(max(0, o[1] - o[2]) for o in outs)
    per_engine: dict[str, list[int]] = {}
    for o, _, _, e, _ in outs:
        slot = per_engine.setdefault(e, [0, 0])
        slot[0] += 1
        slot[1] += o
    expect = sum(it.max_new for it in work.items) * (work.turns or 1) if not work.sessions else None
    row: dict[str, Any] = {
        "s": round(dt, 3),
        "tok": toks,
        "tok_s": round(toks / dt, 1),
        "requests": len(outs),
        "prefill": prefill,
        "prefill_ideal": work.ideal_prefill,
        "per_engine": per_engine,
        "ok": expect is None or toks == expect,
    }
    if turn_s:
        q = statistics.quantiles(turn_s, n=100)
        row["turn_p50_s"], row["turn_p95_s"] = round(statistics.median(turn_s), 3), round(q[94], 3)
        row["turn_p99_s"] = round(q[98], 3)
    if work.sessions:  # resumed turns (every turn but a session's first): the share of the context computed
        resumed = [(o[1], o[2]) for o in outs if o[1] > len(work.sessions[0]) + 1]
        if resumed:
            row["reprefill_frac"] = round(statistics.mean((p - c) / p for p, c in resumed), 4)
            row["reprefill_tokens"] = sum(p - c for p, c in resumed)
    return row


def load_cv(per_engine: dict[str, list[int]], index: int) -> float | None:
    vals = [v[index] for v in per_engine.values()]
    if len(vals) < 2 or not sum(vals):
        return None
    return round(statistics.pstdev(vals) / statistics.mean(vals), 4)


# -- the client process (sdk, sdkoff and http sides) ----------------------------------------------------


async def client_main(a: argparse.Namespace) -> None:
    from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams
    from rollout_sdk.protocol import SessionHint

    gpu_rl.client_main  # noqa: B018  (the same plumbing as gpu_rl's client: rlimits, stdin commands)
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    session: Any = None
    if a.http_url:
        import aiohttp

        session = aiohttp.ClientSession(
            # uvicorn closes a connection idle for 5 s: an agent's tool wait is longer, so never reuse one that
            # old (a reused closed connection is ServerDisconnectedError)
            connector=aiohttp.TCPConnector(limit=20000, keepalive_timeout=2.0),
            timeout=aiohttp.ClientTimeout(total=None),
        )
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    servers = a.client.split(",")
    async with RolloutClient(servers=servers, connect_timeout_s=300) as client:
        print(json.dumps({"ready": True}), flush=True)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            work = make_work(cmd["workload"], shape=a.shape, quick=a.quick, vocab=cmd["vocab"], salt=cmd["salt"])
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
                    body = {
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
                        "return_logprob": True,
                    }
                    async with session.post(a.http_url + "/generate", json=body) as resp:
                        resp.raise_for_status()
                        out = await resp.json()
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
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
                continue
            row = summarize(work, outs, time.perf_counter() - t0, turn_s)
            if a.serve and not work.sessions:
                row["prefill_results"] = row["prefill"]
                row["prefill"] += inferred_group_prefills(work, outs)
                groups_split = {}
                for it, o in zip(work.items, outs, strict=True):
                    if it.group:
                        groups_split.setdefault(it.group, set()).add(o[3])
                row["groups_split"] = sum(len(v) > 1 for v in groups_split.values())
            row["client_window"] = client.scheduler.window()
            print(json.dumps(row), flush=True)
    if session is not None:
        await session.close()


def inferred_group_prefills(work: Work, outs: list[Out]) -> int:
    """Engines in other processes (``--serve``): a server where a group's members took all but the last
    prompt token from the cache computed the prompt once, in its prefill pass."""
    seen: set[tuple[str, str]] = set()
    total = 0
    for it, (_, p, c, server, _) in zip(work.items, outs, strict=True):
        if it.group and c >= p - 1 and (it.group, server) not in seen:
            seen.add((it.group, server))
            total += p
    return total


async def run_agent(work: Work, gen: Any, turn_s: list[float], vocab: int, hint: Any = None) -> list[Out]:
    """Every session at once: turn, tool wait, next turn on the context grown by the model's own tokens and
    the tool's result.  ``hint(session, wait_s, ended)``: the SDK's session hints (the tool's expected wait
    before it runs, "ended" after the last turn)."""
    outs: list[Out] = []

    async def session(k: int) -> None:
        ctx = list(work.sessions[k])
        sid = f"agent-{id(work)}-{k}"
        for t in range(work.turns):
            t0 = time.perf_counter()
            o = await gen(ctx, work.turn_new, None, sid)
            turn_s.append(time.perf_counter() - t0)
            outs.append(o)
            if t + 1 < work.turns:
                if hint is not None:
                    await hint(sid, work.waits[k][t], False)
                await asyncio.sleep(work.waits[k][t])
                ctx += (o[4] or tool_ids(k, 1000 + t, o[0], vocab)) + tool_ids(k, t, work.tool_tokens, vocab)
            elif hint is not None:
                await hint(sid, None, True)

    await asyncio.gather(*(session(k) for k in range(len(work.sessions))))
    return outs


# -- the orchestrating process: engines, raw sides, the HTTP server ---------------------------------------


def prefill_counter(http_url: str | None) -> float | None:
    """The scheduler's own count of prefill tokens computed (``--metrics``): SGLang's Prometheus counter,
    read from the in-process engine's multiprocess files or the HTTP server's /metrics."""
    try:
        if http_url:
            with urllib.request.urlopen(http_url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            total = 0.0
            for line in text.splitlines():
                if line.startswith("sglang:realtime_tokens_total") and 'mode="prefill_compute"' in line:
                    total += float(line.rsplit(" ", 1)[1])
            return total
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not path:
            return None
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=path)
        total = 0.0
        for metric in reg.collect():
            for s in metric.samples:
                if s.name == "sglang:realtime_tokens_total" and s.labels.get("mode") == "prefill_compute":
                    total += s.value
        return total
    except Exception as exc:  # a cross-check only
        log(f"prefill counter unreadable: {type(exc).__name__}: {exc}")
        return None


async def server_main(a: argparse.Namespace) -> dict[str, Any]:
    from rollout_sdk import EngineServer, GenerateRequest, SamplingParams, ServerConfig

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
    want_http = any("http" in modes for _, modes in plan)
    http_proc: subprocess.Popen[Any] | None = None
    http_url = ""
    fake_runner: Any = None
    max_total_tokens = a.max_total_tokens or (3_000_000 if a.shape != "7b" else 600_000)
    engines: list[Any] = []
    raws: list[Any] = []  # per engine: async (prompt, n) -> Out
    if a.serve:
        return await fleet_main(a, plan, res)
    if a.engine == "sglang":
        import gpu_check

        from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig

        model = gpu_check.model_dir(a.shape)
        if want_http:
            port = gpu_rl.free_port()
            http_url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            http_log = open(os.path.join(a.log_dir, f"rlstep-http-{a.shape}.log"), "w")  # noqa: SIM115
            argv = gpu_rl.http_argv(model, port, a, max_total_tokens) + (["--enable-metrics"] if a.metrics else [])
            http_proc = subprocess.Popen(argv, stdout=http_log, stderr=subprocess.STDOUT, start_new_session=True)
            await asyncio.to_thread(gpu_rl.wait_http, http_url, http_proc, 900)
            res["http_start_s"] = round(time.perf_counter() - t0, 1)
            log(f"HTTP server ready in {res['http_start_s']}s")
        per = max_total_tokens // a.engines
        for e in range(a.engines):
            engines.append(  # noqa: PERF401
                SglangEngine(
                    SglangEngineConfig(
                        model_path=model,
                        load_format="dummy",
                        attention_backend=a.attn,
                        sampling_backend=a.sampling,
                        mem_fraction_static=a.mem_fraction / (a.engines - e) if a.engines > 1 else a.mem_fraction,
                        cuda_graph_max_bs=a.graph_bs,
                        random_seed=0,
                        session_admission=a.session_admission or None,
                        extra={"disable_prefill_cuda_graph": True, "max_total_tokens": per, **json.loads(a.extra)},
                    )
                )
            )
    elif a.engine == "standin":
        from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
        from rollout_sdk.engines.sglang.standin import StandinEngine, StandinScheduler
        from rollout_sdk.models import ensure_tiny_model

        model = str(await asyncio.to_thread(ensure_tiny_model))
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
    servers = [EngineServer(eng, ServerConfig(server_id=f"e{i}", drain_timeout_s=5)) for i, eng in enumerate(engines)]
    client: gpu_rl.ClientProc | None = None
    stack = contextlib.AsyncExitStack()
    try:
        t0 = time.perf_counter()
        for s in servers:
            await stack.enter_async_context(s)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        vocab = engines[0].limits.vocab_size
        graph_bs = a.graph_bs
        if a.engine in ("sglang", "standin"):
            window = engines[0].decode_window
            res["decode_window"] = window.size if window is not None else None
            snaps = await engines[0].tm.get_loads() if a.engine == "sglang" else []
            if snaps:
                res["engine_max_running"] = int(snaps[0].max_running_requests)
                res["engine_kv_tokens"] = int(snaps[0].max_total_num_tokens)
        else:
            fake_runner, http_url = (await gpu_rl.fake_http_server(engines[0])) if want_http else (None, "")
        log(f"{len(engines)} engine(s) ready in {res['engine_start_s']}s: {json.dumps(res)[:400]}")

        raws.extend(raw_side(a, eng, i, GenerateRequest, SamplingParams) for i, eng in enumerate(engines))

        argv = [sys.executable, os.path.abspath(__file__), "--client", ",".join(s.address for s in servers)]
        argv += ["--shape", a.shape] + (["--http-url", http_url] if http_url else []) + (["--quick"] if a.quick else [])
        client = await gpu_rl.ClientProc(argv).started()

        async def flush() -> None:
            if a.cache != "flush" or a.engine == "fake":
                return
            for eng in engines:
                await eng.flush_cache()
            if http_url and a.engine == "sglang":
                req = urllib.request.Request(http_url + "/flush_cache", data=b"", method="POST")
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=30).read())

        def admission(on: bool) -> None:
            """sdk: session admission at --session-admission; sdkpin and sdkoff: none (sessions' KV kept or not
            is the client's choice, keep_kv_s)."""
            for eng in engines:
                book = getattr(eng, "sessions", None)
                if book is not None:
                    if not hasattr(eng, "_bench_budget"):
                        eng._bench_budget = book.budget_tokens
                    book.budget_tokens = eng._bench_budget if on else None

        def levers(on: bool) -> None:
            """sdkoff: the decode window and prefill-once switched off on every engine for one pass (between
            passes only: nothing holds a place in the window then)."""
            names = ("prefill_once",) if a.engine == "fake" else ("_window", "_prefill")
            for eng in engines:
                if on:
                    for k, v in eng.__dict__.pop("_bench_saved", {}).items():
                        setattr(eng, k, v)
                else:
                    eng._bench_saved = {k: getattr(eng, k) for k in names}
                    for k in names:
                        setattr(eng, k, None)

        def once_tokens() -> int:
            if a.engine == "fake":
                return 0  # the fake counts every computed token itself (prefill_tokens)
            return sum(getattr(e, "prefill_once_tokens", 0) for e in engines)

        async def one_pass(mode: str, wname: str, rep: int) -> dict[str, Any]:
            salt = f"{rep}-{mode}"
            work = make_work(wname, shape=a.shape, quick=a.quick, vocab=vocab, salt=salt)
            await flush()
            metrics = a.metrics and a.engine == "sglang" and mode == "http"  # SGLang's own server's counter
            counter0 = prefill_counter(http_url) if metrics else None
            fake0 = sum(getattr(e, "prefill_tokens", 0) for e in engines)
            once0 = once_tokens()
            t = time.perf_counter()
            if mode in ("raw", "rawcap"):
                row = await raw_pass(a, work, raws, cap=graph_bs if mode == "rawcap" else None, engines=engines)
            else:
                assert client is not None
                admission(mode == "sdk")
                if mode == "sdkoff":
                    levers(False)
                try:
                    update = asyncio.create_task(mid_update(a, engines, wname)) if wname == "update" else None
                    row = await client.run(mode=mode, workload=wname, vocab=vocab, salt=salt)
                    if "error" in row:
                        return row
                    if update is not None:
                        row["update"] = await update
                finally:
                    if mode == "sdkoff":
                        levers(True)
                row["prefill"] += once_tokens() - once0
            if a.engine == "fake":  # the fake counts what it computes itself, prefill-only passes included
                row["prefill_results"] = row["prefill"]
                row["prefill"] = sum(getattr(e, "prefill_tokens", 0) for e in engines) - fake0
            if counter0 is not None:
                c1 = prefill_counter(http_url)
                row["prefill_sched"] = None if c1 is None else round(c1 - counter0)
            row["wall_s"] = round(time.perf_counter() - t, 3)
            row["prefill_x"] = round(row["prefill"] / max(1, row["prefill_ideal"]), 3)
            row["load_cv_requests"] = load_cv(row["per_engine"], 0)
            row["load_cv_tokens"] = load_cv(row["per_engine"], 1)
            return row

        for rep in range(a.reps):
            t_rep = time.perf_counter()
            for wname, modes in plan:
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for mode in order:
                    try:
                        row = await one_pass(mode, wname, rep)
                    except Exception as exc:  # one broken pass must not lose the run
                        row = {"error": f"{type(exc).__name__}: {exc}"}
                    row.update(rep=rep, workload=wname, mode=mode)
                    res["passes"].append(row)
                    keys = ("s", "tok_s", "prefill_x", "prefill_sched", "load_cv_tokens", "turn_p50_s", "turn_p99_s",
                            "reprefill_frac", "ok", "error")  # fmt: skip
                    log(f"rep {rep} {wname:12s} {mode:6s} {json.dumps({k: row[k] for k in keys if k in row})}")
                    if a.json:
                        gpu_rl.write_json(a.json, res)
            rep_s = time.perf_counter() - t_rep
            left = a.budget_s - (time.perf_counter() - T0)
            if rep + 1 < a.reps and left < 1.1 * rep_s:
                res["stopped_early"] = f"after {rep + 1} reps: {left:.0f}s of --budget-s left, a rep takes {rep_s:.0f}s"
                log(res["stopped_early"])
                break
    finally:
        if client is not None:
            client.close()
        if fake_runner is not None:
            await fake_runner.cleanup()
        await stack.aclose()
        if http_proc is not None:
            gpu_rl.stop_group(http_proc)
    res["summary"] = summary(res)
    return res


async def fleet_main(a: argparse.Namespace, plan: list[tuple[str, list[str]]], res: dict[str, Any]) -> dict[str, Any]:
    """``--serve N``: N engine server processes on the one GPU, the SDK's sides only."""
    import gpu_check
    import gpu_fleet

    bad = [m for _, ms in plan for m in ms if m not in ("sdk", "sdkflat")]
    if bad:
        raise SystemExit(f"--serve runs the sdk and sdkflat sides only, not {sorted(set(bad))}")
    per = (a.max_total_tokens or (3_000_000 if a.shape != "7b" else 600_000)) // a.serve
    model = gpu_check.model_dir(a.shape) if a.engine == "sglang" else "fake"

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

    client: gpu_rl.ClientProc | None = None
    t0 = time.perf_counter()
    with Engines([a.serve], model, a.graph_bs, a.log_dir, a.engine) as fleet:
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        log(f"{a.serve} engine servers ready in {res['engine_start_s']}s: {fleet.addresses}")
        vocab = 151936
        argv = [sys.executable, os.path.abspath(__file__), "--client", ",".join(fleet.addresses.values())]
        argv += ["--shape", a.shape, "--serve", str(a.serve)] + (["--quick"] if a.quick else [])
        client = await gpu_rl.ClientProc(argv).started()
        rep_s = 0.0
        try:
            for rep in range(a.reps):
                t_rep = time.perf_counter()
                if rep and a.budget_s - (time.perf_counter() - T0) < 1.1 * rep_s:
                    res["stopped_early"] = f"after {rep} reps (--budget-s)"
                    break
                for wname, modes in plan:
                    order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                    for mode in order:
                        t = time.perf_counter()
                        try:
                            row = await client.run(mode=mode, workload=wname, vocab=vocab, salt=f"{rep}-{mode}")
                            row["wall_s"] = round(time.perf_counter() - t, 3)
                            row["prefill_x"] = round(row["prefill"] / max(1, row["prefill_ideal"]), 3)
                            row["load_cv_requests"] = load_cv(row["per_engine"], 0)
                            row["load_cv_tokens"] = load_cv(row["per_engine"], 1)
                        except Exception as exc:
                            row = {"error": f"{type(exc).__name__}: {exc}"}
                        row.update(rep=rep, workload=wname, mode=mode)
                        res["passes"].append(row)
                        keys = ("s", "tok_s", "prefill_x", "load_cv_requests", "load_cv_tokens", "groups_split", "ok")
                        log(f"rep {rep} {wname:12s} {mode:7s} {json.dumps({k: row[k] for k in keys if k in row})}")
                        if a.json:
                            gpu_rl.write_json(a.json, res)
                rep_s = time.perf_counter() - t_rep
        finally:
            client.close()
    res["summary"] = summary(res)
    return res


def raw_side(a: argparse.Namespace, eng: Any, index: int, GenerateRequest: Any, SamplingParams: Any) -> Any:
    """The raw path to one engine: SGLang's ``async_generate`` (the fake's and the stand-in's equivalents)."""
    name = f"e{index}"
    if a.engine in ("sglang", "standin"):
        raw = eng._engine

        async def one(prompt: list[int], n: int) -> Out:
            sp = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}
            o = await raw.async_generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
            meta = o["meta_info"]
            return (
                len(o["output_ids"]),
                int(meta.get("prompt_tokens") or len(prompt)),
                int(meta.get("cached_tokens") or 0),
                name,
                list(o["output_ids"]),
            )

        return one
    seq = iter(range(1 << 62))

    async def one_fake(prompt: list[int], n: int, sid: str | None = None) -> Out:
        r = await eng.generate(
            GenerateRequest(
                input_ids=prompt,
                rid=f"raw-{next(seq)}",
                session_id=sid,  # the fake models SGLang's prefix cache of sessions: plain LRU for raw
                sampling=SamplingParams(max_new_tokens=n, ignore_eos=True),
            )
        )
        return len(r.output_ids), r.prompt_tokens, r.cached_tokens, name, list(r.output_ids)

    return one_fake


async def raw_pass(
    a: argparse.Namespace, work: Work, raws: list[Any], *, cap: int | None, engines: list[Any]
) -> dict[str, Any]:
    sem = asyncio.Semaphore(cap * len(raws)) if cap else None
    counter = iter(range(1 << 62))

    async def gen(prompt: list[int], n: int, group: str | None, sid: str | None) -> Out:
        side = raws[next(counter) % len(raws)]  # a naive user deals requests round-robin
        kw = {"sid": sid} if sid and a.engine == "fake" else {}
        if sem is None:
            return await side(prompt, n, **kw)
        async with sem:
            return await side(prompt, n, **kw)

    t0 = time.perf_counter()
    turn_s: list[float] = []
    update = asyncio.create_task(mid_update(a, engines, work.name, raw=True)) if work.name == "update" else None
    if work.sessions:
        outs = await run_agent(work, gen, turn_s, engines[0].limits.vocab_size)
    else:
        outs = list(await asyncio.gather(*(gen(it.prompt, it.max_new, it.group, None) for it in work.items)))
    row = summarize(work, outs, time.perf_counter() - t0, turn_s)
    if update is not None:
        row["update"] = await update
    return row


async def mid_update(a: argparse.Namespace, engines: list[Any], wname: str, *, raw: bool = False) -> dict[str, Any]:
    """Half way through a pass (after ``--update-after-s``): every engine's weights "change" (pause with
    retract, version bump, resume); the SDK's own path through its engine, raw SGLang's through its
    tokenizer manager."""
    await asyncio.sleep(a.update_after_s)
    t0 = time.perf_counter()
    for eng in engines:
        if raw and a.engine in ("sglang", "standin"):
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

            await eng.tm.pause_generation(PauseGenerationReqInput(mode="retract"))
            await eng.tm.continue_generation(ContinueGenerationReqInput())
        else:
            await eng.pause("retract")
            await eng.set_weight_version(eng.weight_version + 1)
            await eng.resume()
    return {"at_s": a.update_after_s, "took_s": round(time.perf_counter() - t0, 3)}


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


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    passes = [p for p in res["passes"] if "tok_s" in p]
    for w in dict.fromkeys(p["workload"] for p in res["passes"]):
        row: dict[str, Any] = {}
        by: dict[str, dict[int, dict[str, Any]]] = {}
        for p in passes:
            if p["workload"] == w:
                by.setdefault(p["mode"], {})[p["rep"]] = p

        def med(ps: dict[int, dict[str, Any]], key: str) -> dict[str, float] | None:
            v = [p[key] for p in ps.values() if p.get(key) is not None]
            if not v:
                return None
            return {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}

        for mode, ps in by.items():
            row[mode] = {k: med(ps, k) for k in _KEYS}
        for num in ("sdk", "sdkpin", "sdkoff", "http"):
            for den in ("raw", "rawcap", "http", "sdkoff", "sdkflat", "sdkpin"):
                if num == den or num not in by or den not in by:
                    continue
                rs = [by[num][r]["tok_s"] / by[den][r]["tok_s"] for r in by[num] if r in by[den]]
                if rs:
                    row[f"{num}/{den}"] = {
                        "median": round(statistics.median(rs), 3),
                        "min": round(min(rs), 3),
                        "max": round(max(rs), 3),
                    }
        row["all_ok"] = all(p.get("ok") for p in res["passes"] if p["workload"] == w)
        out[w] = row
    return out


def table(res: dict[str, Any]) -> str:
    lines = [
        f"shape {res['shape']} ({res['engine']} x{res['engines']}), cache {res['cache']}, decode window "
        f"{res.get('decode_window')}, engine max_running {res.get('engine_max_running', '-')}, reps {res['reps']}, "
        f"{res['date']}",
        f"{'workload':13s} {'side':7s} {'s':>20s} {'tok/s':>24s} {'prefill x ideal':>20s} {'sched':>12s} {'cv':>7s}",
    ]

    def cell(d: dict[str, Any] | None, fmt: str) -> str:
        if not d:
            return "-"
        return f"{fmt.format(d['median'])} [{fmt.format(d['min'])}-{fmt.format(d['max'])}]"

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
        ratios = [f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for k, v in row.items() if "/" in k]
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
