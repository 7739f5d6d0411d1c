"""Logprob parity between the rollout engine and a trainer-side transformers forward, before and after a
weight update, on a real-format checkpoint (safetensors + tokenizer files, loaded with load_format="auto").

    python bench/gpu_parity.py --json $OUT/parity.json                 # SGLang on the GPU, IPC update
    python bench/gpu_parity.py --engine cpu --json /tmp/parity.json    # CPU dry run (gloo update)

1. The checkpoint: the embedded tiny Qwen2 model (``rollout_sdk.models.tiny``: model.safetensors,
   config.json, generation_config.json, tokenizer.json, tokenizer_config.json), built from its fixed seed;
   its sha256 is recorded so it can be matched with the same recipe's file anywhere.
2. The engine loads it from disk (SGLang: ``load_format="auto"``, bf16) behind an EngineServer; prompts
   are real text encoded with the checkpoint's own tokenizer; a RolloutClient samples (temperature 1,
   logprobs on).
3. The reference: ``AutoModelForCausalLM.from_pretrained`` of the same directory in the same dtype, one
   forward over prompt + sampled tokens, fp32 log-softmax at every sampled position.  |engine - ref|:
   mean, max, p99.
4. A trainer-side copy of the weights is changed (embeddings x ``--embed-scale``, which makes the
   distribution far from flat, and a small perturbation of every other tensor), pushed through
   ``client.update_weights`` (IPC on a GPU, a gloo group on CPU), and parity is checked again against the
   reference loaded with the new weights.  A flat distribution hides mismatches (every logprob near
   -log(vocab)); the scaled one does not, so both the mean logprob and the entropy are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import harness  # noqa: E402  (bench/harness/)

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In reinforcement learning, the policy gradient",
    "Solve for x: 3x + 7 = 22. First, subtract",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "import torch\nimport torch.nn as nn\n\nclass MLP(nn.Module):",
    "The three laws of thermodynamics are",
]


def log(msg: str) -> None:
    print(f"[parity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def reference(model: Any, prompts: list[list[int]], results: list[Any]) -> dict[str, Any]:
    """Compare each result's logprobs with a forward of ``model`` over prompt + output."""
    import torch

    diffs: list[float] = []
    ref_all: list[float] = []
    entropies: list[float] = []
    dev = next(model.parameters()).device
    with torch.no_grad():
        for p, r in zip(prompts, results, strict=True):
            out = list(r.output_ids)
            if not out:
                continue
            ids = torch.tensor([p + out], device=dev)
            logits = model(ids).logits[0, len(p) - 1 : len(p) - 1 + len(out)].float()
            lsm = torch.log_softmax(logits, dim=-1)
            ref = lsm.gather(1, torch.tensor(out, device=dev)[:, None])[:, 0].cpu().tolist()
            entropies += (-(lsm.exp() * lsm).sum(-1)).cpu().tolist()
            got = list(r.logprobs or [])
            diffs += [abs(a - b) for a, b in zip(got, ref, strict=True)]
            ref_all += ref
    diffs_sorted = sorted(diffs)
    return {
        "tokens": len(diffs),
        "mean_abs_diff": round(statistics.fmean(diffs), 5),
        "max_abs_diff": round(max(diffs), 5),
        "p99_abs_diff": round(diffs_sorted[int(0.99 * (len(diffs_sorted) - 1))], 5),
        "ref_mean_logprob": round(statistics.fmean(ref_all), 4),
        "mean_entropy_nats": round(statistics.fmean(entropies), 4),
    }


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_sdk import EngineServer, RolloutClient, SamplingParams, ServerConfig
    from rollout_sdk.models.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(a.home))
    res: dict[str, Any] = {
        "engine": a.engine,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "checkpoint": sorted(os.listdir(path)),
        "safetensors_sha256": sha256(os.path.join(path, "model.safetensors")),
        "dtype": a.dtype,
    }
    log(f"checkpoint {path}: {res['checkpoint']} sha256={res['safetensors_sha256'][:16]}")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    device = "cuda:0" if a.engine == "sglang" else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    engine: Any
    if a.engine == "sglang":
        from rollout_sdk.engines.sglang import SglangEngine, SglangEngineConfig

        engine = SglangEngine(
            SglangEngineConfig(
                model_path=path,
                load_format="auto",
                dtype=a.dtype,
                attention_backend=a.attn,
                sampling_backend="pytorch",
                mem_fraction_static=a.mem_fraction,
                cuda_graph_max_bs=64,
                random_seed=0,
                extra={"disable_prefill_cuda_graph": True},
            )
        )
    else:
        from rollout_sdk.engines.cpu import CpuEngine, CpuEngineConfig

        engine = CpuEngine(CpuEngineConfig(model_path=path, dtype=a.dtype))
    sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, ignore_eos=True)
    batch = [p for p in prompts for _ in range(a.samples)]
    async with (
        EngineServer(engine, ServerConfig(server_id="parity")) as server,
        RolloutClient(servers=[server.address]) as client,
    ):
        t0 = time.perf_counter()
        before = await asyncio.gather(*(client.generate(p, sampling=sp) for p in batch))
        res["before"] = reference(ref_model, batch, before)
        res["before"]["generate_s"] = round(time.perf_counter() - t0, 3)
        log(f"before update: {res['before']}")

        # the trainer-side copy: change every tensor, scale the embeddings
        g = torch.Generator(device="cpu").manual_seed(7)
        new: list[tuple[str, Any]] = []
        for name, p in ref_model.named_parameters():
            t = p.detach().float().cpu()
            if name.endswith("embed_tokens.weight"):
                t = t * a.embed_scale
            elif not name.endswith("norm.weight"):
                t = t + 0.02 * torch.randn(t.shape, generator=g)
            new.append((name, t.to(dtype).to(device)))
        with torch.no_grad():
            params = dict(ref_model.named_parameters())
            for name, t in new:
                params[name].copy_(t)
        t0 = time.perf_counter()
        if a.engine == "sglang":
            stats = await client.update_weights(new, version=1, method="ipc")
        else:
            await client.init_weight_sync(backend="gloo", device="cpu")
            stats = await client.update_weights([(n, t.cpu()) for n, t in new], version=1)
        res["update"] = {"s": round(time.perf_counter() - t0, 3), **{k: v for k, v in stats.items()}}
        log(f"update: {res['update']}")
        after = await asyncio.gather(*(client.generate(p, sampling=sp) for p in batch))
        res["after_version"] = sorted({r.weight_version for r in after})
        res["after"] = reference(ref_model, batch, after)
        log(f"after update: {res['after']}")
    res["ok"] = all(res[k]["mean_abs_diff"] <= a.tolerance for k in ("before", "after")) and res["after_version"] == [1]
    return res


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--engine", default="sglang", choices=["sglang", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--embed-scale", type=float, default=12.0)
    ap.add_argument("--tolerance", type=float, default=0.02, help="mean |diff| allowed (bf16)")
    ap.add_argument("--home", default=None, help="where the tiny model is built")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from rollout_sdk import EngineStartupError

    res: dict[str, Any] = {}
    for attn in dict.fromkeys([a.attn, "torch_native"] if a.engine == "sglang" else [a.attn]):
        a.attn = attn
        try:
            res = asyncio.run(run(a))
            res["attention_backend"] = attn
            break
        except EngineStartupError as exc:  # e.g. a kernel that does not take the tiny model's head_dim 16
            log(f"SGLang did not start with attention_backend={attn}: {exc}")
            res = {"failed": {attn: str(exc)[-2000:]}}
    if a.json:
        harness.write_json(a.json, res, indent=1)
    if "before" not in res:
        raise SystemExit("parity: no engine started")
    for k in ("before", "after"):
        r = res[k]
        print(
            f"{k:6s} tokens={r['tokens']} mean|d|={r['mean_abs_diff']:.5f} max|d|={r['max_abs_diff']:.5f} "
            f"p99|d|={r['p99_abs_diff']:.5f} ref mean logprob={r['ref_mean_logprob']:.3f} "
            f"entropy={r['mean_entropy_nats']:.3f} nats"
        )
    print(f"update {res['update']}  ok={res['ok']}  sha256={res['safetensors_sha256'][:16]}")


if __name__ == "__main__":
    main()
