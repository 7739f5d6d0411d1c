"""The SGLang engine wrapper's request paths on a CPU: raw ``async_generate`` (SGLang's tokenizer manager, as
``sglang.Engine`` users call it) vs ``SglangEngine``'s direct path to the scheduler (engines/sglang/direct.py)
vs ``SglangEngine`` through the tokenizer manager, on one engine.

SGLang's real TokenizerManager and io_struct run here over a stand-in scheduler process
(engines/sglang/standin.py), so the event loop's per-request cost is SGLang's own code plus ours; only the
GPU work is missing.  Prints tokens/s and the event-loop process's CPU per request, medians of alternating
repetitions.  Needs sglang importable (see docs/benchmarks.md#sdk-vs-raw-sglang-and-sglangs-http-server).
``three_paths`` is also what ``bench/gpu_check.py`` runs on the GPU.

    python bench/sglang_path.py --model PATH [--requests 4000] [--inflight 512] [--max-new 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import harness

PATHS = ("raw", "direct", "tm")
LABELS = {"raw": "raw async_generate", "direct": "SglangEngine direct", "tm": "SglangEngine via TM"}


async def three_paths(
    engine: Any, prompts: list[list[int]], max_new: int, *, inflight: int, reps: int, modes: tuple[str, ...] = PATHS
) -> dict[str, list[tuple[float, float]]]:
    """Each of ``modes`` once per repetition, in turn, on one started ``SglangEngine`` with its direct path
    installed: ``raw`` is ``async_generate`` on the SGLang object it wraps, ``tm`` the engine with its direct
    path detached for the pass.  ``inflight`` workers keep the prompts going (temperature 1, ignore_eos,
    logprobs on); the prefix cache is flushed before every pass.  Per mode: (output tokens/s, CPU us of this
    process per request) per pass."""
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    direct = engine._path
    assert direct is not None, "the engine's direct path is not installed"
    raw = engine._engine
    sp_raw = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}
    sp = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}

    async def one(mode: str, tag: str, i: int, ids: list[int]) -> int:
        if mode == "raw":
            out = await raw.async_generate(input_ids=ids, sampling_params=sp_raw, return_logprob=True)
            return len(out["output_ids"])
        r = await engine.generate(GenerateRequest(rid=f"{tag}{i}", input_ids=ids, sampling=sp, return_logprobs=True))
        return len(r.output_ids)

    for rep in range(reps):
        for mode in modes:
            await engine.flush_cache()
            todo = iter(enumerate(prompts))
            tokens = 0

            async def worker(mode: str = mode, tag: str = f"p{rep}{mode}-", todo: Any = todo) -> None:
                nonlocal tokens
                for i, ids in todo:
                    n = await one(mode, tag, i, ids)  # awaited first: `tokens += await ...` loses updates
                    tokens += n

            engine._path = None if mode == "tm" else direct
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                await asyncio.gather(*(worker() for _ in range(min(inflight, len(prompts)))))
            finally:
                engine._path = direct
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert tokens == max_new * len(prompts), f"{mode}: {tokens} tokens for {len(prompts)} x {max_new}"
            rows[mode].append((tokens / wall, cpu / len(prompts) * 1e6))
    return rows


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig
    from rollout_sdk.engines.sglang.standin import StandinEngine, StandinScheduler

    sched = StandinScheduler(step_s=args.step_s, max_running=args.inflight)
    cfg = SglangEngineConfig(model_path=args.model, freeze_gc=True)
    engine = SglangEngine(cfg, launcher=StandinEngine.launcher(sched))
    await engine.start()
    prompts = [[(i * 31 + k) % 1000 + 1 for k in range(args.prompt_len)] for i in range(args.requests)]
    try:
        await three_paths(engine, prompts[:256], args.max_new, inflight=args.inflight, reps=1)  # warm-up
        if args.profile:
            import cProfile
            import pstats

            mode = next(m for m in PATHS if args.profile in (m, LABELS[m]))
            prof = cProfile.Profile()
            prof.enable()
            await three_paths(engine, prompts, args.max_new, inflight=args.inflight, reps=1, modes=(mode,))
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(35)
            return []
        rows = await three_paths(engine, prompts, args.max_new, inflight=args.inflight, reps=args.reps)
    finally:
        await engine.close()
    out = []
    raw_tok_s = harness.median(t for t, _ in rows["raw"])
    print(f"\n{'mode':24s} {'tok/s':>8s} {'vs raw':>7s} {'loop CPU us/req':>16s}   (medians of {args.reps})")
    for mode, vals in rows.items():
        tok_s = harness.median(t for t, _ in vals)
        us = harness.median(u for _, u in vals)
        print(f"{LABELS[mode]:24s} {tok_s:8.0f} {tok_s / raw_tok_s:7.2f} {us:16.0f}")
        out.append({"mode": LABELS[mode], "tok_s": tok_s, "vs_raw": tok_s / raw_tok_s, "cpu_us_per_req": us})
    return out


if __name__ == "__main__":
    ap = harness.parser(__doc__, reps=3)
    ap.add_argument("--model", required=True, help="a local model dir (its config and context length are read)")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--inflight", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=0.001, help="the stand-in scheduler's seconds per decode step")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", help="cProfile one mode (raw, direct or tm) instead of the table")
    a = ap.parse_args()
    res = harness.run(main(a))
    if a.json:
        harness.write_json(a.json, res, indent=1)
