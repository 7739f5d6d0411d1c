"""TRL on rollout-sdk (real trl, CPU, the embedded tiny model): GRPOTrainer's rollout_func and
AsyncGRPOTrainer's rollout worker / weight transfer, a few training steps each."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402

from rollout_sdk.integrations.trl import (  # noqa: E402
    AsyncRolloutWorker,
    GRPORolloutFunc,
    RolloutBridge,
    WeightTransfer,
    sampling_from_args,
)

pytestmark = pytest.mark.slow

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _dataset(n: int = 8) -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(n)])


def _reward_len(completions: list[Any], **_: Any) -> list[float]:
    return [float(len(c[0]["content"])) for c in completions]


def _logprobs_under(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The trainer-side reference: a transformers forward of the trainer's own model, fp32."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        logits = model(ids).logits.float()[0]
    lp = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    return lp[n - 1 : n - 1 + len(completion_ids)].gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


class _CheckedRolloutFunc(GRPORolloutFunc):
    """Records every call and checks that the engine decoded with the trainer's current weights."""

    def __init__(self, bridge: RolloutBridge) -> None:
        super().__init__(bridge)
        self.calls: list[dict[str, Any]] = []
        self.max_diff = 0.0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = super().__call__(prompts, trainer)
        model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
        for p, c, lps in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
            if c:
                ref = _logprobs_under(model, p, c)
                self.max_diff = max(self.max_diff, float((ref - torch.tensor(lps)).abs().max()))
        self.calls.append({"step": trainer.state.global_step, "versions": list(out["weight_version"]), **out})
        return out


@pytest.mark.timeout(600)  # real training steps on a shared 2-core machine; the bound only catches a hang
def test_grpo_trainer_generates_through_rollout_sdk(tiny_model: Path, tmp_path: Path) -> None:
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=3,
        learning_rate=0.05,  # large enough that every step visibly changes the weights
        temperature=1.0,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32 on both sides, so the logprob check below is exact to fp32 noise
        save_strategy="no",
        seed=0,
    )
    with RolloutBridge() as bridge:  # the embedded CPU engine, on the same tiny model
        rollout = _CheckedRolloutFunc(bridge)
        trainer = GRPOTrainer(
            model=str(tiny_model), reward_funcs=_reward_len, args=args, train_dataset=_dataset(), rollout_func=rollout
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        versions = bridge.run(_server_versions)

    assert [c["step"] for c in rollout.calls] == [0, 1, 2]
    assert rollout.pushed_versions == [0, 1, 2]  # weights pushed before each step's generation
    assert [sorted(set(c["versions"])) for c in rollout.calls] == [[0], [1], [2]]  # ... and generated from
    assert versions == [2]
    for c in rollout.calls:
        assert len(c["completion_ids"]) == 4 and all(len(ids) >= 1 for ids in c["completion_ids"])
        assert all(len(lp) == len(ids) for lp, ids in zip(c["logprobs"], c["completion_ids"], strict=True))
    # the engine's logprobs are those of the trainer's current model (fp32 CPU on both sides)
    assert rollout.max_diff < 1e-3, rollout.max_diff
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed
    assert trainer.state.log_history[-1]["train_loss"] is not None


class _TorchVarlenAttention:
    """``flash_attn_varlen_func`` (causal, bottom-right aligned, GQA) in plain torch, for CPU tests."""

    @staticmethod
    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        _max_q: Any,
        _max_k: Any,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        **_: Any,
    ) -> torch.Tensor:
        assert causal and window_size == (-1, -1)
        out = torch.empty_like(q)
        rep = q.shape[1] // k.shape[1]
        for i in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            qi = q[qs:qe].transpose(0, 1)
            ki = k[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1)
            vi = v[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1)
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
            o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale)
            out[qs:qe] = o.transpose(0, 1)
        return out


async def _server_versions(client: Any) -> list[int]:
    stats = [await s.fetch_stats() for s in client.servers]
    return [s.weight_version for s in stats]


@pytest.mark.timeout(600)  # real training steps on a shared 2-core machine; the bound only catches a hang
def test_async_grpo_trainer_on_rollout_sdk(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    # trl 1.16.0's AsyncGRPOTrainer is GPU-only in two places that have nothing to do with rollouts: it asks
    # torch.cuda for the device name (MFU metrics), and it trains through FlashAttention-3's varlen kernel
    # (downloaded with `kernels`).  On CPU: no MFU, and the same varlen causal attention in plain torch.
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *_a, **_k: None)
    monkeypatch.setattr(packing, "_flash_attn", lambda: _TorchVarlenAttention)

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.05,
        token_budget=96,  # one packed micro-batch of ~3 samples: keeps the CPU backward small
        max_staleness=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    with RolloutBridge() as bridge:
        worker = AsyncRolloutWorker(
            bridge,
            dataset=list(_dataset()),
            reward_funcs=_reward_len,
            processing_class=tokenizer,
            num_generations=args.num_generations,
            sampling=sampling_from_args(args),
            max_inflight_groups=2,
            queue_maxsize=16,
        )
        transfer = WeightTransfer(bridge)
        trainer = AsyncGRPOTrainer(
            model=str(tiny_model),
            reward_funcs=_reward_len,
            args=args,
            train_dataset=_dataset(),
            processing_class=tokenizer,
            rollout_worker=worker,
            weight_transfer=transfer,
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        versions = bridge.run(_server_versions)

    assert transfer.version == 1 + 2  # the cold sync, then one per step
    assert trainer.model_version == transfer.version
    assert versions == [transfer.version]
    assert transfer.last_update  # timings of the last broadcast
    assert worker.groups_done >= 2
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed
