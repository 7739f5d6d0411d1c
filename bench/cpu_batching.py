"""CPU continuous batching: rollout-sdk's ``CpuEngine`` against transformers' own continuous-batching manager.

What is measured
    Output tokens per second of two implementations serving the same model and the same workload, in one
    process, one after the other: the engine is started, measured and closed before transformers' manager is
    started.  (Not interleaved: on 2 cores a second live thread that has run torch ops -- a second OpenMP team
    -- slows the other implementation's steps by ~30 %, so only one runs at a time; for the same reason each
    model is loaded on a thread that is gone by the time it is measured.)

    * ``rollout-sdk CpuEngine`` -- engine level, in-process: ``await engine.generate(GenerateRequest(...))``
      (default ``CpuEngineConfig``: 128 running rows, 4,096 prefill tokens a step, float32).
    * ``transformers CB`` -- ``model.init_continuous_batching(...)`` (a ``ContinuousBatchingManager``):
      ``add_request`` / ``get_result``, paged KV cache, ``attn_implementation="sdpa"`` (5.24 accepts only
      ``"sdpa"``, ``"paged|eager"`` or a flash kernel for CB; flash needs CUDA).  Its cache is sized for the
      workload (see ``_cb_config``): the automatic sizing (from free host memory) picks 8,192-token batches
      and a ~4 GB attention-mask buffer here, which made it ~3.5x slower at c=32.

    Model: the embedded tiny Qwen2 (``rollout_sdk.models.tiny``; 151,936-token vocabulary, 2 layers, hidden 64).
    Workload: prompts of 28..36 random token ids (a fixed seed; the same prompts for both implementations),
    ``max_new_tokens=64``, EOS ignored, temperature 1, no top-k/top-p/min-p, logprobs returned by both.

How
    Closed loop at each concurrency ``c`` (1, 8, 32, 128 by default): ``c`` clients each submit a request, wait
    for its result, and submit the next one until ``--min-seconds`` have passed; the level ends when the last
    one is back.  tok/s = output tokens of all the level's requests / the level's wall time (the drain is
    counted: requests of equal length stay in lock-step, so it is whole "waves" at concurrency ``c``).  Each
    implementation is warmed up first (one short request per slot at the highest level, then one at c=1).
    Speedups are against the same implementation at c=1.  If transformers' manager fails, its levels are
    recorded as ``failed: <reason>``.

    Also printed (and written to the JSON): which ``SamplingParams`` features each implementation can honour
    per request, as read in the transformers 5.24 source (``generation/continuous_batching/``).

Usage::

    ROLLOUT_SDK_HOME=/tmp/rsdk-home python bench/cpu_batching.py     # ~65 s on 2 cores
    python bench/cpu_batching.py --quick                             # ~50 s (1 s a level)
    python bench/cpu_batching.py --impl engine --levels 1 8 --json /tmp/out.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import itertools
import os
import platform
import random
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness

ENGINE = "rollout-sdk CpuEngine"
HF_CB = "transformers CB"
IMPLS = (ENGINE, HF_CB)

#: Per-request SamplingParams features, as read in the sources (rollout_sdk/engines/cpu/, _sampling.py and
#: transformers 5.24 generation/continuous_batching/*.py).
FEATURES: dict[str, dict[str, str]] = {
    ENGINE: {
        "per-request seed": "yes: SamplingParams.seed seeds the request's own RNG (one uniform per token); "
        "reproducible whatever shares the batch",
        "top_k / top_p / min_p": "yes, per request (exact full-vocabulary path, _sampling._filter); "
        "temperature 0 = greedy per request; penalties per request",
        "stop token ids": "yes, per request (stop_token_ids, EOS unless ignore_eos, min_new_tokens)",
        "sampled-token logprobs": "yes, per request (return_logprobs); after penalties and temperature, "
        "before truncation",
        "abort one request": "yes: abort(rid) resolves it at once with the tokens so far; row dropped next step",
    },
    HF_CB: {
        "per-request seed": "no: ContinuousBatchingConfig.seed -> one torch.manual_seed for the process "
        "(distributed.py set_tp_seed); torch.multinomial on the global generator, so tokens depend on the batch",
        "top_k / top_p / min_p": "partial: temperature/top_k/top_p per request via add_request(**kwargs) only with "
        "per_request_processors=True and only if the GenerationConfig enabled that warper at init "
        "(cb_logits_processors.py); min_p global only (no CB variant); greedy is global (do_sample); "
        "repetition penalty and min_new_tokens processors are dropped (supports_continuous_batching=False)",
        "stop token ids": "yes: add_request(eos_token_id=int | list) per request (-1 = ignore EOS); no min_new_tokens",
        "sampled-token logprobs": "global only: ContinuousBatchingConfig.return_logprobs for every request; "
        "log-softmax after all processors (after top-k/top-p truncation)",
        "abort one request": "partial: cancel_request(id) frees it at the next step but delivers no "
        "GenerationOutput (scheduler.clear_cancelled_requests): partial tokens are lost, a waiter must time out",
    },
}


@dataclass(frozen=True)
class Workload:
    """What every request looks like."""

    prompt_len: int = 32
    prompt_jitter: int = 4
    max_new_tokens: int = 64
    seed: int = 0
    #: prompt token ids are drawn below Qwen2.5's first special token
    id_limit: int = 151643

    def prompt(self, level: int, index: int) -> list[int]:
        """The ``index``-th prompt of a level: the same for every implementation and every run."""
        rng = random.Random(f"{self.seed}:{level}:{index}")
        n = rng.randint(self.prompt_len - self.prompt_jitter, self.prompt_len + self.prompt_jitter)
        return [rng.randrange(self.id_limit) for _ in range(n)]


@dataclass
class LevelResult:
    """One implementation at one concurrency."""

    concurrency: int
    status: str = "ok"
    requests: int = 0
    output_tokens: int = 0
    seconds: float | None = None
    tok_s: float | None = None
    speedup_vs_c1: float | None = None


@dataclass
class ImplResult:
    """One implementation at every concurrency."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    levels: list[LevelResult] = field(default_factory=list)
    setup_seconds: float = 0.0
    error: str | None = None


# -- rollout-sdk CpuEngine ----------------------------------------------------------------------------


async def _engine_level(engine: Any, wl: Workload, c: int, min_seconds: float, max_new: int) -> LevelResult:
    """Closed loop: ``c`` clients, each awaiting one ``generate`` at a time, until ``min_seconds`` have passed."""
    from rollout_sdk.protocol import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=1.0)
    counter = itertools.count()
    res = LevelResult(concurrency=c)
    t0 = time.perf_counter()
    deadline = t0 + min_seconds

    async def client() -> None:
        while True:
            i = next(counter)
            req = GenerateRequest(input_ids=wl.prompt(c, i), sampling=sp, rid=f"c{c}-{max_new}-{i}")
            out = await engine.generate(req)
            res.requests += 1
            res.output_tokens += len(out.output_ids)
            if time.perf_counter() >= deadline:
                return

    await asyncio.gather(*(client() for _ in range(c)))
    return _finish_level(res, time.perf_counter() - t0)


async def _start_engine(
    wl: Workload, max_c: int, home: str | None, threads: int | None = None
) -> tuple[Any, ImplResult]:
    """Start a CpuEngine with its default config (``threads``: its ``num_threads``) and warm it up."""
    from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig

    cfg = CpuEngineConfig(home=home, num_threads=threads)
    result = ImplResult(name=ENGINE, config=asdict(cfg))
    t0 = time.perf_counter()
    engine = CpuEngine(cfg)
    await engine.start()
    try:
        await _engine_level(engine, wl, max_c, 0.0, 4)  # warm-up: the widest prefill and a few decode steps
        await _engine_level(engine, wl, 1, 0.0, 4)
    except BaseException:
        await engine.close()
        raise
    result.setup_seconds = time.perf_counter() - t0
    return engine, result


# -- transformers continuous batching -------------------------------------------------------------------


def _cb_config(wl: Workload, max_c: int, page_size: int) -> dict[str, Any]:
    """A paged cache sized for the workload: every in-flight request fits, a full wave prefills in at most
    4,096 tokens a step (CpuEngineConfig.max_prefill_tokens), rows per step = the highest concurrency."""
    per_request = wl.prompt_len + wl.prompt_jitter + wl.max_new_tokens
    pages = -(-per_request // page_size)
    return {
        "page_size": page_size,
        "num_blocks": 2 * max_c * pages,
        "max_batch_tokens": 4096,
        "max_requests_per_batch": max_c,
        "return_logprobs": True,  # the engine returns them too (GenerateRequest.return_logprobs defaults to True)
        "seed": wl.seed,
    }


def _start_manager(model_dir: str, wl: Workload, cb_kwargs: dict[str, Any], attn: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    model.requires_grad_(False)
    # temperature 1, top_k 0, top_p 1: no logits processor at all, plain multinomial sampling over the vocabulary
    gen = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=wl.max_new_tokens,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    manager = model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs)
    )
    with torch.inference_mode():  # the generation thread inherits the caller's inference mode
        manager.start()
    return manager


def _cb_level(manager: Any, wl: Workload, c: int, min_seconds: float, max_new: int, timeout: float) -> LevelResult:
    """Closed loop over add_request / get_result: a new request goes in as soon as one comes back."""
    counter = itertools.count()
    res = LevelResult(concurrency=c)
    t0 = time.perf_counter()
    deadline = t0 + min_seconds

    def submit() -> None:
        i = next(counter)
        rid = manager.add_request(
            wl.prompt(c, i), request_id=f"c{c}-{max_new}-{i}", max_new_tokens=max_new, eos_token_id=-1
        )  # -1: no EOS, i.e. ignore_eos
        if rid is None:
            raise RuntimeError("add_request refused the request (manager stopped?)")

    for _ in range(c):
        submit()
    in_flight = c
    while in_flight:
        out = manager.get_result(timeout=timeout)
        if out is None:
            fatal = manager.background_thread_status.fatal_error
            raise RuntimeError(f"no result within {timeout:.0f} s" + (f" ({fatal!r})" if fatal else ""))
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        in_flight -= 1
        res.requests += 1
        res.output_tokens += len(out.generated_tokens)
        if time.perf_counter() < deadline:
            submit()
            in_flight += 1
    return _finish_level(res, time.perf_counter() - t0)


class _CbRunner:
    """transformers' manager and its results.  A failure is recorded (``failed: <reason>``), never raised."""

    def __init__(self, wl: Workload, args: argparse.Namespace) -> None:
        self.wl = wl
        self.timeout = args.level_timeout
        self.max_c = max(args.levels)
        self.cb_kwargs = _cb_config(wl, self.max_c, args.page_size)
        self.attn = args.attn
        self.result = ImplResult(name=HF_CB, config={"attn_implementation": args.attn, **self.cb_kwargs})
        self.manager: Any = None

    def start(self, model_dir: str) -> None:
        """Load the model, start the manager and warm it up as the engine is warmed up."""
        t0 = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as loader:  # a thread that is gone afterwards
                self.manager = loader.submit(_start_manager, model_dir, self.wl, self.cb_kwargs, self.attn).result()
            _cb_level(self.manager, self.wl, self.max_c, 0.0, 4, self.timeout)
            _cb_level(self.manager, self.wl, 1, 0.0, 4, self.timeout)
            resolved = self.manager.continuous_batching_config
            keys = ("use_async_batching", "use_cuda_graph", "max_blocks_per_request", "allow_block_sharing")
            self.result.config["resolved"] = {k: str(getattr(resolved, k, None)) for k in keys}
        except Exception as exc:
            self._fail(exc)
        self.result.setup_seconds = time.perf_counter() - t0

    def level(self, c: int, min_seconds: float) -> LevelResult:
        """Run one concurrency level, or record it as failed."""
        if self.result.error is None:
            try:
                res = _cb_level(self.manager, self.wl, c, min_seconds, self.wl.max_new_tokens, self.timeout)
            except Exception as exc:
                self._fail(exc)
            else:
                self.result.levels.append(res)
                return res
        res = LevelResult(concurrency=c, status=f"failed: {self.result.error}")
        self.result.levels.append(res)
        return res

    def _fail(self, exc: Exception) -> None:
        self.result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"[{HF_CB}] failed: {self.result.error}", file=sys.stderr, flush=True)
        self.close()

    def close(self) -> None:
        manager, self.manager = self.manager, None
        if manager is None:
            return
        try:
            manager.stop(block=True, timeout=60, hard_stop=self.result.error is not None)
            manager.destroy()
        except Exception as exc:  # teardown must not hide the numbers
            print(f"[{HF_CB}] stop failed: {exc!r}", file=sys.stderr)


async def _run_engine(args: argparse.Namespace, wl: Workload) -> ImplResult:
    """Start the engine, run every level, close it."""
    engine, result = await _start_engine(wl, max(args.levels), args.home, args.threads)
    try:
        for c in args.levels:
            result.levels.append(await _engine_level(engine, wl, c, args.min_seconds, wl.max_new_tokens))
            _log(ENGINE, result.levels[-1])
    finally:
        await engine.close()
    return result


def _run_cb(args: argparse.Namespace, wl: Workload, model_dir: str) -> ImplResult:
    """Start transformers' manager, run every level, stop it; failures end up in the result."""
    cb = _CbRunner(wl, args)
    try:
        cb.start(model_dir)
        for c in args.levels:
            _log(HF_CB, cb.level(c, args.min_seconds))
    finally:
        cb.close()
    return cb.result


# -- reporting --------------------------------------------------------------------------------------------


def _finish_level(res: LevelResult, seconds: float) -> LevelResult:
    res.seconds = seconds
    res.tok_s = res.output_tokens / seconds if seconds > 0 else 0.0
    return res


def _add_speedups(result: ImplResult) -> None:
    base = next((r.tok_s for r in result.levels if r.concurrency == 1 and r.status == "ok"), None)
    for r in result.levels:
        if base and r.tok_s is not None:
            r.speedup_vs_c1 = r.tok_s / base


def _log(name: str, r: LevelResult) -> None:
    """A progress line on stderr (the table goes to stdout, last)."""
    if r.tok_s is None or r.seconds is None:
        line = r.status
    else:
        line = f"{r.requests:>5} req {r.output_tokens:>7} tok {r.seconds:6.1f} s {r.tok_s:8.1f} tok/s"
    print(f"[{name}] c={r.concurrency:<4} {line}", file=sys.stderr, flush=True)


def _machine() -> dict[str, Any]:
    import torch
    import transformers

    import rollout_sdk

    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": harness.cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min_at_end": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rollout_sdk": getattr(rollout_sdk, "__version__", "?"),
    }


def _results_table(results: list[ImplResult]) -> str:
    """implementation x concurrency: tok/s, speedup vs c=1 and ratio to the other implementation."""
    by_key = {(res.name, r.concurrency): r for res in results for r in res.levels}
    rows = []
    for res in results:
        for r in res.levels:
            if r.status != "ok" or r.tok_s is None or r.seconds is None:
                rows.append([res.name, str(r.concurrency), "-", "-", "-", "-", "-", r.status[:100]])
                continue
            other = next((by_key.get((o.name, r.concurrency)) for o in results if o.name != res.name), None)
            vs = f"{r.tok_s / other.tok_s:.2f}x" if other and other.tok_s else "-"
            speed = f"{r.speedup_vs_c1:.2f}x" if r.speedup_vs_c1 else "-"
            cells = [str(r.concurrency), str(r.requests), f"{r.seconds:.1f}", f"{r.tok_s:.1f}", speed, vs]
            rows.append([res.name, *cells, r.status])
    header = ["implementation", "c", "requests", "s", "tok/s", "vs c=1", "vs other impl", "status"]
    return harness.table(header, rows, left=(0, 7))


def _features_table(names: Sequence[str], width: int = 88) -> str:
    rows = []
    for name in names:
        for feat, text in FEATURES[name].items():
            lines = textwrap.wrap(text, width)
            rows.append([name, feat, lines[0]])
            rows += [["", "", line] for line in lines[1:]]
    return harness.table(["implementation", "feature", "per request?"], rows, left=(0, 1, 2))


# -- main -------------------------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick="~1 minute: 1 s a level instead of 3", json="cpu_batching", json_type=Path)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 128], help="concurrency levels")
    p.add_argument("--min-seconds", type=float, default=None, help="closed-loop time a level (default 3, quick 1)")
    p.add_argument("--impl", choices=["both", "engine", "transformers"], default="both", help="what to measure")
    p.add_argument("--attn", default="sdpa", help="attn_implementation for transformers CB (sdpa or paged|eager)")
    p.add_argument("--page-size", type=int, default=128, help="transformers CB page size, in tokens")
    p.add_argument("--level-timeout", type=float, default=180.0, help="give up on a CB result after this long")
    p.add_argument("--home", default=None, help="rollout-sdk home for the tiny model (default $ROLLOUT_SDK_HOME)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="the engine's num_threads (default: its default)")
    args = p.parse_args(argv)
    harness.by_mode(args, min_seconds=(3.0, 1.0))
    if 1 not in args.levels:
        args.levels = [1, *args.levels]  # speedups are against c=1
    args.levels = sorted(set(args.levels))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.perf_counter()
    foreign_cpu = harness.ForeignCpu()
    foreign_cpu.start()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-min load average is {load_before:.2f}: other work may share the CPU", file=sys.stderr)
    import transformers

    from rollout_sdk.models.tiny import ensure_tiny_model

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    wl = Workload(seed=args.seed)
    model_dir = str(ensure_tiny_model(args.home))
    names = {"both": IMPLS, "engine": (ENGINE,), "transformers": (HF_CB,)}[args.impl]
    results: list[ImplResult] = []
    if ENGINE in names:
        results.append(asyncio.run(_run_engine(args, wl)))
    if HF_CB in names:
        results.append(_run_cb(args, wl, model_dir))
    for res in results:
        _add_speedups(res)
    total = time.perf_counter() - t_start
    foreign_pct = foreign_cpu.stop()  # % of one core -> share of the machine
    foreign = None if foreign_pct is None else foreign_pct / 100 / (os.cpu_count() or 1)
    payload = {
        "benchmark": "cpu_batching",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "machine": {
            **_machine(),
            "load_average_1min_at_start": round(load_before, 2),
            "foreign_cpu_share_during_run": foreign if foreign is None else round(foreign, 3),
        },
        "model": model_dir,
        "workload": {
            **asdict(wl),
            "levels": args.levels,
            "min_seconds": args.min_seconds,
            "temperature": 1.0,
            "ignore_eos": True,
            "closed_loop": True,
        },
        "results": {res.name: asdict(res) for res in results},
        "features": {name: FEATURES[name] for name in names},
        "total_seconds": round(total, 1),
    }
    harness.write_json(args.json, payload)
    print(f"\nper-request SamplingParams features\n{_features_table(names)}\n")
    busy = "" if foreign is None else f"; other processes used {foreign:.0%} of the CPU meanwhile"
    print(f"wrote {args.json}; total {total:.0f} s{busy}\n")
    print(_results_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
