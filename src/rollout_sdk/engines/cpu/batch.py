"""The running rows of the CPU engine and the KV cache they share: the surgery on that cache.

The cache is a transformers ``DynamicCache`` whose rows are left-padded to a common length ``T``:

* :meth:`Batch.admit` concatenates freshly prefilled rows (their own cache) in, left-padding the shorter
  side;
* :meth:`Batch.advance` grows every row by the token decoded this step;
* :meth:`Batch.drop_done` index-selects finished rows out and trims the columns that became padding in
  every remaining row;
* :meth:`Batch.clear` forgets everything (retract, memory release);
* :meth:`Batch.row_kv` copies one row's KV out, its padding trimmed (for the prefix cache, before
  ``drop_done`` drops a finished row).

Touched only by the worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from .sequence import Sequence

__all__ = ["Batch"]


class Batch:
    """Rows being decoded and their KV cache (see the module docstring)."""

    def __init__(self) -> None:
        self.rows: list[Sequence] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token
        self.next_pos: torch.Tensor | None = None  # [B] position of each row's next token
        self.last_tok: torch.Tensor | None = None  # [B] each row's last sampled token

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_live(self) -> int:
        """Rows still decoding (a row aborted on the loop thread stays until the next drop_done)."""
        return sum(not s.done for s in self.rows)

    @property
    def width(self) -> int:
        """Columns of the cache (the longest row, padding included)."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    @property
    def num_cached_tokens(self) -> int:
        """Real (unpadded) tokens the cache holds."""
        return 0 if self.mask is None else int(self.mask.sum())

    def clear(self) -> None:
        self.rows = []
        self.cache = self.mask = self.next_pos = self.last_tok = None

    def live_rows(self) -> list[Sequence]:
        return [s for s in self.rows if not s.done]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [B, 1], attention mask [B, T + 1], positions [B, 1])`` of this step's decode."""

        assert self.mask is not None and self.next_pos is not None and self.last_tok is not None
        mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype)], dim=1)
        return self.last_tok[:, None], mask, self.next_pos[:, None]

    def advance(self, mask: torch.Tensor, tokens: torch.Tensor) -> None:
        """After a decode step: the grown mask, and the token every row sampled."""
        assert self.next_pos is not None
        self.mask = mask
        self.next_pos = self.next_pos + 1
        self.last_tok = tokens

    def row_kv(self, i: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Row ``i``'s KV without its left padding: ``(n, [(K, V) per layer, each [1, H, n, D]])``, where
        the KV is that of the row's first ``n`` tokens.  Copies: a view would keep the whole batch's
        tensors alive.  ``(0, [])`` where the row's columns are not one run at the right (never expected)."""
        assert self.mask is not None
        width = int(self.mask.shape[1])
        n = int(self.mask[i].sum())
        if n == 0 or int(self.mask[i, width - n :].sum()) != n:
            return 0, []
        out = []
        for layer in _layers(self.cache):
            if layer.keys.shape[2] != width:
                return 0, []
            out.append(
                (layer.keys[i : i + 1, :, width - n :, :].clone(), layer.values[i : i + 1, :, width - n :, :].clone())
            )
        return n, out

    def drop_done(self) -> None:
        if not self.rows:
            return
        keep = [i for i, s in enumerate(self.rows) if not s.done]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.clear()
            return

        idx = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(idx)
        assert self.mask is not None and self.next_pos is not None and self.last_tok is not None
        self.mask = self.mask[idx]
        self.next_pos = self.next_pos[idx]
        self.last_tok = self.last_tok[idx]
        # columns that are padding in every remaining row can go
        first = int(self.mask.any(dim=0).nonzero()[0])
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in _layers(self.cache):
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def admit(
        self, rows: Seq[Sequence], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, last: torch.Tensor
    ) -> None:
        """Concatenate prefilled ``rows`` (with their own cache, mask, next positions, sampled tokens) in."""

        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos, self.last_tok = list(rows), cache, mask, next_pos, last
            return
        assert self.mask is not None and self.next_pos is not None and self.last_tok is not None
        width = max(self.mask.shape[1], mask.shape[1])
        for lo, ln in zip(_layers(self.cache), _layers(cache), strict=True):
            lo.keys = torch.cat([_left_pad(lo.keys, width), _left_pad(ln.keys, width)], dim=0)
            lo.values = torch.cat([_left_pad(lo.values, width), _left_pad(ln.values, width)], dim=0)
        self.mask = torch.cat([_left_pad_2d(self.mask, width), _left_pad_2d(mask, width)], dim=0)
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.last_tok = torch.cat([self.last_tok, last])
        self.rows = self.rows + list(rows)


def prefill_inputs(rows: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention mask, positions)`` of ``rows`` left-padded to the longest."""

    ctxs = [s.token_ids for s in rows]
    width = max(len(c) for c in ctxs)
    ids = torch.zeros(len(ctxs), width, dtype=torch.long)
    mask = torch.zeros(len(ctxs), width, dtype=torch.long)
    for i, c in enumerate(ctxs):
        ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c) :] = 1
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, pos


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a [B, H, T, D] tensor with zeros to T = width."""

    pad = width - t.shape[2]
    if pad == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], pad, t.shape[3]), t], dim=2)


def _left_pad_2d(t: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - t.shape[1]
    if pad == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], pad), t], dim=1)
