"""Masks and index plans that let mask-based kernels (torch SDPA) serve packed and paged batches.

SDPA has no cu_seqlens. Looping over sequences in Python, per layer, is what made
custom vision attention slow, so a packed batch is instead turned into one SDPA
call with indices and masks built once per forward (memoised on the metadata):

* ``block_diag``: all T tokens as one sequence with a (T, T) block-diagonal mask.
  No copies of q/k/v, but the mask costs T^2.
* ``padded``: scatter into (B, max_len) rows with a (B, max_len, max_len) mask,
  then gather back. Costs B * max_len^2 plus two copies of q/k/v.

`varlen_strategy` picks the smaller mask: equal lengths favour neither, one long
sequence among many short ones favours block-diagonal, many similar sequences
favour padding. Kernels with native varlen (FA2/FA3/torch varlen) need none of this.

Semantics shared by every backend: query at position p sees key at position j
iff (not causal or j <= p) and, with a window (left, right), p - left <= j <= p + right
(-1 = unbounded). When queries are the last S_q of S_k keys, p = i + S_k - S_q
(flash-attention's bottom-right alignment).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate

import torch

Window = tuple[int, int] | None


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Window) -> torch.Tensor:
    ok = torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        ok &= k_pos <= q_pos
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= k_pos >= q_pos - left
        if right >= 0:
            ok &= k_pos <= q_pos + right
    return ok


def needs_mask(causal: bool, window: Window, s_q: int, s_k: int) -> bool:
    """Whether a dense call needs an explicit mask (is_causal alone is top-left aligned)."""
    return window is not None or (causal and s_q != s_k)


@lru_cache(maxsize=32)
def dense_mask(s_q: int, s_k: int, causal: bool, window: Window, device: torch.device) -> torch.Tensor:
    """(S_q, S_k) bool, cached: dense layers of one shape share it across layers and steps."""
    q_pos = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    k_pos = torch.arange(s_k, device=device)[None, :]
    return allowed(q_pos, k_pos, causal, window)


def varlen_strategy(meta) -> str:
    if meta.sdpa_strategy is not None:
        return meta.sdpa_strategy
    total = meta.total_tokens
    return "block_diag" if total * total <= meta.batch_size * meta.max_seqlen**2 else "padded"


def block_diag_mask(meta, causal: bool, window: Window) -> torch.Tensor:
    """(1, 1, T, T) bool: tokens see only tokens of their own sequence."""

    def build():
        seq, pos = meta.sequence_ids, meta.positions
        same = seq[:, None] == seq[None, :]
        return (same & allowed(pos[:, None], pos[None, :], causal, window))[None, None]

    return meta.cached(("block_diag_mask", causal, window), build)


def pad_index(lens: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    """(T,) int64: the row of each packed token in a (B * width) padded layout."""
    starts = [0, *accumulate(lens)][:-1]
    shift = torch.tensor([b * width - s for b, s in enumerate(starts)], dtype=torch.int64, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    return torch.arange(seq.numel(), device=device, dtype=torch.int64) + shift[seq]


def _rows_valid(lens: tuple[int, ...], width: int, device) -> torch.Tensor:
    return torch.arange(width, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]


def padded_mask(meta, causal: bool, window: Window) -> torch.Tensor:
    """(B, 1, max, max) bool for the padded layout of a packed batch."""

    def build():
        width, device = meta.max_seqlen, meta.device
        pos = torch.arange(width, device=device)
        valid = _rows_valid(meta.seqlens, width, device)  # (B, max)
        mask = allowed(pos[:, None], pos[None, :], causal, window)[None] & valid[:, None, :]
        return _unblock_padding_rows(mask, valid)[:, None]

    return meta.cached(("padded_mask", causal, window), build)


def _unblock_padding_rows(mask: torch.Tensor, rows_valid: torch.Tensor) -> torch.Tensor:
    # A padding query row with every key masked gives NaN in SDPA; let it see key 0. Its output
    # is dropped when unpadding, so what it sees does not matter, only that it is finite.
    first_key = torch.zeros_like(mask[0, 0])
    first_key[0] = True
    return torch.where(rows_valid[:, :, None], mask, first_key)


def pad(x: torch.Tensor, index: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """(T, H, D) packed -> (B, width, H, D) zero-padded."""
    out = x.new_zeros((batch * width, *x.shape[1:]))
    out.index_copy_(0, index, x)
    return out.view(batch, width, *x.shape[1:])


def unpad(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, width, H, D) -> (T, H, D), the inverse of `pad`."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)


def paged_slots(meta) -> torch.Tensor:
    """(B, max_context) int64: pool slot of each cached token of each sequence (0 past its end)."""

    def build():
        page, device = meta.page_size, meta.device
        j = torch.arange(meta.max_context_len, device=device)
        pages = meta.block_table[:, torch.div(j, page, rounding_mode="floor")].long()
        slots = pages * page + j % page
        in_context = j[None, :] < meta.context_lens[:, None].long()
        return torch.where(in_context, slots, torch.zeros_like(slots))

    return meta.cached("paged_slots", build)


def paged_mask(meta, causal: bool, window: Window) -> torch.Tensor:
    """(B, 1, max_q, max_context) bool: padded new-token queries against gathered pages."""

    def build():
        device = meta.device
        ctx = meta.context_lens.long()[:, None, None]
        qlen = torch.tensor(meta.query_lens, device=device)[:, None, None]
        i = torch.arange(meta.max_seqlen_q, device=device)[None, :, None]
        j = torch.arange(meta.max_context_len, device=device)[None, None, :]
        mask = allowed(ctx - qlen + i, j, causal, window) & (j < ctx)
        rows_valid = _rows_valid(meta.query_lens, meta.max_seqlen_q, device)
        return _unblock_padding_rows(mask, rows_valid)[:, None]

    return meta.cached(("paged_mask", causal, window), build)


def paged_q_index(meta) -> torch.Tensor:
    return meta.cached("paged_q_index", lambda: pad_index(meta.query_lens, meta.max_seqlen_q, meta.device))


def varlen_pad_index(meta) -> torch.Tensor:
    return meta.cached("pad_index", lambda: pad_index(meta.seqlens, meta.max_seqlen, meta.device))
