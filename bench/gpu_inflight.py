"""Issue 41: weight updates with requests in flight, ``inflight="reprefill"`` (today's exact mode) against
``inflight="keep"``, in a fully asynchronous loop on one SGLang engine.

First an exactness check per mode (``--check``): greedy requests, an update mid-way to weights that sample a
known token, every token's reported version checked (see :func:`exactness`).

Then passes of a fully asynchronous loop, the mode alternating (``--reps`` each): ``--sessions`` workers each
keep one request in flight (a fresh random prompt of ``--prompt`` tokens, ``--max-new``/4 to ``--max-new``
tokens, ignore_eos, then the next); after ``--warmup-s`` comes the measured window of ``--window-s`` with an update
every ``--every-s`` seconds: a real update through the engine's update path (``update_weights_from_ipc``:
CUDA IPC bucket, version, in-flight handling), with one small tensor (``model.norm.weight``) so the time
measured is the mechanism's, not a transfer's.  Right after each update a *probe* sends a prompt prefilled
before the loop (cached under older weights): a stale prefix hit is a probe with ``cached_tokens > 0``.

Per pass (its window): output tokens/s, prompt tokens re-prefilled per update (engine.reprefilled_tokens), requests kept
in place / checkpointed per update, the update call's time, stale hits, and inter-token gaps: every token's
arrival is recorded on the engine's direct path (``SGLANG_FORCE_STREAM_INTERVAL=1`` so each step reports;
both modes pay it alike); the gap of a token is the time since the previous token of the same request;
"around an update": tokens arriving from the update's start to 2 s after its end; "straddle": the gaps that
span any part of an update call (a token's previous one came before the call ended and it came after the call
began): the decoding pause the update itself causes; split into the time before the call (its last token to the
call's start) and after it (the call's end to its next token), and each update's record keeps the engine's step
timeline around it (``steps_around``: ms from the call's start, requests with tokens, tokens; ``--timeline-s``).
Requests SGLang had retracted for KV memory when an update came (queued with tokens) are counted apart: SGLang
prefills them again with or without the update.
``--extra '{"chunked_prefill_size": 1024}'`` passes SGLang server arguments (both modes alike).

In that loop new prompts arrive all the time, and SGLang runs a waiting prefill before any decode step, so
every request's gaps, with or without an update, include other requests' prefill chunks ("gap p99 away from
updates"). *Decode passes* (``--decode-reps``, ``--decode-modes``) isolate what an update
adds: ``--sessions`` requests of ``--prompt`` fresh tokens each all start, and once every one is decoding an
update comes every ``--decode-every-s`` seconds (``--decode-updates``), with no arrivals: each straddling gap
is one decode step plus what the update costs; each update is a repetition (its own p99, then their median).
(``--decode-shared 1`` gives the prompts one prefix, prefilled once: a short prefill, but a decode step that
reads the shared KV from L2 is faster than one over distinct contexts, so it flatters the gaps.)

``--engine standin --quick`` runs it on a CPU (SGLang's tokenizer manager over the stand-in scheduler, which
answers SGLang's weight call and then samples with other weights).

    python bench/gpu_inflight.py --shape 7b --reps 3 --json out.json
    python bench/gpu_inflight.py --engine standin --quick
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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


def ms(xs: list[float], q: float) -> float:
    return round(1000 * (pct(xs, q) or 0), 2)


class Tracker:
    """Token arrival times per request, across its parts (direct path hook)."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.rid_of: dict[str, str] = {}
        self.last: dict[str, float] = {}
        self.gaps: list[tuple[float, float]] = []  # (arrival, gap)
        #: every batch output (arrival, requests with tokens, tokens): the engine's step timeline
        self.steps: list[tuple[float, int, int]] = []
        self.seen: set[str] = set()  # requests that have had a part
        #: continuation sid -> (submitted at, tokens fed, a retracted part's continuation)
        self.parts: dict[str, tuple[float, int, bool]] = {}
        #: (continuation submitted at, prompt tokens it computed again, retracted): attributed to the update
        #: before it (a retracted part's to SGLang's retraction)
        self.recomputed: list[tuple[float, int, bool]] = []
        tm = eng._tm
        orig_batch = tm._handle_batch_output  # the direct path's hook (it passes foreign rids on)
        orig_submit = eng._submit
        tracker = self

        async def on_batch(recv: Any) -> None:
            now = time.perf_counter()
            rids = getattr(recv, "rids", None) or []
            outs = getattr(recv, "output_ids", None) or []
            ends = getattr(recv, "finished_reasons", None) or []
            cached = getattr(recv, "cached_tokens", None) or []
            tracker.steps.append((now, sum(1 for o in outs if o), sum(len(o) for o in outs if o)))
            for i, sid in enumerate(rids):
                if sid in tracker.parts and i < len(ends) and ends[i] is not None:
                    t_sub, fed, retr = tracker.parts.pop(sid)
                    tracker.recomputed.append((t_sub, max(0, fed - 1 - int(cached[i] or 0)), retr))
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
            # a continuation after a checkpoint of a part that had tokens (one checkpointed while queued
            # computed nothing before: its prefill now is its first)
            if req.rid in tracker.seen and req.rid in tracker.last:
                flight = eng._flights.get(req.rid)
                retr = bool(getattr(flight, "retracted", False))
                tracker.parts[sid] = (time.perf_counter(), len(inputs["input_ids"]), retr)
            tracker.seen.add(req.rid)
            return orig_submit(sid, inputs, sp, req, **kw)

        tm._handle_batch_output = on_batch
        eng._submit = submit
        #: this process's garbage collections (start, seconds, generation): a pause of the loop that
        #: delivers tokens shows in every request's gap, so each update's timeline names the ones near it
        self.gcs: list[tuple[float, float, int]] = []
        self._gc0 = 0.0

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                tracker._gc0 = time.perf_counter()
            else:
                tracker.gcs.append((tracker._gc0, time.perf_counter() - tracker._gc0, int(info["generation"])))

        gc.callbacks.append(on_gc)

    def gc_in(self, w0: float, w1: float) -> dict[str, Any]:
        """This process's collections in [w0, w1]: count and longest per generation (ms)."""
        mine = [(d, g) for t, d, g in self.gcs if w0 <= t <= w1]
        by = {g: [d for d, h in mine if h == g] for g in (0, 1, 2)}
        return {f"gc{g}": [len(ds), round(1000 * max(ds, default=0), 1)] for g, ds in by.items()}

    def forget(self, rid: str) -> None:
        self.last.pop(rid, None)
        self.seen.discard(rid)


async def update(a: argparse.Namespace, eng: Any, version: int, inflight: str, norm: Any) -> float:
    """One real update of the engine's weights through the engine's update path (SGLang: a CUDA IPC bucket
    of ``model.norm.weight``; the stand-in: the same path with SGLang's weight call answered by the
    stand-in scheduler, which then samples with other weights)."""
    t0 = time.perf_counter()
    if a.engine == "standin":
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        async def load() -> None:
            ok, text = await eng._tm.update_weights_from_tensor(
                UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b""], flush_cache=False), None
            )
            assert ok, text

        await eng._control._update(load, version, False, inflight)
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


async def update_window(
    a: argparse.Namespace, eng: Any, inflight: str, norm: Any, count: int, every_s: float, after: Any = None
) -> tuple[float, float, list[dict[str, Any]], list[tuple[float, float]]]:
    """A measured window from now: ``count`` updates, one every ``every_s`` seconds (the first half a period in),
    ``after()`` called after each; returns (start, end, each update's record, each call's (start, end))."""
    w0 = time.perf_counter()
    updates: list[dict[str, Any]] = []
    spans: list[tuple[float, float]] = []
    for k in range(count):
        await asyncio.sleep(max(0.0, w0 + (k + 0.5) * every_s - time.perf_counter()))
        u0 = time.perf_counter()
        took = await update(a, eng, eng.weight_version + 1, inflight, norm)
        spans.append((u0, time.perf_counter()))
        if after is not None:
            after()
        updates.append({"took_s": round(took, 4), "phases": dict(getattr(eng._control, "phases", {}))})
    await asyncio.sleep(max(0.0, w0 + count * every_s - time.perf_counter()))
    return w0, time.perf_counter(), updates, spans


def away_from(arrivals: list[tuple[float, float]], spans: list[tuple[float, float]], margin: float) -> list[float]:
    """The gaps of tokens at least ``margin`` seconds from any update call."""
    return [g for t, g in arrivals if not any(lo - margin <= t <= hi + margin for lo, hi in spans)]


def norm_tensor(a: argparse.Namespace, value: float) -> Any:
    if a.engine == "standin":
        return None
    import torch

    return torch.full((a.hidden,), value, dtype=torch.bfloat16, device="cuda")


async def exactness(a: argparse.Namespace, eng: Any, inflight: str, vocab: int) -> dict[str, Any]:
    """Per-token versions checked on the engine itself.  Greedy requests run; mid-way the weights change to
    ones that sample a *known* token: ``model.norm.weight = 0`` zeroes the last hidden state, so every logit
    is 0 and greedy picks one fixed token Z (the stand-in: its sampler with the new weights, recomputed).
    Exact means: every token the result puts under the new version is Z, and the last one it puts under the
    old version is not (an off-by-one split in either direction shows).  The weights go back afterwards."""
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    rnd = random.Random(f"exact-{inflight}")
    k, n_new = (8, 120) if a.quick else (64, 160)
    greedy = SamplingParams(max_new_tokens=n_new, ignore_eos=True, temperature=0.0)
    prompts = {f"x-{inflight}-{i}": [rnd.randrange(10, vocab - 10) for _ in range(256)] for i in range(k)}
    tasks = {
        r: asyncio.ensure_future(eng.generate(GenerateRequest(rid=r, input_ids=p, sampling=greedy)))
        for r, p in prompts.items()
    }

    def made(rid: str) -> int:
        f = eng.flights.get(rid)
        part = eng._path._reqs.get(f.sid) if f is not None else None
        return len(part.ids) if part is not None else 0

    async with asyncio.timeout(300):
        while not all(made(r) >= 10 for r in prompts):
            await asyncio.sleep(0.005)
    v = eng.weight_version
    kept0, ckpt0 = eng._control.kept_in_place, eng._control.checkpointed
    took = await update(a, eng, v + 1, inflight, norm_tensor(a, 0.0))
    outs = {r: await t for r, t in tasks.items()}
    kept, ckpt = eng._control.kept_in_place - kept0, eng._control.checkpointed - ckpt0
    if a.engine == "standin":
        from rollout_sdk.engines.sglang.standin import standin_next, standin_seed

        def sampled_ok(rid: str, out: Any) -> bool:
            h, ws = standin_seed(prompts[rid]), [ver - v for ver, n in out.version_segments for _ in range(n)]
            for tok, w in zip(out.output_ids, ws, strict=True):
                want, h = standin_next(h, vocab, w + eng._stand_weights0)
                if tok != want:
                    return False
            return True

        z = None
        exact = sum(sampled_ok(r, o) for r, o in outs.items())
    else:
        probe = await eng.generate(GenerateRequest(rid=f"z-{inflight}", input_ids=[11, 12, 13], sampling=greedy))
        z = probe.output_ids[0] if len(set(probe.output_ids)) == 1 else None

        def split_ok(out: Any) -> bool:
            segs = out.version_segments
            if z is None or len(segs) != 2 or segs[0][0] != v or segs[1][0] != v + 1:
                return False
            old, new = out.output_ids[: segs[0][1]], out.output_ids[segs[0][1] :]
            return bool(old) and old[-1] != z and all(t == z for t in new)

        exact = sum(split_ok(o) for o in outs.values())
    await update(a, eng, v + 2, "reprefill", norm_tensor(a, 1.0))  # back to the loop's weights
    if a.engine == "standin":
        eng._stand_weights0 += 2
    splits = sorted(o.version_segments[0][1] for o in outs.values() if len(o.version_segments) == 2)
    res = {
        "inflight": inflight,
        "requests": k,
        "exact": exact,
        "z_token": z,
        "split_median": splits[len(splits) // 2] if splits else None,
        "kept_in_place": kept,
        "checkpointed": ckpt,
        "mixed_kv_tokens": sum(o.mixed_kv_tokens for o in outs.values()),
        "update_s": round(took, 4),
    }
    log(f"exactness {inflight}: {res}")
    return res


async def passes(a: argparse.Namespace, eng: Any, tr: Tracker, vocab: int, save: Any) -> list[dict[str, Any]]:
    """The asynchronous loop, once per pass: ``--sessions`` workers each keep a request in flight (output
    lengths drawn from ``--max-new``/4 .. ``--max-new``, so requests end at different times); after
    ``--warmup-s`` (the first prefills; not measured) comes the measured window of ``--window-s`` with an
    update every ``--every-s`` seconds, then the workers stop.  Passes alternate the mode (reprefill, keep /
    keep, reprefill per rep) and a rep's two passes draw the same requests."""
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    plan = [
        (rep, m) for rep in range(a.reps) for m in (("reprefill", "keep") if rep % 2 == 0 else ("keep", "reprefill"))
    ]
    per_window = max(1, int(a.window_s // a.every_s))
    rnd = random.Random("seeds")
    # probe material: one prompt per update, prefilled now (cached under the weights then) and sent again
    # only right after its update; a control probe (sent again at once) shows that a probe can see a hit
    seeds = [[rnd.randrange(10, vocab - 10) for _ in range(a.prompt)] for _ in range(len(plan) * per_window + 1)]
    one = SamplingParams(max_new_tokens=1)
    await asyncio.gather(
        *(eng.generate(GenerateRequest(rid=f"seed{i}", input_ids=p, sampling=one)) for i, p in enumerate(seeds))
    )
    control = await eng.generate(GenerateRequest(rid="ctl", input_ids=seeds[-1], sampling=one))
    log(f"control probe: {control.cached_tokens} cached of {a.prompt}")
    norm = norm_tensor(a, 1.0)
    rows: list[dict[str, Any]] = []
    probe_no = 0
    for rep, inflight in plan:
        rnd = random.Random(f"pass-{rep}")
        stop = asyncio.Event()
        n = 0

        async def worker(
            w: int, stop: asyncio.Event = stop, inflight: str = inflight, rep: int = rep, rnd: random.Random = rnd
        ) -> None:
            nonlocal n
            while not stop.is_set():
                n += 1
                rid = f"{inflight}{rep}-{w}-{n}"
                prompt = [rnd.randrange(10, vocab - 10) for _ in range(a.prompt)]
                sp = SamplingParams(max_new_tokens=rnd.randint(a.max_new // 4, a.max_new), ignore_eos=True)
                task = asyncio.ensure_future(eng.generate(GenerateRequest(rid=rid, input_ids=prompt, sampling=sp)))
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    eng.abort(rid)
                stopper.cancel()
                await task
                tr.forget(rid)

        workers = [asyncio.create_task(worker(w)) for w in range(a.sessions)]
        try:
            await asyncio.sleep(a.warmup_s)
            tr.gaps.clear()
            tr.steps.clear()
            kept0, ckpt0 = eng._control.kept_in_place, eng._control.checkpointed
            retr0 = getattr(eng._control, "retracted", 0)
            eng._control.unheld.clear()
            probes: list[Any] = []

            def probe(probes: list[Any] = probes) -> None:
                nonlocal probe_no
                req = GenerateRequest(rid=f"probe{probe_no}", input_ids=seeds[probe_no], sampling=one)
                probes.append(asyncio.ensure_future(eng.generate(req)))
                probe_no += 1

            w0, w1, updates, spans = await update_window(a, eng, inflight, norm, per_window, a.every_s, probe)
            arrivals = [(t, g) for t, g in tr.gaps if w0 <= t <= w1]
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        around = [g for t, g in arrivals if any(lo <= t <= hi + 2.0 for lo, hi in spans)]
        away = away_from(arrivals, spans, min(2.0, a.every_s / 4))
        # the gap of a request across an update: its first token after the update minus its last before
        straddle = straddling(a, tr, arrivals, spans, updates)
        for u, p in zip(updates, probes, strict=True):
            u["probe_cached"] = (await p).cached_tokens
        gaps = [g for _, g in arrivals]
        row = {
            "inflight": inflight,
            "rep": rep,
            "wall_s": round(w1 - w0, 2),
            "tokens": len(arrivals),
            "tok_s": round(len(arrivals) / (w1 - w0), 1),
            "updates": updates,
            "update_s_median": round(statistics.median(u["took_s"] for u in updates), 4),
            # every continuation has ended (the workers stopped): what this window's updates made
            # its requests compute again
            "reprefilled_per_update": round(
                sum(m for t, m, r in tr.recomputed if w0 <= t <= w1 + 60 and not r) / len(updates)
            ),
            "retracted_per_update": round((getattr(eng._control, "retracted", 0) - retr0) / len(updates), 1),
            "retraction_reprefilled_per_update": round(
                sum(m for t, m, r in tr.recomputed if w0 <= t <= w1 + 60 and r) / len(updates)
            ),
            "kept_in_place_per_update": round((eng._control.kept_in_place - kept0) / len(updates), 1),
            "checkpointed_per_update": round((eng._control.checkpointed - ckpt0) / len(updates), 1),
            "stale_hits": sum(1 for u in updates if u["probe_cached"] > 0),
            **tr.gc_in(w0, w1),
            # parts an in-place pause did not hold, and where SGLang had them (diagnosis of checkpoints)
            "unheld": [list(x) for x in list(eng._control.unheld)[:32]],
            "gap_p50_ms": ms(gaps, 0.5),
            "gap_p99_ms": ms(gaps, 0.99),
            "gap_p99_around_update_ms": ms(around, 0.99),
            "gap_p99_away_ms": ms(away, 0.99),
            **straddle,
        }
        tr.recomputed.clear()
        log(f"pass {inflight} rep {rep}: " + json.dumps({k: v for k, v in row.items() if k != "updates"}))
        rows.append(row)
        save(rows)
    return rows


def straddling(
    a: argparse.Namespace,
    tr: Tracker,
    arrivals: list[tuple[float, float]],
    spans: list[tuple[float, float]],
    updates: list[dict[str, Any]],
) -> dict[str, Any]:
    """The gaps that span an update call (a token's previous one came before the call ended and it came after
    the call began), where their time goes: before the call (last token to the call's start) and after it
    (the call's end to the next token); and the engine's step timeline around each call, into ``updates``."""
    crossing = [(t, g, lo, hi) for t, g in arrivals for lo, hi in spans if t >= lo and t - g <= hi]
    gaps = [g for _, g, _, _ in crossing]
    before = [lo - (t - g) for t, g, lo, _ in crossing]
    after = [t - hi for t, _, _, hi in crossing]
    for u, (lo, hi) in zip(updates, spans, strict=True):
        mine = [g for t, g, lo2, _ in crossing if lo2 == lo]
        u["straddling"], u["straddle_p99_ms"], u["straddle_max_ms"] = len(mine), ms(mine, 0.99), ms(mine, 1.0)
        u["steps_around"] = [
            [round(1000 * (t - lo), 1), n, k] for t, n, k in tr.steps if lo - a.timeline_s <= t <= hi + a.timeline_s
        ][:400]
        # collections of 1 ms or more near the call: [ms from the call's start, ms, generation]
        u["gc_around"] = [
            [round(1000 * (t - lo), 1), round(1000 * d, 1), g]
            for t, d, g in tr.gcs
            if lo - a.timeline_s <= t <= hi + a.timeline_s and d >= 0.001
        ][:100]
    return {
        "straddle_p50_ms": ms(gaps, 0.5),
        "straddle_p99_ms": ms(gaps, 0.99),
        "straddle_max_ms": ms(gaps, 1.0),
        "straddling": len(gaps),
        "straddle_before_p50_ms": ms(before, 0.5),
        "straddle_after_p50_ms": ms(after, 0.5),
        "straddle_after_p99_ms": ms(after, 0.99),
        # an update is one repetition of what is measured: the median over updates of each one's p99
        "straddle_p99_per_update_median_ms": round(statistics.median(u["straddle_p99_ms"] for u in updates), 2)
        if updates
        else 0,
    }


async def decode_passes(a: argparse.Namespace, eng: Any, tr: Tracker, vocab: int, save: Any) -> list[dict[str, Any]]:
    """Decode passes (module docstring): every request decoding, no arrivals, an update every
    ``--decode-every-s``; the mode alternates per rep as in :func:`passes`."""
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    rows: list[dict[str, Any]] = []
    modes = a.decode_modes.split(",")
    plan = [(rep, m) for rep in range(a.decode_reps) for m in (modes if rep % 2 == 0 else modes[::-1])]
    norm = norm_tensor(a, 1.0)
    sp = SamplingParams(max_new_tokens=a.decode_max_new, ignore_eos=True)
    for rep, inflight in plan:
        rnd = random.Random(f"decode-{rep}-{inflight}")  # fresh prompts per pass: prefilled, not cached
        rids = [f"d{inflight}{rep}-{i}" for i in range(a.sessions)]
        if a.decode_shared:  # a shared prefix, prefilled once first (else SGLang computes it per batch)
            prefix = [rnd.randrange(10, vocab - 10) for _ in range(a.prompt - a.decode_suffix)]
            one = SamplingParams(max_new_tokens=1)
            await eng.generate(GenerateRequest(rid=f"d{inflight}{rep}-p", input_ids=prefix, sampling=one))
            prompts = [prefix + [rnd.randrange(10, vocab - 10) for _ in range(a.decode_suffix)] for _ in rids]
        else:
            prompts = [[rnd.randrange(10, vocab - 10) for _ in range(a.prompt)] for _ in rids]
        tasks = [
            asyncio.ensure_future(eng.generate(GenerateRequest(rid=r, input_ids=p, sampling=sp)))
            for r, p in zip(rids, prompts, strict=True)
        ]
        try:
            t0 = time.perf_counter()
            async with asyncio.timeout(300):
                while not all(r in tr.last for r in rids):
                    await asyncio.sleep(0.01)
            started = time.perf_counter() - t0
            tr.gaps.clear()
            tr.steps.clear()
            kept0, ckpt0 = eng._control.kept_in_place, eng._control.checkpointed
            w0, w1, updates, spans = await update_window(a, eng, inflight, norm, a.decode_updates, a.decode_every_s)
            finished = sum(1 for t in tasks if t.done())
            # gaps begun in the window (a request's first gap after all started can span the others' prefill)
            arrivals = [(t, g) for t, g in tr.gaps if w0 <= t - g and t <= w1]
        finally:
            for r in rids:
                eng.abort(r)
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in rids:
                tr.forget(r)
        away = away_from(arrivals, spans, a.decode_every_s / 4)
        row = {
            "inflight": inflight,
            "rep": rep,
            "all_decoding_after_s": round(started, 2),
            "finished_in_window": finished,  # > 0: --decode-max-new too small for the window
            **tr.gc_in(w0, w1),
            "wall_s": round(w1 - w0, 2),
            "tokens": len(arrivals),
            "tok_s": round(len(arrivals) / (w1 - w0), 1),
            "updates": updates,
            "update_s_median": round(statistics.median(u["took_s"] for u in updates), 4),
            "update_s_max": round(max(u["took_s"] for u in updates), 4),
            "kept_in_place_per_update": round((eng._control.kept_in_place - kept0) / len(updates), 1),
            "checkpointed_per_update": round((eng._control.checkpointed - ckpt0) / len(updates), 1),
            "gap_p50_away_ms": ms(away, 0.5),
            "gap_p99_away_ms": ms(away, 0.99),
            **straddling(a, tr, arrivals, spans, updates),
        }
        tr.recomputed.clear()
        log(f"decode pass {inflight} rep {rep}: " + json.dumps({k: v for k, v in row.items() if k != "updates"}))
        rows.append(row)
        save(rows)
    return rows


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig

    if a.engine == "standin":
        from rollout_sdk.engines.sglang.standin import StandinEngine, StandinScheduler
        from rollout_sdk.models import ensure_tiny_model

        model = str(await asyncio.to_thread(ensure_tiny_model))
        vocab = 151000
        eng = SglangEngine(
            SglangEngineConfig(model_path=model, freeze_gc=False, decode_window=None),
            launcher=StandinEngine.launcher(StandinScheduler(step_s=0.002, max_running=4096, vocab_size=vocab)),
        )
        eng._stand_weights0 = 0  # the stand-in's weights at version 0 (the exactness check's reference)
    else:
        import gpu_check

        model = gpu_check.model_dir(a.shape)
        extra = {"max_total_tokens": a.max_total_tokens, **json.loads(a.extra)}
        eng = SglangEngine(gpu_check.dummy_engine_config(a, model, extra=extra))
        vocab = 151000
    t0 = time.perf_counter()
    await eng.start()
    log(f"engine ready in {time.perf_counter() - t0:.1f}s; in place: {eng._control.inplace}")
    tr = Tracker(eng)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "shape": a.shape,
        "engine": a.engine,
        "in_place": eng._control.inplace,
        "exactness": [],
        "passes": [],
        "decode_passes": [],
    }
    try:
        if a.check:
            for inflight in ("keep", "reprefill"):
                res["exactness"].append(await exactness(a, eng, inflight, vocab))
                if a.json:
                    write(a.json, res)

        def saver(key: str) -> Any:  # partial results after every pass
            return lambda rows: write(a.json, res | {key: rows}) if a.json else None

        if a.decode_reps:  # first: short, and what an update adds
            res["decode_passes"] = await decode_passes(a, eng, tr, vocab, saver("decode_passes"))
        if a.reps:
            res["passes"] = await passes(a, eng, tr, vocab, saver("passes"))
    finally:
        await eng.close()
    res["summary"] = summary(res["passes"])
    res["decode_summary"] = summary(res["decode_passes"], DECODE_KEYS)
    return res


DECODE_KEYS = (
    "tok_s",
    "update_s_median",
    "update_s_max",
    "kept_in_place_per_update",
    "checkpointed_per_update",
    "gap_p50_away_ms",
    "gap_p99_away_ms",
    "straddle_p50_ms",
    "straddle_p99_ms",
    "straddle_max_ms",
    "straddle_p99_per_update_median_ms",
    "straddle_before_p50_ms",
    "straddle_after_p50_ms",
    "straddle_after_p99_ms",
)


def summary(rows: list[dict[str, Any]], keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = keys or (
        "tok_s",
        "reprefilled_per_update",
        "kept_in_place_per_update",
        "checkpointed_per_update",
        "retracted_per_update",
        "retraction_reprefilled_per_update",
        "update_s_median",
        "stale_hits",
        "gap_p50_ms",
        "gap_p99_ms",
        "gap_p99_around_update_ms",
        "gap_p99_away_ms",
        "straddle_p50_ms",
        "straddle_p99_ms",
        "straddle_max_ms",
        "straddle_before_p50_ms",
        "straddle_after_p50_ms",
        "straddle_after_p99_ms",
    )
    for mode in ("reprefill", "keep"):
        ws = [w for w in rows if w["inflight"] == mode]
        if ws:
            out[mode] = {k: statistics.median([w[k] for w in ws]) for k in keys} | {"passes": len(ws)}
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
    ap.add_argument("--warmup-s", type=float, default=45.0, help="each pass runs this long before its window")
    ap.add_argument("--window-s", type=float, default=30.0, help="each pass's measured window")
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("--timeline-s", type=float, default=1.5, help="seconds of steps kept around each update")
    ap.add_argument("--reps", type=int, default=3, help="passes per mode (alternating); 0: the check alone")
    ap.add_argument("--decode-reps", type=int, default=0, help="decode passes per mode (module docstring)")
    ap.add_argument("--decode-every-s", type=float, default=2.0)
    ap.add_argument("--decode-updates", type=int, default=5, help="updates per decode pass")
    ap.add_argument("--decode-modes", default="keep", help="decode passes' modes, alternating (keep,reprefill)")
    ap.add_argument("--decode-shared", type=int, default=0, help="decode prompts share a prefix (1; flatters: L2)")
    ap.add_argument("--decode-suffix", type=int, default=96, help="each decode request's own prompt tokens, shared")
    ap.add_argument("--decode-max-new", type=int, default=1024)
    ap.add_argument("--check", type=int, default=1, help="run the per-token exactness check first (1)")
    ap.add_argument("--flush", type=int, default=0, help="reprefill passes also flush (0: the namespace alone)")
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--sampling", default="pytorch")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--max-total-tokens", type=int, default=1_600_000)
    ap.add_argument("--graph-bs", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=0, help="model.norm.weight size (default: the shape's)")
    ap.add_argument("--extra", default="{}", help="SGLang server arguments, a JSON object (both modes alike)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.sessions, a.prompt, a.max_new, a.warmup_s, a.window_s, a.every_s, a.reps = 16, 64, 400, 1.0, 2.0, 1.0, 1
        a.decode_reps, a.decode_every_s, a.decode_updates, a.decode_modes = 1, 0.5, 3, "keep,reprefill"
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
    print(json.dumps({"loop": res["summary"], "decode": res["decode_summary"]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
