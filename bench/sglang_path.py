"""The SGLang engine wrapper's request paths on a CPU: raw ``tokenizer_manager.generate_request`` (what
``sglang.Engine.async_generate`` does) vs ``SglangEngine`` through the tokenizer manager vs ``SglangEngine``'s
direct path to the scheduler (engines/sglang/direct.py).

SGLang's real TokenizerManager and io_struct run here over a stand-in scheduler process
(engines/sglang/standin.py), so the event loop's per-request cost is SGLang's own code plus ours; only the
GPU work is missing.  Prints wall req/s and the event-loop process's CPU per request, medians of
alternating repetitions.  Needs sglang importable (see docs/benchmarks.md "where the time goes").

    python bench/sglang_path.py --model PATH [--requests 4000] [--inflight 512] [--max-new 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any


async def _raw(tm: Any, prompts: list[list[int]], max_new: int, inflight: int) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    todo = iter(prompts)

    async def worker() -> None:
        for ids in todo:
            obj = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": max_new}, return_logprob=True)
            gen = tm.generate_request(obj, None)
            try:
                out = await gen.__anext__()
            finally:
                await gen.aclose()
            assert len(out["output_ids"]) == max_new

    await asyncio.gather(*(worker() for _ in range(inflight)))


async def _engine(eng: Any, prompts: list[list[int]], max_new: int, inflight: int, tag: str) -> None:
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=max_new)
    todo = iter(enumerate(prompts))

    async def worker() -> None:
        for i, ids in todo:
            out = await eng.generate(GenerateRequest(rid=f"{tag}{i}", input_ids=ids, sampling=sp, return_logprobs=True))
            assert len(out.output_ids) == max_new

    await asyncio.gather(*(worker() for _ in range(inflight)))


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
    from rollout_sdk.engines.sglang.standin import StandinEngine, StandinScheduler

    sched = StandinScheduler(step_s=args.step_s, max_running=args.inflight)
    engines = {}
    for path in ("direct", "tokenizer_manager"):
        cfg = SglangEngineConfig(model_path=args.model, request_path=path, freeze_gc=True)
        engines[path] = SglangEngine(cfg, launcher=StandinEngine.launcher(sched))
        await engines[path].start()
    prompts = [[(i * 31 + k) % 1000 + 1 for k in range(args.prompt_len)] for i in range(args.requests)]
    modes = {
        "raw async_generate": lambda t: _raw(engines["tokenizer_manager"].tm, prompts, args.max_new, args.inflight),
        "SglangEngine via TM": lambda t: _engine(engines["tokenizer_manager"], prompts, args.max_new, args.inflight, t),
        "SglangEngine direct": lambda t: _engine(engines["direct"], prompts, args.max_new, args.inflight, t),
    }
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    if args.profile:
        import cProfile
        import pstats

        name = next(m for m in modes if args.profile in m)
        await modes[name]("warm-")
        prof = cProfile.Profile()
        prof.enable()
        await modes[name]("prof-")
        prof.disable()
        for eng in engines.values():
            await eng.close()
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
        return []
    try:
        for rep in range(args.reps):
            for name, run in modes.items():
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                await run(f"{rep}-")
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                rows[name].append((args.requests / wall, cpu / args.requests * 1e6))
                rps, us = args.requests / wall, cpu / args.requests * 1e6
                print(f"  rep {rep} {name:22s} {rps:8.0f} req/s  {us:6.0f} us/req")
    finally:
        for eng in engines.values():
            await eng.close()
    out = []
    raw_rps = statistics.median(r for r, _ in rows["raw async_generate"])
    print(f"\n{'mode':24s} {'req/s':>8s} {'vs raw':>7s} {'loop CPU us/req':>16s}   (medians of {args.reps})")
    for name, vals in rows.items():
        rps = statistics.median(r for r, _ in vals)
        us = statistics.median(u for _, u in vals)
        print(f"{name:24s} {rps:8.0f} {rps / raw_rps:7.2f} {us:16.0f}")
        out.append({"mode": name, "req_s": rps, "vs_raw": rps / raw_rps, "cpu_us_per_req": us})
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local model dir (its config and context length are read)")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--inflight", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=0.001, help="the stand-in scheduler's seconds per decode step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", help="cProfile one mode (a part of its name, e.g. direct) instead of the table")
    a = ap.parse_args()
    try:
        import uvloop

        res = uvloop.run(main(a))
    except ImportError:
        res = asyncio.run(main(a))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
