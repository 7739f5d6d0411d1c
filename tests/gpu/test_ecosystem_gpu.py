"""GPU tier for scoring and MoE routing replay on SGLang (needs a GPU and sglang; skipped elsewhere).

* scoring: weights pushed by CUDA IPC into a 0.5B-shaped engine, then ``client.score`` compared with a
  transformers forward of the same weights on the same GPU (bf16 on both sides), and with the logprobs
  SGLang reported while generating the same tokens;
* routing replay: a small Qwen3-MoE-shaped model with dummy weights, ``enable_return_routed_experts``;
  every fed token's experts come back, in range, identical for identical greedy requests.

Run on the device machine: ``pytest tests/gpu/test_ecosystem_gpu.py -m gpu``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from rollout_sdk import EngineServer, GenerateRequest, RolloutClient, SamplingParams, ServerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]
#: these tests' engines: smaller than the other modules' (two run one after the other)
SMALL = dict(mem_fraction_static=0.4, cuda_graph_max_bs=16)


async def test_score_matches_transformers_on_gpu(qwen_05b_dir: str, sglang_config: Callable[..., Any]) -> None:
    import torch
    from gpu_check import hf_named  # type: ignore[import-not-found]
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout_sdk.engines.sglang import SglangEngine

    named = hf_named("0.5b", "cuda:0")
    prompt = [(7919 * i) % 150_000 for i in range(1, 41)]
    async with (
        EngineServer(SglangEngine(sglang_config(qwen_05b_dir, **SMALL)), ServerConfig()) as server,
        RolloutClient([server.address]) as client,
    ):
        await client.update_weights(named, version=1, method="ipc")
        scored = await client.score(prompt)
        full = await client.generate(GenerateRequest(input_ids=prompt, score_only=True))
        gen = await client.generate(prompt, sampling=SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
        rescored = await client.score(prompt + gen.output_ids)
    assert full.weight_version == 1 and full.output_ids == []
    assert len(scored) == len(prompt) - 1

    cfg = AutoConfig.from_pretrained(qwen_05b_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    missing, _ = model.load_state_dict(dict(named), strict=False)
    assert not [m for m in missing if m != "lm_head.weight"]  # tied head
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits.float()[0], dim=-1)
    want = lp[:-1].gather(1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0].cpu()
    diff = (torch.tensor(scored) - want).abs()
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5, (float(diff.mean()), float(diff.max()))
    # the prompt logprobs of generated tokens are the logprobs SGLang sampled them with
    assert gen.logprobs is not None
    tail = torch.tensor(rescored[-len(gen.output_ids) :])
    assert float((tail - torch.tensor(gen.logprobs)).abs().max()) < 0.1


def _moe_model_dir() -> str:
    d = tempfile.mkdtemp(prefix="qwen3moe-tiny-")
    cfg = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    )
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


async def test_routed_experts_replay_on_a_small_moe(sglang_config: Callable[..., Any]) -> None:
    from rollout_sdk.engines.sglang import SglangEngine
    from rollout_sdk.export import trajectory_from_result, write_jsonl

    engine = SglangEngine(sglang_config(_moe_model_dir(), **SMALL, extra={"enable_return_routed_experts": True}))
    prompt = [11, 22, 33, 44, 55]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    async with (
        EngineServer(engine, ServerConfig()) as server,
        RolloutClient([server.address]) as client,
    ):
        a = await client.generate(GenerateRequest(input_ids=prompt, sampling=sp, return_routed_experts=True))
        b = await client.generate(GenerateRequest(input_ids=prompt, sampling=sp, return_routed_experts=True))
        plain = await client.generate(prompt, sampling=sp)
    assert plain.routed_experts is None
    assert a.routed_experts is not None and b.routed_experts is not None
    re = a.routed_experts
    assert (re.num_tokens, re.num_layers, re.top_k) == (len(prompt) + len(a.output_ids) - 1, 2, 2)
    arr = re.to_numpy()
    assert arr.min() >= 0 and arr.max() < 8
    assert all(len(set(map(int, row))) == 2 for row in arr.reshape(-1, 2))  # top-2 picks two experts
    assert a.output_ids == b.output_ids and re.data == b.routed_experts.data  # greedy replays exactly
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        write_jsonl([trajectory_from_result(prompt, a)], f.name)
        from rollout_sdk.export import read_jsonl

        (back,) = read_jsonl(f.name)
    assert back.routed_experts[0] == re
