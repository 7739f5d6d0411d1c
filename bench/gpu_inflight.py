"""Issue 41: weight updates with requests in flight, ``inflight="reprefill"`` (today's exact mode) against
``inflight="keep"``, in a fully asynchronous loop on one SGLang engine.

``--sessions`` workers each keep one request in flight for ``--duration-s`` seconds: a fresh random prompt of
``--prompt`` tokens, ``--max-new`` tokens (ignore_eos), then the next.  Every ``--every-s`` seconds the weights
change: a real update through the engine's update path (``update_weights_from_ipc``: checkpoint, CUDA IPC
bucket, version, continuation), with one small tensor (``model.norm.weight``) so the time measured is the
mechanism's, not a transfer's.  Right after each update a *probe* sends the prompt of a request that ran
before it (cached under the old weights): a stale prefix hit is a probe with ``cached_tokens > 0``.

Per pass: output tokens/s over the loop, prompt tokens re-prefilled per update (continuations' computed
prompt: engine.reprefilled_tokens), the update call's time, stale hits, and inter-token gaps: every token's
arrival is recorded on the engine's direct path (``SGLANG_FORCE_STREAM_INTERVAL=1`` so each step reports;
both modes pay it alike), the gap of a token is the time since the previous token of the same request (across
its parts), and "around an update" means tokens arriving from the update's start to 2 s after its end.

Passes alternate reprefill/keep, ``--reps`` each, one engine start, warm (no flush between passes; the
namespaces keep them apart).  ``--engine standin --quick`` runs it on a CPU (SGLang's tokenizer manager over
the stand-in scheduler; the IPC update is replaced by the engine's own quiesce + finish path there).

    python bench/gpu_inflight.py --shape 7b --reps 3 --json out.json
    python bench/gpu_inflight.py --engine standin --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Tracker:
    """Token arrival times per request, across its parts (direct path hook)."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.rid_of: dict[str, str] = {}
        self.last: dict[str, float] = {}
        self.gaps: list[tuple[float, float]] = []  # (arrival, gap)
        tm = eng._tm
        orig_batch = tm._handle_batch_output  # the direct path's hook (it passes foreign rids on)
        orig_submit = eng._submit
        tracker = self

        async def on_batch(recv: Any) -> None:
            now = time.perf_counter()
            rids = getattr(recv, "rids", None) or []
            outs = getattr(recv, "output_ids", None) or []
            for i, sid in enumerate(rids):
                rid = tracker.rid_of.get(sid)
                if rid is None or i >= len(outs) or not outs[i]:
                    continue
                k = len(outs[i])
                prev = tracker.last.get(rid)
                if prev is not None:
                    g = (now - prev) / k
                    tracker.gaps.extend([(now, g)] * k)
                tracker.last[rid] = now
            await orig_batch(recv)

        def submit(sid: str, inputs: Any, sp: Any, req: Any, **kw: Any) -> Any:
            tracker.rid_of[sid] = req.rid
            return orig_submit(sid, inputs, sp, req, **kw)

        tm._handle_batch_output = on_batch
        eng._submit = submit

    def forget(self, rid: str) -> None:
        self.last.pop(rid, None)


async def update(a: argparse.Namespace, eng: Any, version: int, inflight: str, norm: Any) -> float:
    """One real update of the engine's weights (SGLang: CUDA IPC; the stand-in: the engine's own quiesce and
    finish path, as tests/test_sglang_direct.py drives it)."""
    t0 = time.perf_counter()
    if a.engine == "standin":
        async with eng._control._quiesced():
            await eng._control._finish_update(version, False, inflight)
    else:
        from rollout_sdk.protocol import UpdateWeightsFromIpc
        from rollout_sdk.weights.buckets import plan_buckets
        from rollout_sdk.weights.ipc import export_cuda_ipc

        bucket = plan_buckets([("model.norm.weight", norm)], 1 << 30)[0]
        flat = bucket.flatten()
        msg = UpdateWeightsFromIpc(
            call_id=f"u{version}",
            handles=[export_cuda_ipc(flat)],
            buckets=[bucket.metas],
            version=version,
            flush_cache=inflight == "reprefill" and a.flush,
            inflight=inflight,  # type: ignore[arg-type]
        )
        await eng.update_weights_from_ipc(msg)
    return time.perf_counter() - t0


async def one_pass(a: argparse.Namespace, eng: Any, tr: Tracker, inflight: str, rep: int, vocab: int) -> dict[str, Any]:
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    rnd = random.Random(f"{inflight}-{rep}")
    stop = asyncio.Event()
    produced = 0
    done_reqs = 0
    recent: list[list[int]] = []  # prompts that ran before an update (probe material)
    sp = SamplingParams(max_new_tokens=a.max_new, ignore_eos=True, temperature=1.0)
    n = 0

    async def worker(w: int) -> None:
        nonlocal produced, done_reqs, n
        while not stop.is_set():
            n += 1
            prompt = [rnd.randrange(10, vocab - 10) for _ in range(a.prompt)]
            rid = f"{inflight}{rep}-{w}-{n}"
            recent.append(prompt)
            del recent[:-256]
            task = asyncio.ensure_future(eng.generate(GenerateRequest(rid=rid, input_ids=prompt, sampling=sp)))
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                eng.abort(rid)
            stopper.cancel()
            out = await task
            produced += len(out.output_ids)
            done_reqs += 1
            tr.forget(rid)

    # probe material: one prompt per update, prefilled now (cached under the weights the pass starts on) and
    # never sent again until its update's probe; a control probe shows that a probe can see a hit
    n_updates = int(a.duration_s // a.every_s) + 1
    seeds = [[rnd.randrange(10, vocab - 10) for _ in range(a.prompt)] for _ in range(n_updates + 1)]
    one = SamplingParams(max_new_tokens=1)
    await asyncio.gather(
        *(
            eng.generate(GenerateRequest(rid=f"seed{rep}{inflight}{i}", input_ids=p, sampling=one))
            for i, p in enumerate(seeds)
        )
    )
    control = await eng.generate(GenerateRequest(rid=f"ctl{rep}{inflight}", input_ids=seeds[-1], sampling=one))
    probes: list[tuple[int, Any]] = []
    base_reprefill = eng.reprefilled_tokens
    t0 = time.perf_counter()
    workers = [asyncio.create_task(worker(w)) for w in range(a.sessions)]
    updates: list[dict[str, Any]] = []
    windows: list[tuple[float, float]] = []
    version = eng.weight_version
    import_norm = None
    if a.engine != "standin":
        import torch

        import_norm = torch.ones(a.hidden, dtype=torch.bfloat16, device="cuda")
    k = 0
    while True:
        k += 1
        at = t0 + k * a.every_s
        if at >= t0 + a.duration_s:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        # a prompt that ran before this update, cached under the old weights
        before = eng.reprefilled_tokens
        version += 1
        u0 = time.perf_counter()
        took = await update(a, eng, version, inflight, import_norm)
        windows.append((u0, time.perf_counter() + 2.0))
        row: dict[str, Any] = {
            "version": version,
            "took_s": round(took, 4),
            "reprefilled": eng.reprefilled_tokens - before,
        }
        probe = eng.generate(GenerateRequest(rid=f"probe{rep}{inflight}{k}", input_ids=seeds[k - 1], sampling=one))
        probes.append((len(updates), asyncio.ensure_future(probe)))
        updates.append(row)
        log(f"  {inflight} rep {rep} update {k}: {row} (probe pending)")
    await asyncio.sleep(max(0.0, t0 + a.duration_s - time.perf_counter()))
    stop.set()
    await asyncio.gather(*workers)
    wall = time.perf_counter() - t0
    for i, fut in probes:
        updates[i]["probe_cached"] = (await fut).cached_tokens
    # the reprefill counter may still move while the last continuations end: take it after the workers
    gaps_all = [g for t, g in tr.gaps if t0 <= t]
    around = [g for t, g in tr.gaps if any(lo <= t <= hi for lo, hi in windows)]
    tr.gaps.clear()
    res = {
        "inflight": inflight,
        "rep": rep,
        "wall_s": round(wall, 2),
        "tokens": produced,
        "tok_s": round(produced / wall, 1),
        "requests": done_reqs,
        "updates": updates,
        "reprefilled_per_update": round((eng.reprefilled_tokens - base_reprefill) / max(1, len(updates))),
        "update_s_median": round(statistics.median([u["took_s"] for u in updates]), 4) if updates else None,
        "stale_hits": sum(1 for u in updates if u.get("probe_cached", 0) > 0),
        "control_probe_cached": control.cached_tokens,
        "gap_p50_ms": round(1000 * (pct(gaps_all, 0.5) or 0), 2),
        "gap_p99_ms": round(1000 * (pct(gaps_all, 0.99) or 0), 2),
        "gap_p99_around_update_ms": round(1000 * (pct(around, 0.99) or 0), 2),
        "gap_max_around_update_ms": round(1000 * (max(around) if around else 0), 2),
    }
    log(f"pass {inflight} rep {rep}: " + json.dumps({k: v for k, v in res.items() if k != "updates"}))
    return res


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig

    if a.engine == "standin":
        from rollout_sdk.engines.sglang.standin import StandinEngine, StandinScheduler
        from rollout_sdk.models import ensure_tiny_model

        model = str(await asyncio.to_thread(ensure_tiny_model))
        eng = SglangEngine(
            SglangEngineConfig(model_path=model, freeze_gc=False, decode_window=None),
            launcher=StandinEngine.launcher(StandinScheduler(step_s=0.002, max_running=4096)),
        )
        vocab = 151000
    else:
        import gpu_check

        model = gpu_check.model_dir(a.shape)
        eng = SglangEngine(
            SglangEngineConfig(
                model_path=model,
                load_format="dummy",
                attention_backend=a.attn,
                sampling_backend="pytorch",
                mem_fraction_static=a.mem_fraction,
                cuda_graph_max_bs=a.graph_bs,
                random_seed=0,
                extra={"disable_prefill_cuda_graph": True, "max_total_tokens": a.max_total_tokens},
            )
        )
        vocab = 151000
    t0 = time.perf_counter()
    await eng.start()
    log(f"engine ready in {time.perf_counter() - t0:.1f}s")
    tr = Tracker(eng)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "shape": a.shape,
        "engine": a.engine,
        "passes": [],
    }
    deadline = time.perf_counter() + a.budget_s
    try:
        # warm-up (CUDA graphs, allocator): a short pass not counted
        for rep in range(a.reps):
            for inflight in ("reprefill", "keep") if rep % 2 == 0 else ("keep", "reprefill"):
                if time.perf_counter() + a.duration_s + 30 > deadline:
                    log("budget reached")
                    raise StopIteration
                res["passes"].append(await one_pass(a, eng, tr, inflight, rep, vocab))
                if a.json:
                    write(a.json, res)
    except StopIteration:
        pass
    finally:
        await eng.close()
    res["summary"] = summary(res["passes"])
    return res


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("reprefill", "keep"):
        ps = [p for p in passes if p["inflight"] == mode]
        if not ps:
            continue
        out[mode] = {
            k: statistics.median([p[k] for p in ps])
            for k in (
                "tok_s",
                "reprefilled_per_update",
                "update_s_median",
                "stale_hits",
                "gap_p99_ms",
                "gap_p99_around_update_ms",
                "gap_max_around_update_ms",
            )
            if all(p.get(k) is not None for p in ps)
        }
        out[mode]["reps"] = len(ps)
    if "reprefill" in out and "keep" in out and out["reprefill"].get("tok_s"):
        out["keep_over_reprefill_tok_s"] = round(out["keep"]["tok_s"] / out["reprefill"]["tok_s"], 3)
    return out


def write(path: str, res: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", choices=["0.5b", "7b"])
    ap.add_argument("--engine", default="sglang", choices=["sglang", "standin"])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU dry run)")
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--flush", type=int, default=0, help="reprefill passes also flush (0: the namespace alone)")
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--max-total-tokens", type=int, default=1_600_000)
    ap.add_argument("--graph-bs", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=0, help="model.norm.weight size (default: the shape's)")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.sessions, a.prompt, a.max_new, a.duration_s, a.every_s, a.reps = 16, 64, 400, 4.0, 1.0, 1
    if not a.hidden:
        a.hidden = 3584 if a.shape == "7b" else 896
    os.environ.setdefault("SGLANG_FORCE_STREAM_INTERVAL", "1")  # every token's arrival (module docstring)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    res = run(main_async(a))
    if a.json:
        write(a.json, res)
    print(json.dumps(res["summary"], indent=1), flush=True)


if __name__ == "__main__":
    main()
