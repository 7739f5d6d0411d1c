"""Token sampling for the CPU engine, exact, cheap on a 150k-token vocabulary, and unable to fail.

The cost of a small model's decode step on CPU is passes over the ``[rows, vocab]`` logits, so the common
path (no top-k / top-p / min-p) makes one full pass, a softmax, then sums the probabilities per block of
1,024 tokens.  A token is then drawn by inverse CDF in two levels (pick a block by its mass, then a token
inside the block): the same distribution as one cumulative sum over the whole vocabulary, with one
uniform number per token.  Rows with top-k / top-p / min-p take the exact full-vocabulary path.

The returned logprob of a token is ``log softmax(logits / T)[token]`` (T = 1 for greedy rows): after
penalties and temperature, before truncation — the same definition SGLang uses.

Numerics (every value SamplingParams accepts is safe here):

* logits are float32; each row's maximum is subtracted before the temperature divides (so no finite logit
  overflows into a wrong token) and again in the softmax;
* a temperature below :data:`GREEDY_TEMPERATURE` is greedy (``logits / 1e-40`` overflows float32), one
  above :data:`MAX_TEMPERATURE` is clamped to it;
* repetition penalties are clamped to :data:`PENALTY_RANGE` (``logit / 1e-300`` overflows);
* NaN logits count as impossible and ``+inf`` as the largest float; a row left with no possible token
  (the server refuses requests that would ask for that) samples uniformly rather than failing;
* a drawn index always has positive probability, so it is inside the vocabulary and its logprob is
  finite (a float tie at the top of a cumulative sum falls back to the row's most likely token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..protocol import GREEDY_TEMPERATURE, PENALTY_RANGE

__all__ = ["GREEDY_TEMPERATURE", "MAX_TEMPERATURE", "PENALTY_RANGE", "RowSampling", "sample"]

#: temperatures above this are clamped to it (the distribution is uniform to float32 precision long before)
MAX_TEMPERATURE = 1e6
_FLOAT32_MAX = 3.4028234663852886e38


class RowSampling:
    """What the sampler needs of one row."""

    __slots__ = ("min_p", "temperature", "top_k", "top_p", "u")

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.min_p = min_p
        self.u = u  # the row's uniform draw in [0, 1)

    @property
    def greedy(self) -> bool:
        return not self.temperature >= GREEDY_TEMPERATURE

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


_BLOCK = 1024


def sample(logits: torch.Tensor, rows: Sequence[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (``[n, vocab]``, float32, modified in place).

    Returns ``(tokens [n] int64, logprobs [n] float32)``.
    """
    n, vocab = logits.shape
    temps = [1.0 if r.greedy else min(r.temperature, MAX_TEMPERATURE) for r in rows]
    _sanitize_(logits)
    if any(t != 1.0 for t in temps):
        # shift each row's maximum to 0 first: dividing a large finite logit by T < 1 would overflow to
        # -inf (or +inf) and wipe out the very token that should win; after the shift the best token stays
        # at 0 and what overflows is only ever "impossible" (-inf)
        logits.sub_(logits.amax(dim=-1, keepdim=True))
        logits.div_(torch.tensor(temps, dtype=logits.dtype)[:, None])
    probs = torch.softmax(logits, dim=-1)  # the one full pass (max-subtracted)
    toks = torch.empty(n, dtype=torch.long)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    plain = [i for i, r in enumerate(rows) if not r.greedy and not r.filtered]
    filtered = [i for i, r in enumerate(rows) if not r.greedy and r.filtered]

    if greedy:
        gi = torch.tensor(greedy, dtype=torch.long)
        toks[gi] = logits[gi].argmax(dim=-1)
    if plain:
        pi = torch.tensor(plain, dtype=torch.long)
        u = torch.tensor([rows[i].u for i in plain], dtype=torch.float64)
        # level 1: a block of _BLOCK tokens (the last one may be shorter), by its share of the mass
        full = vocab // _BLOCK * _BLOCK
        p = probs[pi] if len(plain) < n else probs
        mass = p[:, :full].reshape(len(plain), -1, _BLOCK).sum(dim=-1)
        if full < vocab:
            mass = torch.cat([mass, p[:, full:].sum(dim=-1, keepdim=True)], dim=1)
        cdf = mass.double().cumsum(dim=-1)
        target = u * cdf[:, -1]
        blk = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        below = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
        # level 2: a token inside that block, with what is left of the draw
        start = blk * _BLOCK
        idx = (start[:, None] + torch.arange(_BLOCK)[None, :]).clamp_(max=vocab - 1)
        inner = p.gather(1, idx).double()
        inner = torch.where(start[:, None] + torch.arange(_BLOCK)[None, :] < vocab, inner, 0.0)
        icdf = inner.cumsum(dim=-1)
        # keep the draw strictly inside the block's mass, so a zero-probability token is never hit
        rest = torch.minimum((target - below).clamp_(min=0.0), icdf[:, -1] * (1.0 - 1e-12))
        off = torch.searchsorted(icdf, rest[:, None], right=True).squeeze(1).clamp_(max=_BLOCK - 1)
        toks[pi] = start + off
    for i in filtered:
        r = rows[i]
        kept = _filter(probs[i], r.top_k, r.top_p, r.min_p).double()
        cdf1 = kept.cumsum(0)
        total = float(cdf1[-1])
        x = torch.tensor([min(r.u * total, total * (1.0 - 1e-12))], dtype=torch.float64)
        toks[i] = int(torch.searchsorted(cdf1, x, right=True))

    toks.clamp_(0, vocab - 1)
    picked = probs.gather(1, toks[:, None]).squeeze(1)
    zero = ~(picked > 0.0)
    if bool(zero.any()):  # a float tie at the top of a cumulative sum: take the row's most likely token
        toks[zero] = probs[zero].argmax(dim=-1)
        picked = probs.gather(1, toks[:, None]).squeeze(1)
    return toks, picked.log()


def _sanitize_(logits: torch.Tensor) -> None:
    """NaN → impossible, +inf → the largest float; a row with no possible token becomes uniform."""
    if bool(torch.isfinite(logits.amax(dim=-1)).all()):  # amax propagates NaN: one pass in the usual case
        return
    torch.nan_to_num_(logits, nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))
    dead = ~torch.isfinite(logits.max(dim=-1).values)
    if bool(dead.any()):
        logits[dead] = 0.0


def _filter(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero the tokens that top-k / top-p / min-p exclude; the most likely token always stays."""
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(0)
        drop = (cum - sorted_p) > top_p * cum[-1]  # tokens wholly beyond the nucleus
        probs = torch.zeros_like(probs).scatter_(0, order, torch.where(drop, 0.0, sorted_p))
    return probs
