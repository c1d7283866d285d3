"""y = x @ W.T (+ bias) for a few rows of x (M <= MAX_ROWS): the weight products of a small-batch decode step.

At batch 1 a decode step's time is reading the weights once, and cuBLAS leaves
bandwidth unused on the smaller products (an H200 runs qkv and o_proj at
2.3-3 TB/s of its ~4.4, and splits down_proj's K with a second, reduce kernel).
This kernel is one launch per product: each program owns BLOCK_N rows of W
(all M rows of x) and walks the whole K in BLOCK_K chunks, a [BLOCK_N, BLOCK_K]
tile contiguous along K at a time, summing in float32; the result is rounded
once to x's dtype, bias included, as F.linear does. No split-K, so no atomics,
no zeroing and no reduce kernel, and nothing depends on tensor values: it can
be captured in a CUDA graph.

The launch config (`GemvConfig`) decides how fast it is; `default_config` is the
one measured best across the shapes, `CANDIDATES` the ones bench/gemv.py sweeps on
the device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from modalmesh import kernels

MAX_ROWS = 4
# The rows the layers send here (modalmesh.layers.linear): measured on an H200 (bench/llm.py, 2026-12-03), one
# row beats cuBLAS (batch-1 decode 240.7 against 224.5 tok/s) but four lose (623.7 against 883.5 at batch 4):
# cuBLAS reuses each weight tile across rows with tensor cores, this kernel sums each row on its own.
ROUTED_ROWS = 1
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows of W per program
    block_k: int  # columns of W per step of a program's loop
    num_warps: int = 4
    num_stages: int = 3  # >1 prefetches the next tiles (cp.async): a loop without tl.dot pipelines only when asked

    def __str__(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


# Worth trying on the device: tile shape (rows x columns), loads in flight (stages), warps per program.
CANDIDATES = (
    GemvConfig(2, 2048),
    GemvConfig(4, 1024),
    GemvConfig(4, 1024, num_stages=1),
    GemvConfig(8, 512),
    GemvConfig(8, 512, num_stages=1),
    GemvConfig(16, 256),
    GemvConfig(4, 2048, num_warps=8),
    GemvConfig(8, 1024, num_warps=8, num_stages=2),
    GemvConfig(4, 512, num_warps=2, num_stages=4),
    GemvConfig(2, 1024, num_warps=2, num_stages=4),
)


@functools.cache
def default_config(n: int, k: int) -> GemvConfig:
    """8 rows x 512 columns, 4 warps, 3 stages (no wider than K needs): in bench/gemv.py's sweep on an H200
    (2026-12-03) within 2 % of the best of CANDIDATES on each Qwen2.5-7B product (qkv, o, gate_up, down, the LM
    head), and faster than cuBLAS on each (qkv 10.4 against 10.9 us, o 8.9 / 11.3, gate_up 63.6 / 69.1,
    down 34.6 / 38.6, the LM head 242.6 / 258.6). `n` is part of the key for a rule that would need it."""
    return GemvConfig(8, min(512, kernels.block(k)))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(X, W, B, Out, N, K, stride_x, stride_w, stride_o, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
        first = tl.program_id(0) * BLOCK_N
        n = tl.arange(0, BLOCK_N)
        mask_n = first + n < N
        W += first.to(tl.int64) * stride_w  # 64-bit once; offsets inside the tile stay 32-bit
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        # tl.range's num_stages, not the launch's: only it pipelines loads that feed no tl.dot
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            cols = k + tl.arange(0, BLOCK_K)
            mask_k = cols < K
            # each weight is read once per step: keep it from evicting x and the other layers' activations from L2
            w = tl.load(W + n[:, None] * stride_w + cols[None, :], mask=mask_n[:, None] & mask_k[None, :],
                        other=0.0, eviction_policy="evict_first").to(tl.float32)
            acc0 += tl.sum(w * tl.load(X + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :], axis=1)
            if ROWS > 1:
                acc1 += tl.sum(w * tl.load(X + stride_x + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :], axis=1)
            if ROWS > 2:
                acc2 += tl.sum(w * tl.load(X + 2 * stride_x + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :],
                               axis=1)
            if ROWS > 3:
                acc3 += tl.sum(w * tl.load(X + 3 * stride_x + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :],
                               axis=1)
        if HAS_BIAS:  # in float32, before the one rounding, as cuBLAS's epilogue adds it
            b = tl.load(B + first + n, mask=mask_n, other=0.0).to(tl.float32)
            acc0 += b
            acc1 += b
            acc2 += b
            acc3 += b
        out = Out + first + n
        tl.store(out, acc0.to(Out.dtype.element_ty), mask=mask_n)
        if ROWS > 1:
            tl.store(out + stride_o, acc1.to(Out.dtype.element_ty), mask=mask_n)
        if ROWS > 2:
            tl.store(out + 2 * stride_o, acc2.to(Out.dtype.element_ty), mask=mask_n)
        if ROWS > 3:
            tl.store(out + 3 * stride_o, acc3.to(Out.dtype.element_ty), mask=mask_n)

    return gemv


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv(x, weight)` can run: a few contiguous rows against a contiguous weight of the same dtype,
    on CUDA (or on the CPU under TRITON_INTERPRET=1)."""
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.dtype == weight.dtype and x.dtype in DTYPES and x.device == weight.device
            and x.is_contiguous() and weight.is_contiguous() and kernels.usable(x))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (M <= MAX_ROWS, K), weight (N, K), in one kernel; see `usable`."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or default_config(n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _kernel()[(-(-n // config.block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=m, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
