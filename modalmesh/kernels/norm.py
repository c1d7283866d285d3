"""Residual add + RMSNorm in one kernel, numerics of `modalmesh.layers.norm.RMSNorm`.

Per row: s = x + residual rounded to the activation dtype (the new residual),
then s * rsqrt(mean(s^2) + eps) in float32, rounded, times the weight, rounded:
the same roundings as the PyTorch path, so only the order of the float32 sum
differs.
"""

from __future__ import annotations

import functools

import torch

from modalmesh.kernels import block


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
        var = tl.sum(x32 * x32, axis=0) / n
        normed = (x32 * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(W + cols, mask=mask, other=0.0)
        out = (normed.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + row * stride_o + cols, out, mask=mask)

    return add_rms_norm


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x` as (rows, hidden) without a copy, or None when its rows are not evenly strided."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def fusable(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """`x`'s rows evenly strided, and a residual (if any) of `x`'s shape and dtype: the kernel reads the
    residual row by row (a broadcast one would be read past its end) and rounds the sum to `x`'s dtype,
    where PyTorch's add would promote."""
    return _rows(x) is not None and (residual is None or (
        residual.shape == x.shape and residual.dtype == x.dtype and _rows(residual) is not None))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` (..., H); with `residual`, of x + residual, returning (normed, x + residual)."""
    return launch_row_norm(_kernel(), x, (weight,), eps, residual)


def launch_row_norm(kernel, x: torch.Tensor, params: tuple[torch.Tensor, ...], eps: float,
                    residual: torch.Tensor | None, **constexprs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One program per row of `x` for an add+norm kernel whose arguments are (X, R, *params, Out, ResOut,
    the four row strides, n, eps, HAS_RESIDUAL, *constexprs, BLOCK): this module's and layer_norm's."""
    shape = x.shape
    rows = _rows(x)
    hidden = shape[-1]
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, params[0].dtype), device=x.device)
    res_rows = _rows(residual) if residual is not None else rows
    res_out = torch.empty_like(rows) if residual is not None else out
    if rows.shape[0]:
        kernel[(rows.shape[0],)](
            rows, res_rows, *params, out, res_out, rows.stride(0), res_rows.stride(0), out.stride(0),
            res_out.stride(0), hidden, float(eps), HAS_RESIDUAL=residual is not None, **constexprs,
            BLOCK=block(hidden), num_warps=8 if hidden >= 2048 else 4)
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)
