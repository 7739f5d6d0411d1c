"""A long RL-shaped run on one engine start: does any pass stall?  (issue #30)

    python bench/gpu_soak.py --shape 0.5b --steps 4 --json $OUT/soak-0.5b.json --stacks-json $OUT/stacks.json
    python bench/gpu_soak.py --shape 7b --steps 2 --json $OUT/soak-7b.json
    python bench/gpu_soak.py --engine fake --quick          # CPU dry run of every code path (< 1 minute)

One engine (``SglangEngine`` behind an ``EngineServer`` in this process, or the fake engine on CPU) and
one SDK client in **its own process** (bench/harness's ``ClientProc``), as a trainer would run them.
The plan: ``--steps`` RL steps, each = every workload once through the SDK and once *raw*
(``sglang.Engine.async_generate`` + ``asyncio.gather`` on the very engine the server wraps, in this
process; the order of the two alternating per step), then a weight update of the whole model through the
client (CUDA IPC; on the fake engine a server-side update behind a ``retract`` pause).  Workloads (token
ids from a fixed seed; temperature 1, ``ignore_eos``, logprobs on, every request submitted at once):

* ``grpo``: prompts x 8 samples, lognormal output lengths (median 300) capped at 2,048 (gpu_rl.py's);
* ``short``: 8,192 (0.5B) / 4,096 (7B) x 64 in / 16 out (gpu_rl.py's);
* ``long``: 1,024 (0.5B) / 256 (7B) x 512 in / 512 out: the shape that stalled (issue #30);
* ``agent``: multi-turn agents, each turn's prompt = the last prompt + its output + a tool result, with
  session affinity (SDK) / the same ids (raw).

Per pass it records wall time, output tokens/s, GPU utilisation (``nvidia-smi`` every 0.5 s), this
process's event-loop lag (a 50 ms ticker's overshoot: this loop runs the SDK server *and* SGLang's
tokenizer manager), the engine's running / queued / KV usage / SGLang's own generation throughput once a
second, garbage-collection time, the tokenizer manager's live request states and CPU seconds per wall
second of each process.  With ``--stacks`` (default on) every Python process — this one, the client, SGLang's
scheduler and detokenizer — runs bench/_stacks.py's sampler, and the stacks of every pass slower than
``--slow`` x its workload's median (with the median pass of the same workload and mode beside it) go to
``--stacks-json``.  A table (every pass, then per workload: SDK median, the SDK's worst / its median,
the SDK's worst / raw's worst) is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import _stacks  # noqa: E402  (bench/ on sys.path)
import harness  # noqa: E402
from harness import ClientProc, cpu_times, log, write_json  # noqa: E402
from peers import shapes  # noqa: E402  (bench/peers/: the dummy-weight model)
from peers.raw import raw_generate  # noqa: E402  (bench/peers/: raw SGLang in this process)
from workloads import fixed  # noqa: E402  (bench/workloads/)
from workloads.fixed import agent_plan, run_agents, soak_workload, summarize  # noqa: E402

WORKLOADS = ("grpo", "short", "long", "agent")
EXTRA_WORKLOADS = ("oversub", "long128")  # gpu_rl.py's 16,384 x 16 in / 16 out: many tiny cached requests


# -- the client process ------------------------------------------------------------------------------


async def client_main(a: argparse.Namespace) -> None:
    from rollout_sdk import GenerateRequest, RolloutClient, SamplingParams

    pipe = await harness.Pipe.open()
    named: Any = None

    def sp(n: int) -> Any:
        return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)

    async with RolloutClient(servers=[a.client], connect_timeout_s=120) as client:
        pipe.reply({"ready": True})
        async for cmd in pipe:
            t0 = time.perf_counter()
            if "update" in cmd:  # a trainer's weight push: the whole model, CUDA IPC
                if named is None:
                    named = shapes.hf_named(a.shape, "cuda")
                st = await client.update_weights(
                    named, version=cmd["update"], method="ipc", flush_cache=cmd.get("flush", True)
                )
                pipe.reply({"s": round(time.perf_counter() - t0, 3), "stats": st})
                continue
            w, vocab = cmd["workload"], cmd["vocab"]
            if w == "agent":

                async def turn(i: int, prompt: list[int], n: int) -> tuple[list[int], int]:
                    r = await client.generate(prompt, sampling=sp(n), session_id=f"agent-{i}")
                    return r.output_ids, len(r.logprobs or [])

                toks, ok = await run_agents(agent_plan(shape=a.shape, vocab=vocab, quick=a.quick), turn)
                dt = time.perf_counter() - t0
                row = {"s": round(dt, 3), "tok": toks, "tok_s": round(toks / dt, 1), "ok": ok}
            else:
                work = soak_workload(w, shape=a.shape, vocab=vocab, quick=a.quick)
                res = await asyncio.gather(
                    *(client.generate(GenerateRequest(input_ids=p, sampling=sp(n))) for p, n in work)
                )
                outs = [(len(r.output_ids), len(r.logprobs or [])) for r in res]
                row = summarize(outs, [n for _, n in work], time.perf_counter() - t0)
            row["client_window"] = client.scheduler.window()
            row["retried"] = client.stats().retried
            pipe.reply(row)


# -- monitors (this process) ---------------------------------------------------------------------------


class GpuMonitor:
    """``nvidia-smi`` utilisation and memory every 0.5 s, on a thread; nothing where there is none."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, util %, memory MiB)
        self._proc: subprocess.Popen[str] | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        self._proc = subprocess.Popen(
            [exe, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "500"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, name="gpu-monitor", daemon=True).start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                util, mem = (float(x) for x in line.split(",")[:2])
                self.samples.append((time.monotonic(), util, mem))

    def between(self, t0: float, t1: float) -> list[float]:
        return [u for t, u, _ in self.samples if t0 <= t <= t1]

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)


class LoopMonitor:
    """This event loop's lag (a 50 ms ticker's overshoot) and the engine's load once a second."""

    def __init__(self, engine: Any, server: Any) -> None:
        self.engine = engine
        self.server = server
        self.lags: list[tuple[float, float]] = []
        self.loads: list[dict[str, Any]] = []
        self.gc_s = 0.0
        self._gc_t = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_load = 0.0
        while True:
            t = loop.time()
            await asyncio.sleep(0.05)
            now = loop.time()
            self.lags.append((time.monotonic(), now - t - 0.05))
            if now >= next_load:
                next_load = now + 1.0
                self.loads.append(await self._load())

    async def _load(self) -> dict[str, Any]:
        ld = self.engine.load()
        row: dict[str, Any] = {
            "t": round(time.monotonic(), 2),
            "running": ld.running,
            "queued": ld.queued,
            "kv": ld.kv_usage,
            "tasks": len(asyncio.all_tasks()),
        }
        st = self.server.stats()
        row["stalled"] = getattr(st, "stalled", None)
        tm = getattr(self.engine, "tm", None)
        if tm is not None:
            with contextlib.suppress(Exception):
                snap = (await tm.get_loads())[0]
                row.update(sg_running=snap.num_running_reqs, sg_waiting=snap.num_waiting_reqs)
                row.update(gen_tput=round(snap.gen_throughput), sg_ts_age=round(time.time() - snap.timestamp, 2))
            row["rid_to_state"] = len(getattr(tm, "rid_to_state", {}) or {})
        gens = getattr(asyncio.get_running_loop(), "_asyncgens", None)
        if gens is not None:
            row["asyncgens"] = len(gens)
        return row

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        lags = sorted(x for t, x in self.lags if t0 <= t <= t1)
        loads = [r for r in self.loads if t0 <= r["t"] <= t1]
        return {
            "lag_p99_ms": round(1000 * lags[int(0.99 * (len(lags) - 1))], 1) if lags else None,
            "lag_max_ms": round(1000 * lags[-1], 1) if lags else None,
            "loads": loads,
        }


async def py_spy_later(after_s: float, root: str, label: str) -> None:
    """After ``after_s``, ``py-spy dump --native`` this process and its Python children (SGLang's scheduler and
    detokenizer, the client) into ``root/<label>.pyspy.txt``; nothing without py-spy or psutil."""
    await asyncio.sleep(after_s)
    exe = shutil.which("py-spy")
    try:
        import psutil
    except ImportError:
        return
    if exe is None:
        return
    me = psutil.Process()
    procs = [me, *(c for c in me.children(recursive=True) if "python" in c.name() or "sglang" in c.name())]
    out = []
    for p in procs:
        with contextlib.suppress(Exception):
            r = await asyncio.to_thread(
                subprocess.run,
                [exe, "dump", "--native", "--pid", str(p.pid)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out.append(f"=== pid {p.pid} {p.name()} rc={r.returncode}\n{r.stdout}{r.stderr}")
    with open(os.path.join(root, f"{label}.pyspy.txt"), "w") as f:
        f.write("\n".join(out))
    log(f"{label}: slow (> {after_s:.1f} s); py-spy dumps of {len(procs)} processes taken")


# -- the orchestration (this process) ------------------------------------------------------------------


async def server_main(a: argparse.Namespace, stacks_root: str | None) -> dict[str, Any]:
    from rollout_sdk import EngineServer, ServerConfig
    from rollout_sdk.engines.sglang import radix_patch

    toggle = None
    if a.patch_after_step is not None:  # SGLang's own eviction until that step, then rollout-sdk's
        toggle = os.path.join(tempfile.mkdtemp(prefix="soak-radix-"), "on")
        os.environ[radix_patch.ENV] = f"toggle:{toggle}"

    res: dict[str, Any] = {
        "shape": a.shape,
        "engine": a.engine,
        "steps": a.steps,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "passes": [],
        "updates": [],
        "flush_passes": a.flush_passes,
        "update_flush": a.update_flush,
        "max_total_tokens": a.max_total_tokens,
        "patch_after_step": a.patch_after_step,
        "plan": a.plan,
    }
    if a.engine == "sglang":
        from rollout_sdk.engines.sglang import SglangEngine

        engine: Any = SglangEngine(
            shapes.dummy_engine_config(
                a,
                shapes.model_dir(a.shape),
                extra={"max_total_tokens": a.max_total_tokens} if a.max_total_tokens else {},
            )
        )
    else:
        from rollout_sdk.engines.fake import FakeEngine, FakeEngineConfig

        engine = FakeEngine(FakeEngineConfig(step_base_s=0.002, step_per_seq_s=2e-6, max_batch=256))
    server = EngineServer(engine, ServerConfig(server_id=f"soak-{a.shape}", drain_timeout_s=5))
    gpu = GpuMonitor()
    client: ClientProc | None = None
    t_start = time.perf_counter()
    try:
        async with server:
            res["engine_start_s"] = round(time.perf_counter() - t_start, 1)
            vocab = engine.limits.vocab_size
            mon = LoopMonitor(engine, server)
            mon_task = asyncio.create_task(mon.run(), name="soak-monitor")
            log(f"engine ready in {res['engine_start_s']}s (vocab {vocab})")
            argv = [sys.executable, os.path.abspath(__file__), "--client", server.address, "--shape", a.shape]
            argv += ["--quick"] if a.quick else []
            client = await ClientProc(argv).started()
            works = {
                w: soak_workload(w, shape=a.shape, vocab=vocab, quick=a.quick) for w in a.workloads if w != "agent"
            }
            agents = agent_plan(shape=a.shape, vocab=vocab, quick=a.quick)
            raw = raw_generate(engine, sglang=a.engine == "sglang")

            async def raw_one(prompt: list[int], n: int) -> tuple[list[int], int]:
                o = await raw(prompt, n, None)
                return o.output_ids, o.logprobs

            async def raw_pass(w: str) -> dict[str, Any]:
                t0 = time.perf_counter()
                if w == "agent":
                    toks, ok = await run_agents(agents, lambda i, p, n: raw_one(p, n))
                    dt = time.perf_counter() - t0
                    return {"s": round(dt, 3), "tok": toks, "tok_s": round(toks / dt, 1), "ok": ok}
                outs = await asyncio.gather(*(raw_one(p, n) for p, n in works[w]))
                return summarize([(len(i), lp) for i, lp in outs], [n for _, n in works[w]], time.perf_counter() - t0)

            async def one_pass(mode: str, w: str, label: str) -> dict[str, Any]:
                if stacks_root:
                    _stacks.set_window(stacks_root, label)
                if a.engine == "sglang" and a.flush_passes:
                    await engine.flush_cache()  # every pass starts from an empty prefix cache
                cpu0, gc0, stalls0 = cpu_times(), mon.gc_s, server.stats().stalls
                t0m, t0 = time.monotonic(), time.perf_counter()
                before = [p["s"] for p in res["passes"] if p.get("workload") == w and "s" in p]
                spy = None
                if stacks_root and len(before) >= 2:  # a live look (py-spy, native frames) if it runs slow
                    spy = asyncio.create_task(py_spy_later(a.slow * statistics.median(before), stacks_root, label))
                try:
                    if mode == "raw":
                        row = await raw_pass(w)
                    else:
                        row = await client.run(mode="sdk", workload=w, vocab=vocab)
                finally:
                    if spy is not None:
                        spy.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await spy
                wall = time.perf_counter() - t0
                t1m = time.monotonic()
                cpu1 = cpu_times()
                row["cpu"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 3) for k in cpu1}
                row["gc_s"] = round(mon.gc_s - gc0, 3)
                row["stalls"] = server.stats().stalls - stalls0
                row["patched"] = toggle is None or os.path.exists(toggle)
                util = gpu.between(t0m, t1m)
                row["gpu_util"] = round(statistics.mean(util), 1) if util else None
                row["gpu_util_samples"] = [round(u) for u in util]
                row.update(mon.window(t0m, t1m))
                return row

            async def checkpoint_stacks(label: str) -> None:
                """Close the pass's sampling window and write what is kept so far: a call cut at its time
                limit still brings back the stacks of the passes it finished."""
                if not (stacks_root and a.stacks_json):
                    return
                _stacks.set_window(stacks_root, f"{label}-after")
                await asyncio.sleep(0.6)  # every sampler polls the window file every 0.25 s
                res["summary"] = summary(res, a.slow)
                res["stacks_kept"] = keep_stacks(res, stacks_root, a.stacks_json)

            # warm-up: each mode once on a small workload (not counted)
            works["warm"] = fixed.make_workload("warm", shape=a.shape, max_running=0, vocab=vocab, quick=a.quick)
            await one_pass("raw", "warm", "warm-raw")
            await client.run(mode="sdk", workload="short" if a.quick else "grpo", vocab=vocab)
            log("warm-up done")
            k = 0

            async def counted_pass(mode: str, w: str, step: int, detail: Callable[[dict[str, Any]], str]) -> None:
                """One counted pass: its row (or the error that broke it: one broken pass must not lose the
                run), its stacks, a progress line (``detail``: its end), the JSON so far."""
                nonlocal k
                label = f"p{k:03d}-{mode}-{w}"
                try:
                    row = await one_pass(mode, w, label)
                except Exception as exc:
                    row = {"error": f"{type(exc).__name__}: {exc}"}
                row.update(i=k, step=step, workload=w, mode=mode, label=label)
                res["passes"].append(row)
                await checkpoint_stacks(label)
                k += 1
                log(
                    f"{label:18s} {row.get('s', '-'):>8} s {row.get('tok_s', '-'):>10} tok/s "
                    f"gpu {row.get('gpu_util')}% {detail(row)}"
                )
                if a.json:
                    write_json(a.json, res)

            for tok in a.plan or []:  # an explicit plan: "mode:workload" passes and "FIX" (toggle on)
                if tok == "FIX":
                    assert toggle is not None, "--plan FIX needs --patch-after-step"
                    open(toggle, "w").close()
                    log("incremental radix-cache eviction on")
                    continue
                mode, w = tok.split(":")
                works.setdefault(w, soak_workload(w, shape=a.shape, vocab=vocab, quick=a.quick))
                await counted_pass(
                    mode, w, 0, lambda r: f"fix={r.get('patched')} stalls={r.get('stalls')} ok={r.get('ok')}"
                )
            for step in range(0 if a.plan else a.steps):
                if toggle is not None and step == a.patch_after_step:
                    open(toggle, "w").close()  # the scheduler's evict switches to rollout-sdk's (radix_patch)
                    log(f"step {step}: incremental radix-cache eviction on")
                order = ("raw", "sdk") if step % 2 == 0 else ("sdk", "raw")
                for w in a.workloads:
                    for mode in order:
                        await counted_pass(
                            mode,
                            w,
                            step,
                            lambda r: (
                                f"lag p99 {r.get('lag_p99_ms')} ms gc {r.get('gc_s')} s "
                                f"ok={r.get('ok')} {r.get('error', '')}"
                            ),
                        )
                version = step + 1  # the weight version after this step's update
                t0 = time.perf_counter()
                try:
                    if a.engine == "sglang":
                        upd = await client.run(update=version, flush=a.update_flush)
                    else:
                        import torch

                        await engine.pause("retract")
                        await engine.update_weights([("w", torch.full((4,), float(version)))], version=version)
                        await engine.resume()
                        upd = {"s": round(time.perf_counter() - t0, 3)}
                except Exception as exc:
                    upd = {"error": f"{type(exc).__name__}: {exc}"}
                upd["version"] = version
                res["updates"].append(upd)
                log(f"step {step} done; weight update -> v{version}: {upd}")
                if time.perf_counter() - t_start > a.budget_s:
                    res["stopped_early"] = f"after step {step}: --budget-s {a.budget_s:.0f} s spent"
                    log(res["stopped_early"])
                    break
            if stacks_root:
                _stacks.set_window(stacks_root, "end")
            mon_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mon_task
            res["server_stats"] = _plain(server.stats())
            client.close()  # before the server goes
            client = None
    finally:
        gpu.close()
        if client is not None:
            client.close()
    res["summary"] = summary(res, a.slow)
    if stacks_root:
        await asyncio.sleep(0.6)  # every sampler notices the "end" window and flushes (0.25 s poll)
        res["stacks_kept"] = keep_stacks(res, stacks_root, a.stacks_json)
    return res


def _plain(obj: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(obj)


def summary(res: dict[str, Any], slow: float) -> dict[str, Any]:
    """Per workload: medians per mode, the SDK's worst against its median and against raw's worst; the
    passes slower than ``slow`` x their workload's median (all modes)."""
    out: dict[str, Any] = {}
    passes = [p for p in res["passes"] if "s" in p]

    def key(p: dict[str, Any]) -> str:  # an A/B run (--patch-after-step) is summarised per phase
        return (
            p["workload"]
            if res.get("patch_after_step") is None
            else f"{p['workload']}:{'fix' if p['patched'] else 'sglang'}"
        )

    for w in dict.fromkeys(key(p) for p in passes):
        mine = [p for p in passes if key(p) == w]
        med = statistics.median(p["s"] for p in mine)
        row: dict[str, Any] = {"median_s": round(med, 3)}
        for mode in ("raw", "sdk"):
            s = [p["s"] for p in mine if p["mode"] == mode]
            if s:
                row[mode] = {
                    "median_s": round(statistics.median(s), 3),
                    "max_s": round(max(s), 3),
                    "median_tok_s": round(statistics.median(p["tok_s"] for p in mine if p["mode"] == mode)),
                }
        if "raw" in row and "sdk" in row:
            row["sdk_worst_over_sdk_median"] = round(row["sdk"]["max_s"] / row["sdk"]["median_s"], 3)
            row["sdk_worst_over_raw_worst"] = round(row["sdk"]["max_s"] / row["raw"]["max_s"], 3)
            row["sdk_over_raw_median_tok_s"] = round(row["sdk"]["median_tok_s"] / row["raw"]["median_tok_s"], 3)
        row["slow_passes"] = [p["label"] for p in mine if p["s"] > slow * med]
        row["all_ok"] = all(p.get("ok") for p in mine)
        out[w] = row
    return out


def keep_stacks(res: dict[str, Any], root: str, path: str | None) -> list[str]:
    """The stack windows of the slow passes and, beside each, of the median pass of its workload and mode."""
    keep: list[str] = []
    passes = {p["label"]: p for p in res["passes"] if "s" in p}
    for row in res["summary"].values():
        for label in row["slow_passes"]:
            mode = passes[label]["mode"]
            wl = passes[label]["workload"]
            same = sorted(
                (p for p in passes.values() if p["workload"] == wl and p["mode"] == mode), key=lambda p: p["s"]
            )
            keep += [label, same[len(same) // 2]["label"]]
    if not keep:  # nothing slow: keep one normal pass per workload, to show what the sampler sees
        keep = [next(p["label"] for p in passes.values() if p["workload"] == w) for w in res["summary"] if ":" not in w]
    if res.get("plan"):  # an explicit plan is short: keep every pass
        keep += list(passes)
    elif res.get("patch_after_step") is not None:  # an A/B run: the long passes of both phases, side by side
        for patched in (False, True):
            for mode in ("sdk", "raw"):
                longs = [p for p in passes.values() if p["workload"] == "long" and p["mode"] == mode]
                keep += [p["label"] for p in longs if p["patched"] == patched][:1]
    keep = list(dict.fromkeys(keep))
    if path:
        spies = {}
        for name in sorted(os.listdir(root)):
            if name.endswith(".pyspy.txt"):
                with open(os.path.join(root, name)) as f:
                    spies[name[: -len(".pyspy.txt")]] = f.read()
        with open(path, "w") as f:
            json.dump({"windows": {label: _stacks.collect(root, label) for label in keep}, "py_spy": spies}, f)
    return keep


def table(res: dict[str, Any]) -> str:
    title = (
        f"soak: shape {res['shape']} ({res['engine']}), {len(res['passes'])} passes, engine start "
        f"{res.get('engine_start_s')} s, {res['date']}"
    )
    passes = [
        [
            p["label"],
            p.get("s", "-"),
            p.get("tok_s", "-"),
            p.get("gpu_util") or "-",
            p.get("lag_p99_ms") or "-",
            p.get("gc_s", "-"),
            "y" if p.get("patched") else "n",
            p.get("stalls", "-"),
            p.get("ok", p.get("error")),
        ]
        for p in res["passes"]
    ]
    header = ["pass", "s", "tok/s", "gpu%", "lag p99", "gc s", "fix", "stalls", "ok"]
    workloads = []
    for w, r in res["summary"].items():
        raw, sdk = r.get("raw", {}), r.get("sdk", {})
        workloads.append(
            [
                w,
                raw.get("median_s", "-"),
                raw.get("max_s", "-"),
                sdk.get("median_s", "-"),
                sdk.get("max_s", "-"),
                r.get("sdk_worst_over_sdk_median", "-"),
                r.get("sdk_worst_over_raw_worst", "-"),
                r.get("sdk_over_raw_median_tok_s", "-"),
                ",".join(r["slow_passes"]) or "-",
            ]
        )
    header2 = ["workload", "raw med s", "raw max s", "sdk med s", "sdk max s", "sdk max/med", "sdk max/raw max"]
    header2 += ["sdk/raw tok/s", "slow passes"]
    return "\n".join([title, harness.table(header, passes), harness.table(header2, workloads, left=(0, 8))])


def main() -> None:
    ap = harness.parser(__doc__, quick="tiny workloads (dry runs)")
    ap.add_argument("--shape", default="0.5b", choices=["0.5b", "7b"])
    ap.add_argument("--engine", default="sglang", choices=["sglang", "fake"])
    ap.add_argument("--steps", type=int, default=4, help="RL steps: each runs every workload raw and sdk")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS + EXTRA_WORKLOADS)
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--sampling", default="pytorch")
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--graph-bs", type=int, default=512)
    ap.add_argument("--max-total-tokens", type=int, default=0, help="the engine's KV pool (0: SGLang's choice)")
    ap.add_argument("--flush-passes", action="store_true", help="flush the prefix cache before every pass")
    ap.add_argument("--no-update-flush", dest="update_flush", action="store_false", help="updates keep the cache")
    ap.add_argument(
        "--patch-after-step", type=int, default=None, help="SGLang's own radix eviction before this step, ours after"
    )
    ap.add_argument("--plan", nargs="*", default=None, help='passes instead of --steps: "raw:long", "FIX", ...')
    ap.add_argument("--slow", type=float, default=1.5, help="a pass slower than this x its workload's median")
    ap.add_argument("--no-stacks", dest="stacks", action="store_false", help="no stack sampler")
    ap.add_argument("--stacks-json", default=None, help="where the slow passes' stacks go")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop after the step that passes this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    run = harness.loop_runner()
    if a.client:
        run(client_main(a))
        return
    stacks_root = None
    if a.stacks:
        stacks_root = tempfile.mkdtemp(prefix="soak-stacks-")
        boot = _stacks.install(stacks_root)
        os.environ["ROLLOUT_SDK_STACKS_DIR"] = stacks_root  # the client and SGLang's children inherit both
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (boot, os.environ.get("PYTHONPATH")) if p)
        _stacks.start()
    with harness.sigterm_as_interrupt():
        res = run(server_main(a, stacks_root))
    if a.json:
        write_json(a.json, res)
    print(table(res), flush=True)


if __name__ == "__main__":
    main()
