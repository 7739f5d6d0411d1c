"""The whole GPU check of the SGLang backend in one process, one engine start per shape; a table last.

    python bench/gpu_check.py --shape 0.5b --json $OUT/check-0.5b.json
    python bench/gpu_check.py --shape 7b --requests 1024 --weights-backend gloo --json $OUT/check-7b.json
    python bench/gpu_check.py --shape 0.5b --tp 2            # on nvidia-h200-x2

For one dummy-weight Qwen2.5-shaped model it measures, in order:

1. engine start (SglangEngine behind an EngineServer; sglang import + load + CUDA graphs);
2. throughput of N requests x in_len random prompt tokens x out_len new tokens (temperature 1,
   ignore_eos, logprobs on), side by side: *raw* ``sglang.Engine.async_generate`` + ``asyncio.gather`` on
   the very engine the server wraps, then the same workload through RolloutClient -> ZMQ -> server ->
   SGLang; output tokens/s of each and the ratio;
3. correctness: every request answered with out_len tokens and as many finite logprobs;
4. abort: 64 long requests in flight, all cancelled: time until the server holds none; and pause('abort')
   returning partial tokens;
5. weight updates: distributed (a weight group between this process and the engine, flattened buckets)
   and colocated CUDA IPC, full-model time and bytes; each proven by zeroing ``model.norm.weight`` (greedy
   output becomes token 0) and restoring it;
6. sleep/wake: release_memory / resume_memory times with the free GPU memory before and after, then the
   same greedy output as before release;
7. (unless --no-trainer-checks) per update path: 100 requests in flight across an update with pause='hold'
   and with no pause all complete with exact (old, new) version segments; wrong name / wrong shape / a bad
   tensor beside a good one are refused with applied=False and the old weights keep serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_path  # bench/sglang_path.py: the three request paths, side by side

# the dummy-weight model (bench/peers/shapes.py), here too for the scripts and tests that import it from here
from peers.shapes import SHAPES, dummy_engine_config, hf_named, model_dir

__all__ = ["SHAPES", "dummy_engine_config", "hf_named", "model_dir"]


def _to_cpu(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(n, t.cpu()) for n, t in named]


def free_gib() -> float:
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    return free / 2**30


async def path_checks(engine: Any, vocab: int, n: int) -> dict[str, Any]:
    """The engine's direct path to the scheduler (engines/sglang/direct.py) against its tokenizer-manager
    path on the same engine: greedy ids and logprobs of the same prompts, score logprobs, then ``n`` short
    requests (64 in / 16 out) through raw ``async_generate``, the direct path and the tokenizer manager, with
    this process's CPU per request (the event loop the tokenizer manager and the server share)."""
    from rollout_sdk import GenerateRequest, SamplingParams

    direct = engine._path
    out: dict[str, Any] = {"installed": direct is not None}
    if direct is None:
        return out
    rnd = random.Random(7)
    prompts = [[rnd.randrange(1000, vocab - 1000) for _ in range(96)] for _ in range(64)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    got: dict[str, list[Any]] = {}
    for name, path in (("direct", direct), ("tm", None)):
        engine._path = path
        try:
            got[name] = await asyncio.gather(
                *(
                    engine.generate(
                        GenerateRequest(rid=f"pp-{name}-{i}", input_ids=p, sampling=greedy, return_logprobs=True)
                    )
                    for i, p in enumerate(prompts)
                )
            )
            got[name + "-score"] = await asyncio.gather(
                *(
                    engine.generate(GenerateRequest(rid=f"ps-{name}-{i}", input_ids=p, score_only=True))
                    for i, p in enumerate(prompts[:16])
                )
            )
        finally:
            engine._path = direct
    same = [a.output_ids == b.output_ids for a, b in zip(got["direct"], got["tm"], strict=True)]
    first = [a.output_ids[:1] == b.output_ids[:1] for a, b in zip(got["direct"], got["tm"], strict=True)]
    lp = [
        abs(x - y)
        for a, b in zip(got["direct"], got["tm"], strict=True)
        if a.output_ids == b.output_ids
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True)
    ]
    sc = [
        abs(x - y)
        for a, b in zip(got["direct-score"], got["tm-score"], strict=True)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True)
    ]
    out.update(
        same_greedy_ids=round(sum(same) / len(same), 3),
        same_first_token=round(sum(first) / len(first), 3),
        greedy_logprob_max_diff=round(max(lp), 5) if lp else None,
        score_logprob_max_diff=round(max(sc), 5) if sc else None,
        finish=sorted({r.finish_reason for r in got["direct"]}),
    )
    short = [[rnd.randrange(1000, vocab - 1000) for _ in range(64)] for _ in range(n)]
    rows = await sglang_path.three_paths(engine, short, 16, inflight=n, reps=2)
    for name, v in rows.items():
        out[f"short_{name}_tok_s"] = round(max(t for t, _ in v))
        out[f"short_{name}_cpu_us_per_req"] = round(min(u for _, u in v))
    return out


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rollout_sdk import (
        EngineServer,
        GenerateRequest,
        RolloutClient,
        SamplingParams,
        ServerConfig,
        WeightUpdateError,
    )
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig

    res: dict[str, Any] = {
        "shape": a.shape,
        "tp": a.tp,
        "requests": a.requests,
        "in_len": a.in_len,
        "out_len": a.out_len,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    cfg = SglangEngineConfig(
        model_path=model_dir(a.shape),
        tp_size=a.tp,
        load_format="dummy",
        attention_backend=a.attn,
        sampling_backend=a.sampling,
        mem_fraction_static=a.mem_fraction,
        cuda_graph_max_bs=512,
        random_seed=0,
        request_path=a.request_path,
        extra={"disable_prefill_cuda_graph": True},
    )
    engine = SglangEngine(cfg)
    server = EngineServer(engine, ServerConfig(server_id=f"{a.shape}-tp{a.tp}", drain_timeout_s=5))
    t0 = time.perf_counter()
    async with server:
        res["start_s"] = round(time.perf_counter() - t0, 1)
        print(f"[check] engine ready in {res['start_s']}s: {engine.limits}", flush=True)
        raw_engine = engine._engine
        rnd = random.Random(0)
        vocab = engine.limits.vocab_size
        prompts = [[rnd.randrange(1000, vocab - 1000) for _ in range(a.in_len)] for _ in range(a.requests)]
        sp_raw = {"max_new_tokens": a.out_len, "temperature": 1.0, "ignore_eos": True}
        sp = SamplingParams(max_new_tokens=a.out_len, temperature=1.0, ignore_eos=True)
        async with RolloutClient(servers=[server.address], max_in_flight_per_server=100_000) as client:

            async def raw_pass(ps: list[list[int]]) -> tuple[list[Any], float]:
                t = time.perf_counter()
                outs = await asyncio.gather(
                    *(raw_engine.async_generate(input_ids=p, sampling_params=sp_raw, return_logprob=True) for p in ps)
                )
                return outs, time.perf_counter() - t

            async def sdk_pass(ps: list[list[int]]) -> tuple[list[Any], float]:
                t = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(GenerateRequest(input_ids=p, sampling=sp)) for p in ps))
                return outs, time.perf_counter() - t

            await raw_pass(prompts[:64])
            sdk_outs, _ = await sdk_pass(prompts[:64])
            rows = []
            for rep in range(a.repeats):
                raw_outs, raw_dt = await raw_pass(prompts)
                sdk_outs, sdk_dt = await sdk_pass(prompts)
                raw_tok = sum(len(o["output_ids"]) for o in raw_outs)
                sdk_tok = sum(len(r.output_ids) for r in sdk_outs)
                rows.append(
                    {
                        "rep": rep,
                        "raw_s": round(raw_dt, 2),
                        "raw_tok_s": round(raw_tok / raw_dt),
                        "sdk_s": round(sdk_dt, 2),
                        "sdk_tok_s": round(sdk_tok / sdk_dt),
                        "ratio": round((sdk_tok / sdk_dt) / (raw_tok / raw_dt), 3),
                    }
                )
                print(f"[check] throughput {rows[-1]}", flush=True)
            res["throughput"] = rows
            ok = all(
                len(r.output_ids) == a.out_len
                and r.logprobs is not None
                and len(r.logprobs) == a.out_len
                and all(math.isfinite(x) for x in r.logprobs)
                for r in sdk_outs
            )
            res["all_answered"] = len(sdk_outs) == (a.requests if a.repeats else 64) and ok
            if a.path_checks:
                res["paths"] = await path_checks(engine, vocab, a.path_requests)
                print(f"[check] request paths {res['paths']}", flush=True)

            # -- abort ---------------------------------------------------------------------------
            long_sp = SamplingParams(max_new_tokens=8000, ignore_eos=True)
            tasks = [asyncio.create_task(client.generate(p[:64], sampling=long_sp)) for p in prompts[:64]]
            await asyncio.sleep(2.0)
            t = time.perf_counter()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while (await client.servers[0].fetch_stats()).in_flight:
                await asyncio.sleep(0.005)
            res["abort_64_s"] = round(time.perf_counter() - t, 3)
            tasks = [asyncio.create_task(client.generate(p[:64], sampling=long_sp)) for p in prompts[:16]]
            await asyncio.sleep(1.5)
            t = time.perf_counter()
            await client.pause("abort")
            partial = await asyncio.gather(*tasks)
            res["pause_abort_s"] = round(time.perf_counter() - t, 3)
            res["pause_abort_partial"] = all(
                r.finish_reason == "abort" and 0 < len(r.output_ids) < 8000 for r in partial
            )
            await client.resume()
            print(
                f"[check] abort 64: {res['abort_64_s']}s; pause(abort): {res['pause_abort_s']}s "
                f"partial={res['pause_abort_partial']}",
                flush=True,
            )

            # -- weights -------------------------------------------------------------------------
            probe_sp = SamplingParams(temperature=0.0, max_new_tokens=8)
            probe = prompts[0][:32]

            async def greedy() -> list[int]:
                return (await client.generate(probe, sampling=probe_sp)).output_ids

            before = await greedy()
            named = await asyncio.to_thread(hf_named, a.shape, a.trainer_device)
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            res["weights_gib"] = round(nbytes / 2**30, 2)
            norm = next(t for n, t in named if n == "model.norm.weight")
            w: dict[str, Any] = {}
            if a.weights_backend != "none":
                dev = a.trainer_device if a.weights_backend == "nccl" else "cpu"
                named_src = named if dev != "cpu" else await asyncio.to_thread(_to_cpu, named)
                t = time.perf_counter()
                await client.init_weight_sync(backend=a.weights_backend, device=dev if dev != "cpu" else None)
                w["dist_init_s"] = round(time.perf_counter() - t, 2)
                st = await client.update_weights(named_src, version=1, bucket_bytes=a.bucket_mb << 20)
                w["dist_update_s"] = round(st["seconds"], 2)
                w["dist_gbps"] = round(st["bytes"] / st["seconds"] / 1e9, 2)
                for mb in a.bucket_sweep:  # the same full update with other bucket sizes
                    st = await client.update_weights(
                        named_src, version=client.weight_version + 1, bucket_bytes=mb << 20
                    )
                    w.setdefault("dist_sweep", {})[mb] = {"s": round(st["seconds"], 3), "buckets": int(st["buckets"])}
                    print(f"[check] distributed bucket {mb} MiB: {w['dist_sweep'][mb]}", flush=True)
                zero = [("model.norm.weight", torch.zeros_like(norm).to(dev))]
                await client.update_weights(zero, version=2)
                w["dist_zero_norm_greedy"] = await greedy()
                await client.update_weights([("model.norm.weight", norm.to(dev))], version=3)
                w["dist_applied"] = w["dist_zero_norm_greedy"] == [0] * 8 and (await greedy()) != [0] * 8
                if a.trainer_checks:
                    res["trainer_distributed"] = await trainer_checks(
                        client, prompts, norm.to(dev), "distributed", greedy
                    )
                await client.close_weight_sync()
                print(f"[check] distributed weights {w}", flush=True)
            if a.ipc and a.tp > 1:  # refused up front (one handle per TP rank would be needed)
                try:
                    await client.update_weights(named[:1], version=client.weight_version + 1, method="ipc")
                    w["ipc_tp_refused"] = "accepted"
                except WeightUpdateError as exc:
                    w["ipc_tp_refused"] = {"applied": exc.applied, "message": str(exc)}
                w["ipc_tp_engine_alive"] = (await greedy()) is not None and client.servers[0].alive
                print(f"[check] ipc with tp={a.tp}: {w['ipc_tp_refused']} alive={w['ipc_tp_engine_alive']}", flush=True)
            elif a.ipc:
                if str(norm.device) != "cuda:0":  # colocated: the trainer's tensors on the engine's GPU
                    named = [(n, t.to("cuda:0")) for n, t in named]
                    norm = next(t for n, t in named if n == "model.norm.weight")
                st = await client.update_weights(
                    named, version=client.weight_version + 1, method="ipc", bucket_bytes=a.bucket_mb << 20
                )
                w["ipc_update_s"] = round(st["seconds"], 2)
                w["ipc_gbps"] = round(st["bytes"] / st["seconds"] / 1e9, 2)
                for mb in a.bucket_sweep:
                    st = await client.update_weights(
                        named, version=client.weight_version + 1, method="ipc", bucket_bytes=mb << 20
                    )
                    w.setdefault("ipc_sweep", {})[mb] = round(st["seconds"], 3)
                    print(f"[check] ipc bucket {mb} MiB: {w['ipc_sweep'][mb]} s", flush=True)
                await client.update_weights(
                    [("model.norm.weight", torch.zeros_like(norm))], version=client.weight_version + 1, method="ipc"
                )
                w["ipc_zero_norm_greedy"] = await greedy()
                await client.update_weights(
                    [("model.norm.weight", norm)], version=client.weight_version + 1, method="ipc"
                )
                w["ipc_applied"] = w["ipc_zero_norm_greedy"] == [0] * 8 and (await greedy()) != [0] * 8
                if a.trainer_checks:
                    res["trainer_ipc"] = await trainer_checks(client, prompts, norm, "ipc", greedy)
                print(f"[check] ipc weights {w}", flush=True)
            res["weights"] = w
            after_update = await greedy()
            res["greedy_changed_by_update"] = after_update != before
            del named, norm
            torch.cuda.empty_cache()

            # -- sleep / wake ----------------------------------------------------------------------
            m: dict[str, Any] = {"free_before_gib": round(free_gib(), 1)}
            t = time.perf_counter()
            await client.release_memory()
            m["release_s"] = round(time.perf_counter() - t, 2)
            m["free_released_gib"] = round(free_gib(), 1)
            t = time.perf_counter()
            await client.resume_memory()
            m["resume_s"] = round(time.perf_counter() - t, 2)
            m["free_resumed_gib"] = round(free_gib(), 1)
            m["same_greedy_after_wake"] = (await greedy()) == after_update
            # the colocated step: hold in-flight requests, free the GPU for training, wake, continue them
            held_sp = SamplingParams(max_new_tokens=512, ignore_eos=True)
            held = [asyncio.ensure_future(client.generate(p[:64], sampling=held_sp)) for p in prompts[:32]]
            await asyncio.sleep(0.5)
            await client.pause("hold")
            await client.release_memory()
            m["free_released_while_held_gib"] = round(free_gib(), 1)
            await client.resume_memory()
            await client.resume()
            done = await asyncio.gather(*held)
            m["held_across_release_complete"] = sum(len(r.output_ids) == 512 for r in done)
            res["memory"] = m
            print(f"[check] memory {m}", flush=True)
            res["weight_version_reported"] = (await client.generate(probe, sampling=probe_sp)).weight_version
    return res


async def trainer_checks(client: Any, prompts: list[list[int]], norm: Any, method: str, greedy: Any) -> dict[str, Any]:
    """Issue 7's checks on SGLang: updates under 100 in-flight requests (held, and unpaused) lose none and
    tag exact version segments; refused updates (wrong name, wrong shape, a bad tensor beside a good one)
    raise WeightUpdateError(applied=False) and the old weights keep serving; a good update still applies."""
    import torch

    from rollout_sdk import SamplingParams, WeightUpdateError

    out: dict[str, Any] = {}
    n, length = 100, 1024
    sp = SamplingParams(max_new_tokens=length, temperature=1.0, ignore_eos=True)
    version = client.weight_version
    for pause in ("hold", None):
        old = client.weight_version
        version += 1
        tasks = [asyncio.ensure_future(client.generate(p[:128], sampling=sp)) for p in prompts[:n]]
        await asyncio.sleep(1.0)
        t = time.perf_counter()
        await client.update_weights([("model.norm.weight", norm)], version=version, method=method, pause=pause)
        upd = time.perf_counter() - t
        res = await asyncio.gather(*tasks)
        full = sum(
            len(r.output_ids) == length and r.finish_reason == "length" and len(r.logprobs or []) == length for r in res
        )
        spans = sum(
            len(r.version_segments) == 2
            and r.version_segments[0][0] == old
            and r.version_segments[1][0] == version
            and sum(k for _, k in r.version_segments) == length
            for r in res
        )
        key = f"update_{pause or 'unpaused'}"
        out[key] = {"requests": n, "complete": full, "span_both_versions": spans, "update_s": round(upd, 3)}
        out[key]["ok"] = full == n and spans == n
        print(f"[check] {method} {key}: {out[key]}", flush=True)

    before = await greedy()
    hidden = norm.shape[0]
    bad = {
        "wrong_name": [("model.layers.0.mlp.not_a_param.weight", torch.zeros(8, dtype=norm.dtype, device=norm.device))],
        "wrong_shape": [("model.norm.weight", torch.zeros(hidden + 1, dtype=norm.dtype, device=norm.device))],
        "good_beside_bad": [
            ("model.norm.weight", torch.zeros_like(norm)),
            ("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3, dtype=norm.dtype, device=norm.device)),
        ],
    }
    for name, named in bad.items():
        try:
            await client.update_weights(named, version=999, method=method)
            got: Any = "accepted"
        except WeightUpdateError as exc:
            got = {"applied": exc.applied, "message": str(exc)[:200]}
        kept = (await greedy()) == before
        out[f"refused_{name}"] = {"error": got, "old_weights_serve": kept}
        out[f"refused_{name}"]["ok"] = isinstance(got, dict) and got["applied"] is False and kept
        print(f"[check] {method} refused {name}: {out[f'refused_{name}']}", flush=True)
    version += 1
    await client.update_weights([("model.norm.weight", torch.zeros_like(norm))], version=version, method=method)
    zero = await greedy()
    version += 1
    await client.update_weights([("model.norm.weight", norm)], version=version, method=method)
    r = await client.generate(prompts[0][:32], sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    out["good_update_after_refusals"] = zero == [0] * 8 and r.output_ids == before
    out["version_tagged"] = r.weight_version == version and r.version_segments == [(version, 8)]
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict)) and out["good_update_after_refusals"]
    out["ok"] = out["ok"] and out["version_tagged"]
    print(f"[check] {method} trainer checks ok={out['ok']}", flush=True)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [
        f"GPU check: {res['shape']} tp={res['tp']} ({res['requests']} req x {res['in_len']} in x "
        f"{res['out_len']} out), {res['date']}",
        f"  engine start                 {res['start_s']} s",
    ]
    lines += [
        f"  throughput rep {r['rep']}: raw {r['raw_tok_s']} tok/s ({r['raw_s']} s)  "
        f"sdk {r['sdk_tok_s']} tok/s ({r['sdk_s']} s)  sdk/raw {r['ratio']}"
        for r in res["throughput"]
    ]
    lines += [
        f"  all answered, lengths+logprobs ok  {res['all_answered']}",
        f"  cancel 64 in flight -> idle  {res['abort_64_s']} s",
        f"  pause(abort) -> partials     {res['pause_abort_s']} s  ok={res['pause_abort_partial']}",
    ]
    pp = res.get("paths")
    if pp and pp.get("installed"):
        lines += [
            f"  direct vs TM path: same greedy ids {pp['same_greedy_ids']}, same first token "
            f"{pp['same_first_token']}, max |d logprob| greedy {pp['greedy_logprob_max_diff']} "
            f"score {pp['score_logprob_max_diff']}",
            "  short requests, tok/s (loop CPU us/req): "
            + ", ".join(
                f"{k} {pp[f'short_{k}_tok_s']} ({pp[f'short_{k}_cpu_us_per_req']})" for k in ("raw", "direct", "tm")
            ),
        ]
    elif pp is not None:
        lines.append("  direct path NOT installed (requests went through the tokenizer manager)")
    w = res.get("weights", {})
    if "dist_update_s" in w:
        lines.append(
            f"  weights distributed          {res['weights_gib']} GiB in {w['dist_update_s']} s "
            f"({w['dist_gbps']} GB/s), applied={w['dist_applied']}"
        )
    if "ipc_update_s" in w:
        lines.append(
            f"  weights colocated (IPC)      {res['weights_gib']} GiB in {w['ipc_update_s']} s "
            f"({w['ipc_gbps']} GB/s), applied={w['ipc_applied']}"
        )
    if "ipc_tp_refused" in w:
        lines.append(
            f"  weights IPC with tp={res['tp']}          refused: {w['ipc_tp_refused']}; "
            f"engine still serving={w['ipc_tp_engine_alive']}"
        )
    m = res.get("memory", {})
    if m:
        lines.append(
            f"  release/resume memory        {m['release_s']} s / {m['resume_s']} s; free GiB "
            f"{m['free_before_gib']} -> {m['free_released_gib']} -> {m['free_resumed_gib']}; "
            f"same greedy after wake={m['same_greedy_after_wake']}"
        )
        lines.append(
            f"  hold 32 -> release -> resume: {m.get('held_across_release_complete')}/32 complete "
            f"(free while held {m.get('free_released_while_held_gib')} GiB)"
        )
    lines.append(f"  weight version in results    {res.get('weight_version_reported')}")
    for method in ("distributed", "ipc"):
        tc = res.get(f"trainer_{method}")
        if not tc:
            continue
        for k in ("update_hold", "update_unpaused"):
            v = tc[k]
            lines.append(
                f"  {method:11s} {k:16s} {v['complete']}/{v['requests']} complete, {v['span_both_versions']} "
                f"with exact v_old/v_new segments, update {v['update_s']} s  ok={v['ok']}"
            )
        for k in ("refused_wrong_name", "refused_wrong_shape", "refused_good_beside_bad"):
            v = tc[k]
            applied = v["error"]["applied"] if isinstance(v["error"], dict) else v["error"]
            lines.append(f"  {method:11s} {k:24s} applied={applied} old weights serve={v['old_weights_serve']}")
        lines.append(
            f"  {method:11s} good update after refusals={tc['good_update_after_refusals']} "
            f"version tagged={tc['version_tagged']}  ALL ok={tc['ok']}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b", choices=SHAPES)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--in-len", type=int, default=512)
    ap.add_argument("--out-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--sampling", default="pytorch")
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--weights-backend", default="gloo", choices=["gloo", "nccl", "none"])
    ap.add_argument("--trainer-device", default="cuda:0")
    ap.add_argument("--no-ipc", dest="ipc", action="store_false")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--no-trainer-checks", dest="trainer_checks", action="store_false")
    ap.add_argument("--bucket-sweep", type=int, nargs="*", default=[], help="also time full updates at these MiB")
    ap.add_argument("--request-path", default="direct", choices=["direct", "tokenizer_manager"])
    ap.add_argument("--no-path-checks", dest="path_checks", action="store_false")
    ap.add_argument("--path-requests", type=int, default=8192, help="short requests per path in the path checks")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import uvloop

    res = uvloop.run(run(a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res), flush=True)


if __name__ == "__main__":
    main()
