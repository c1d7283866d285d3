"""Activations of the MLPs in one pass, numerics of `modalmesh.layers.mlp`.

* `silu_and_mul`: SiLU(gate) * up over a fused gate|up projection (T, 2I) -> (T, I)
  (`GatedMLP`). The PyTorch path rounds SiLU's result to the activation dtype
  before the product, and the product again; so does this kernel.
* `quick_gelu`: x * sigmoid(1.702 x) (Qwen2-VL's vision MLP), which PyTorch runs as
  three kernels (a scale, a sigmoid, a product), each reading and writing the
  whole (tokens, 5120) activation; here one, with the same three roundings.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 1024


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_and_mul(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(Out + row * stride_o + cols, out, mask=mask)

    return silu_and_mul


@functools.cache
def _quick_gelu_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quick_gelu(X, Out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        scaled = (x32 * 1.702).to(x.dtype).to(tl.float32)
        gate = tl.sigmoid(scaled).to(x.dtype).to(tl.float32)
        tl.store(Out + offs, (x32 * gate).to(x.dtype), mask=mask)

    return quick_gelu


def fusable(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens:
        _kernel()[(tokens, -(-n // BLOCK))](x, out, x.stride(0), out.stride(0), n, BLOCK=BLOCK, num_warps=4)
    return out


def quick_gelu_fusable(x: torch.Tensor) -> bool:
    return x.is_contiguous()


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.numel():
        _quick_gelu_kernel()[(-(-x.numel() // BLOCK),)](x, out, x.numel(), BLOCK=BLOCK, num_warps=4)
    return out
