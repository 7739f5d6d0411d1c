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
import contextlib
import cProfile
import json
import math
import os
import pstats
import random
import resource
import subprocess
import sys
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import harness  # noqa: E402  (bench/harness/)
from harness import free_port, log, write_json  # noqa: E402

WORKLOADS = ("grpo", "short", "long", "oversub")
T0 = time.perf_counter()


# -- workloads ---------------------------------------------------------------------------------------


def make_workload(name: str, *, shape: str, max_running: int, vocab: int, quick: bool) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per request; deterministic from the name, the shape and the engine's limit."""
    rnd = random.Random(f"{name}-{shape}")
    big = shape != "7b"

    def ids(n: int) -> list[int]:
        return [rnd.randrange(1000, vocab - 1000) for _ in range(n)]

    if name == "grpo":  # prompts x 8 samples, lognormal lengths (median 300) capped at 2,048
        prompts = 16 if quick else (64 if big else 32)
        out: list[tuple[list[int], int]] = []
        for _ in range(prompts):
            p = ids(rnd.randrange(128, 513))
            for _ in range(8):
                n = int(min(2048, max(16, rnd.lognormvariate(math.log(300), 1.0))))
                out.append((p, 64 if quick else n))
        return out
    if name == "warm":
        return [(ids(64), 8) for _ in range(256)]
    if name == "short":  # 64 in / 16 out
        return [(ids(64), 16) for _ in range(256 if quick else (8192 if big else 4096))]
    if name == "long":  # fixed 512-token prompts, long fixed outputs
        n, o = (32, 64) if quick else ((256, 1024) if big else (256, 512))
        return [(ids(64 if quick else 512), o) for _ in range(n)]
    if name == "oversub":  # 4x the engine's running-request limit at once
        n = 4 * max_running
        return [(ids(16), 8 if quick else 16) for _ in range(n)]
    raise ValueError(name)


def cpu_times(http_proc: Any = None) -> dict[str, float]:
    """CPU seconds so far: this thread (the event loop), each SGLang child of this process, the HTTP server."""
    out = {"loop": time.thread_time()}
    try:
        import psutil
    except ImportError:
        return out
    http_tree: list[Any] = []
    if http_proc is not None:
        with contextlib.suppress(psutil.Error):
            hp = psutil.Process(http_proc.pid)
            http_tree = [hp, *hp.children(recursive=True)]
    skip = {p.pid for p in http_tree}
    for c in psutil.Process().children(recursive=True):
        if c.pid in skip:
            continue
        with contextlib.suppress(psutil.Error):
            name = "client" if "--client" in c.cmdline() else c.name()
            t = c.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system
    for c in http_tree:
        with contextlib.suppress(psutil.Error):
            t = c.cpu_times()
            out["http:" + c.name()] = out.get("http:" + c.name(), 0.0) + t.user + t.system
    return out


def summarize(name: str, outs: list[tuple[int, int]], dt: float, expect: list[int]) -> dict[str, Any]:
    """``outs``: (output tokens, logprobs) per request, in request order."""
    toks = sum(o for o, _ in outs)
    ok = len(outs) == len(expect) and all(o == e and lp == e for (o, lp), e in zip(outs, expect, strict=True))
    return {"s": round(dt, 3), "tok": toks, "tok_s": round(toks / dt, 1), "req_s": round(len(outs) / dt, 1), "ok": ok}


# -- the client process (sdk and http modes) --------------------------------------------------------


async def client_main(a: argparse.Namespace) -> None:
    from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    session: Any = None
    if a.http_url:
        import aiohttp

        http_limit = max(64, min(a.http_connections, nofile - 256))
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=http_limit, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
        )
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    from rollout_sdk import AdmissionConfig

    admission = AdmissionConfig(queue_fraction=a.queue_fraction) if a.queue_fraction is not None else None
    async with RolloutClient(servers=[a.client], connect_timeout_s=120, admission=admission) as client:
        print(json.dumps({"ready": True, "nofile": nofile}), flush=True)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
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
                    body = {
                        "input_ids": p,
                        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
                        "return_logprob": True,
                    }
                    async with session.post(a.http_url + "/generate", json=body) as resp:
                        resp.raise_for_status()
                        out = await resp.json()
                    lps = out.get("meta_info", {}).get("output_token_logprobs") or []
                    return len(out.get("output_ids") or []), len(lps)

                outs = list(await asyncio.gather(*(one(p, n) for p, n in work)))
            dt = time.perf_counter() - t0
            row = summarize(cmd["workload"], outs, dt, [n for _, n in work])
            st = client.stats()
            row["client_in_flight_window"] = client.scheduler.window()
            row["retried"] = st.retried
            print(json.dumps(row), flush=True)
    if session is not None:
        await session.close()


class ClientProc:
    """The client process, driven one pass at a time over stdin/stdout."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )
        self.hello: dict[str, Any] = {}

    async def started(self) -> ClientProc:
        self.hello = await asyncio.to_thread(self._read)  # the server must keep serving the handshake
        return self

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client process ended (exit {self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    async def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return await asyncio.to_thread(self._read)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# -- the HTTP server peer ---------------------------------------------------------------------------


def http_argv(model: str, port: int, a: argparse.Namespace, max_total_tokens: int) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
        "--skip-tokenizer-init", "--attention-backend", a.attn, "--sampling-backend", a.sampling,
        "--mem-fraction-static", str(a.http_mem_fraction), "--max-total-tokens", str(max_total_tokens),
        "--cuda-graph-max-bs-decode", str(a.graph_bs), "--disable-prefill-cuda-graph",
        "--random-seed", "0", "--log-level", "warning", "--host", "127.0.0.1", "--port", str(port),
    ] + (["--max-running-requests", str(a.max_running)] if a.max_running else [])  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen[Any] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the HTTP server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/get_model_info", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the HTTP server at {url} did not answer within {timeout:.0f}s")


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the process group ``proc`` leads (the HTTP server and its scheduler children), then SIGKILL."""
    import signal

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


async def fake_http_server(engine: Any) -> tuple[Any, str]:
    """CPU dry run only: an aiohttp stand-in for SGLang's /generate over the fake engine."""
    from aiohttp import web

    from rollout_sdk import GenerateRequest, SamplingParams

    seq = 0

    async def generate(request: web.Request) -> web.Response:
        nonlocal seq
        body = await request.json()
        sp = body["sampling_params"]
        seq += 1
        r = await engine.generate(
            GenerateRequest(
                input_ids=body["input_ids"],
                rid=f"http-{seq}",
                sampling=SamplingParams(max_new_tokens=sp["max_new_tokens"], ignore_eos=True),
            )
        )
        lps = [[lp, t, None] for lp, t in zip(r.logprobs or [], r.output_ids, strict=False)]
        return web.json_response({"output_ids": r.output_ids, "meta_info": {"output_token_logprobs": lps}})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake"})

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/get_model_info", info)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


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
    from rollout_sdk import EngineServer, GenerateRequest, SamplingParams, ServerConfig

    res: dict[str, Any] = {
        "shape": a.shape,
        "engine": a.engine,
        "reps": a.reps,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "passes": [],
    }
    http_proc: subprocess.Popen[Any] | None = None
    http_url = ""
    fake_runner: Any = None
    max_total_tokens = a.max_total_tokens or (3_000_000 if a.shape != "7b" else 600_000)
    res["max_total_tokens"] = max_total_tokens
    if a.engine == "sglang":
        import gpu_check  # bench/gpu_check.py: the config-only model dirs

        from rollout_sdk.engines.sglang import SglangEngine

        model = gpu_check.model_dir(a.shape)
        if a.http:  # first, so the in-process engine sizes itself from what the HTTP server left free
            port = free_port()
            http_url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            http_log = open(os.path.join(a.log_dir, f"http-{a.shape}.log"), "w")  # noqa: SIM115
            http_proc = subprocess.Popen(
                http_argv(model, port, a, max_total_tokens),
                stdout=http_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped with all its children below
            )
            await asyncio.to_thread(wait_http, http_url, http_proc, 900)
            res["http_start_s"] = round(time.perf_counter() - t0, 1)
            log(f"HTTP server ready in {res['http_start_s']}s at {http_url}")
        engine: Any = SglangEngine(
            gpu_check.dummy_engine_config(
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
    client: ClientProc | None = None
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
                fake_runner, http_url = (await fake_http_server(engine)) if a.http else (None, "")
            res["max_running"] = max_running
            log(f"engine ready in {res['engine_start_s']}s; max_running={max_running} vocab={vocab}")
            argv = [sys.executable, os.path.abspath(__file__), "--client", server.address, "--shape", a.shape]
            argv += ["--http-url", http_url] if http_url else []
            argv += ["--quick"] if a.quick else []
            argv += ["--queue-fraction", str(a.queue_fraction)] if a.queue_fraction is not None else []
            client = await ClientProc(argv).started()
            res["client_nofile"] = client.hello.get("nofile")

            async def raw_pass(work: list[tuple[list[int], int]]) -> list[tuple[int, int]]:
                if a.engine == "sglang":
                    raw = engine._engine

                    async def one(p: list[int], n: int) -> tuple[int, int]:
                        sp = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}
                        o = await raw.async_generate(input_ids=p, sampling_params=sp, return_logprob=True)
                        return len(o["output_ids"]), len(o["meta_info"]["output_token_logprobs"])

                else:
                    seq = iter(range(1 << 62))

                    async def one(p: list[int], n: int) -> tuple[int, int]:
                        r = await engine.generate(
                            GenerateRequest(
                                input_ids=p,
                                rid=f"raw-{next(seq)}",
                                sampling=SamplingParams(max_new_tokens=n, ignore_eos=True),
                            )
                        )
                        return len(r.output_ids), len(r.logprobs or [])

                return list(await asyncio.gather(*(one(p, n) for p, n in work)))

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
                    req = urllib.request.Request(http_url + "/flush_cache", data=b"", method="POST")
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=30).read())

            async def one_pass(mode: str, w: str) -> dict[str, Any]:
                await flush()
                cpu0 = cpu_times(http_proc)
                t = time.perf_counter()
                if mode == "raw":
                    outs = await raw_pass(works[w])
                    row = summarize(w, outs, time.perf_counter() - t, [n for _, n in works[w]])
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
                cpu1 = cpu_times(http_proc)
                # CPU seconds per wall second: this process's event loop thread (tokenizer manager + SDK
                # server), SGLang's scheduler processes, the HTTP server's process tree
                row["cpu"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 3) for k in cpu1}
                return row

            works["warm"] = make_workload("warm", shape=a.shape, max_running=max_running, vocab=vocab, quick=a.quick)
            for mode in modes:  # warm-up: every mode once on a small workload
                await one_pass(mode, "warm")
            log("warm-up done")
            for rep in range(a.reps):
                t_rep = time.perf_counter()
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for w in a.workloads:
                    for mode in order:
                        try:
                            row = await one_pass(mode, w)
                        except Exception as exc:  # one broken pass must not lose the run
                            row = {"error": f"{type(exc).__name__}: {exc}"}
                        row.update(rep=rep, workload=w, mode=mode)
                        res["passes"].append(row)
                        shown = {k: v for k, v in row.items() if k in ("s", "tok_s", "ok", "error")}
                        log(f"rep {rep} {w:8s} {mode:4s} {json.dumps(shown)} win={row.get('client_in_flight_window')}")
                        if a.json:
                            write_json(a.json, res)
                rep_s = time.perf_counter() - t_rep
                left = a.budget_s - (time.perf_counter() - T0)
                if rep + 1 < a.reps and left < 1.15 * rep_s:
                    res["stopped_early"] = (
                        f"after {rep + 1} reps: {left:.0f}s of --budget-s left, a rep takes {rep_s:.0f}s"
                    )
                    log(res["stopped_early"])
                    break
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
            stop_group(http_proc)
    res["summary"] = summary(res)
    return res


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    passes = [p for p in res["passes"] if "tok_s" in p]
    for w in dict.fromkeys(p["workload"] for p in res["passes"]):
        row: dict[str, Any] = {}
        by: dict[str, dict[int, float]] = {}
        for p in passes:
            if p["workload"] == w:
                by.setdefault(p["mode"], {})[p["rep"]] = p["tok_s"]
        for mode, reps in by.items():
            med, lo, hi = harness.spread(list(reps.values()))
            row[mode] = {"median": round(med), "min": round(lo), "max": round(hi)}
        for num, den in (("sdk", "raw"), ("http", "raw"), ("sdk", "http"), ("sdktm", "raw"), ("sdk", "sdktm")):
            if num in by and den in by:
                rs = [by[num][r] / by[den][r] for r in by[num] if r in by[den]]
                if rs:
                    med, lo, hi = harness.spread(rs)
                    row[f"{num}/{den}"] = {"median": round(med, 3), "min": round(lo, 3), "max": round(hi, 3)}
        row["all_ok"] = all(p.get("ok") for p in res["passes"] if p["workload"] == w)
        out[w] = row
    return out


def table(res: dict[str, Any]) -> str:
    def cell(d: dict[str, Any] | None, fmt: str = "{:,.0f}") -> str:
        if not d:
            return "-"
        return f"{fmt.format(d['median'])} [{fmt.format(d['min'])}-{fmt.format(d['max'])}]"

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
