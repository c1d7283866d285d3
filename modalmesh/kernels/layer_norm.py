"""Residual add + LayerNorm in one kernel, numerics of `modalmesh.layers.norm.LayerNorm`.

The towers (SigLIP, Whisper, Qwen2-VL) are pre-LN: each sub-layer's output is
added to the residual stream and the next LayerNorm reads the sum. PyTorch runs
that as an add (read two rows, write one) and a LayerNorm (read it again, write
the normed row); here one program per row reads both, writes the new residual
and the normed row. Per row: s = x + residual rounded to the activation dtype
(the new residual), mean and biased variance of s in float32, then
(s - mean) * rstd * weight + bias in float32, rounded once: the roundings of
F.layer_norm, so only the order of the float32 sums differs.
"""

from __future__ import annotations

import functools

import torch

from modalmesh.kernels.norm import fusable as norm_fusable
from modalmesh.kernels.norm import launch_row_norm


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_layer_norm(X, R, W, B, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, n, eps,
                       HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 elements in a large batch
        eps = eps.to(tl.float32)  # float64 under torch.compile: the same float32 arithmetic as Triton's launch
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        mean = tl.sum(x32, axis=0) / n
        centred = tl.where(mask, x32 - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / n
        y = centred * (1.0 / tl.sqrt(var + eps)) * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)

    return add_layer_norm


def fusable(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            bias: torch.Tensor | None) -> bool:
    """RMSNorm's conditions (`norm.fusable`), a row that fits one program's registers, and parameters in
    `x`'s dtype: F.layer_norm returns `x`'s dtype whatever its parameters', the kernel their promotion."""
    return (norm_fusable(x, residual) and x.shape[-1] <= 8192
            and all(p is None or p.dtype == x.dtype for p in (weight, bias)))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of `x` (..., H); with `residual`, of x + residual, returning (normed, x + residual)."""
    return launch_row_norm(_kernel(), x, (weight, bias if bias is not None else weight), eps, residual,
                           HAS_BIAS=bias is not None)
