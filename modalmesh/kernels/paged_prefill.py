"""Causal attention of prompt chunks that continue a cached prefix, over the paged KV pool (Triton).

A chunk is a sequence's new tokens: the last `query_len` of its `context_len`, which attend to the whole
cached prefix and causally to each other. The decode kernel (`triton_paged.paged_decode`) can take such a
chunk one token at a time, but then every token re-reads its whole context: a 512-token chunk over a
2,048-token prefix reads the prefix 512 times, and the LLM had sent such steps to SDPA over gathered pages
instead (78 TFLOP/s on an H200, against 600+ for dense varlen). Here one program takes a block of a
chunk's consecutive tokens together with their GQA group of query heads — BLOCK_M rows of (token, head) —
and reads each key/value block once for all of them, as FlashAttention-2 does: an online softmax over key
blocks with float32 statistics, the pages found through the block table as it walks.

The host cuts the chunks into blocks (`plan_blocks`, a `BlockPlan` bound to its launch config): each block
is (block-table row, first token's row in q, tokens, the first token's causal length), so chunks of one step may sit anywhere in q, beside rows other
kernels write. Keys below a block's first causal length are visible to all its rows, so only the last few
key blocks (the chunk's own diagonal) and sliding windows are masked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from modalmesh.attention.metadata import host_to_device
from modalmesh.kernels import block

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # (token, head) rows per program: BLOCK_M // group tokens of one chunk
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


# Measured on an H100 for head dim 128 (bench/attention.py's paged prefill rows); larger heads halve the rows
# to keep the accumulator in registers.
DEFAULT = LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
WIDE_HEADS = LaunchConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)


def config_for(head_dim: int, group: int) -> LaunchConfig:
    base = DEFAULT if head_dim <= 128 else WIDE_HEADS
    if base.block_m < group:  # at least one token's whole group per program
        base = LaunchConfig(block(group), base.block_n, base.num_warps, base.num_stages)
    return base


@functools.cache
def _kernel():
    from modalmesh.kernels._paged_prefill_triton import paged_prefill as kernel

    return kernel


@dataclass(frozen=True)
class BlockPlan:
    """A step's chunks cut into the blocks one launch config takes: `blocks` on the host, each (block-table
    row, first token's row in q, tokens, first token's causal length), and `table`, the same as int32 (n, 4)
    on the device. The config travels with the plan, so a launch can never cut blocks one way and run them
    another (a block of more tokens than the program has rows would leave its last tokens unwritten)."""

    config: LaunchConfig
    blocks: tuple[tuple[int, int, int, int], ...]
    table: torch.Tensor


def plan_blocks(query_lens: Sequence[int], context_lens: Sequence[int], rows: Sequence[int], *, group: int,
                config: LaunchConfig, device, seqs: Sequence[int] | None = None) -> BlockPlan:
    """The blocks of the chunks of `seqs` (default: every sequence with new tokens), BLOCK_M // group tokens
    each. Sequence b's new tokens are q rows rows[b] .. rows[b] + query_lens[b] - 1, the last of its
    context_lens[b] tokens."""
    per_block = config.block_m // group
    blocks = []
    for b in range(len(query_lens)) if seqs is None else seqs:
        q, c = query_lens[b], context_lens[b]
        for j in range(0, q, per_block):
            blocks.append((b, rows[b] + j, min(per_block, q - j), c - q + j + 1))
    table = host_to_device(blocks, torch.int32, device).view(-1, 4)
    return BlockPlan(config, tuple(blocks), table)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  plan: BlockPlan, *, scale: float, window=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q (T, H, D) -> (T, H, Dv): the rows that `plan`'s blocks name are written to `out` (new if None);
    other rows are left as they are."""
    kernel = _kernel()
    _, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    config = plan.config
    if out is None:
        out = q.new_empty((*q.shape[:-1], dim_v))
    if not plan.blocks:
        return out
    left = -1 if window is None or window[0] < 0 else int(window[0])
    kernel[(len(plan.blocks), kv_heads)](
        q, k_cache, v_cache, out, block_table, plan.table, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=heads // kv_heads, BLOCK_M=config.block_m, D=dim, D_PAD=max(16, block(dim)), DV=dim_v,
        DV_PAD=max(16, block(dim_v)), PAGE=page, BLOCK_N=config.block_n, WINDOW_LEFT=left,
        IEEE=q.dtype == torch.float32, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


__all__ = ["DEFAULT", "BlockPlan", "LaunchConfig", "config_for", "paged_prefill", "plan_blocks"]
