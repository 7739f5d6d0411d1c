"""The CPU engine's sampler draws from the right distribution and returns the right logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_sdk.engines._sampling import RowSampling, sample


def _reference(logits: torch.Tensor, u: float) -> int:
    p = torch.softmax(logits.double(), dim=-1)
    cdf = p.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))


@pytest.mark.parametrize("vocab", [3000, 4096, 151936])
def test_two_level_draw_matches_one_full_cdf(vocab: int) -> None:
    """Inverse CDF in two levels picks the same token as one cumulative sum, for the same uniform draw."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 3
    rnd = random.Random(1)
    us = [rnd.random() for _ in range(300)]
    rows = [RowSampling(1.0, -1, 1.0, 0.0, u) for u in us]
    toks, _ = sample(logits.repeat(len(us), 1), rows)
    same = sum(int(t) == _reference(logits, u) for t, u in zip(toks.tolist(), us, strict=True))
    assert same >= len(us) - 2  # at most a float tie at a block boundary


def test_empirical_distribution_follows_softmax() -> None:
    vocab = 2500
    logits = torch.zeros(vocab)
    logits[:5] = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    n = 4000
    rnd = random.Random(0)
    rows = [RowSampling(1.0, -1, 1.0, 0.0, rnd.random()) for _ in range(n)]
    toks, lps = sample(logits.repeat(n, 1), rows)
    p = torch.softmax(logits, dim=-1)
    for t in range(5):
        freq = (toks == t).float().mean().item()
        sd = (p[t].item() * (1 - p[t].item()) / n) ** 0.5
        assert abs(freq - p[t].item()) < 5 * sd + 1e-3, (t, freq, p[t].item())
    assert torch.allclose(lps, torch.log(p[toks]), atol=1e-5)


def test_temperature_scales_distribution_and_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    toks, lps = sample(logits.clone(), [RowSampling(0.5, -1, 1.0, 0.0, 0.999)])
    ref = torch.log_softmax(logits / 0.5, dim=-1)[0]
    assert lps.item() == pytest.approx(ref[toks.item()].item(), abs=1e-6)


def test_greedy_takes_argmax_with_temperature_one_logprob() -> None:
    logits = torch.tensor([[0.1, 5.0, 0.2], [3.0, 0.0, 0.0]])
    toks, lps = sample(logits.clone(), [RowSampling(0.0, -1, 1.0, 0.0, 0.3)] * 2)
    assert toks.tolist() == [1, 0]
    ref = torch.log_softmax(logits, dim=-1)
    assert lps.tolist() == pytest.approx([ref[0, 1].item(), ref[1, 0].item()], abs=1e-6)


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05]))
    rnd = random.Random(3)
    n = 600

    def draws(top_k: int, top_p: float, min_p: float) -> set[int]:
        rows = [RowSampling(1.0, top_k, top_p, min_p, rnd.random()) for _ in range(n)]
        toks, _ = sample(logits.repeat(n, 1), rows)
        return set(toks.tolist())

    assert draws(2, 1.0, 0.0) == {0, 1}
    assert draws(-1, 0.65, 0.0) == {0, 1}  # 0.4 + 0.3 covers 0.65
    assert draws(-1, 0.75, 0.0) == {0, 1, 2}
    assert draws(-1, 1.0, 0.6) == {0, 1}  # min_p * 0.4 = 0.24
    assert draws(1, 1.0, 0.0) == {0}


def test_zero_probability_tokens_are_never_drawn() -> None:
    vocab = 3000
    logits = torch.randn(vocab)
    banned = [5, 1024, 2047, 2999]
    logits[banned] = float("-inf")
    rows = [RowSampling(1.0, -1, 1.0, 0.0, u / 500) for u in range(500)]
    toks, _ = sample(logits.repeat(500, 1), rows)
    assert not set(toks.tolist()) & set(banned)
