"""SiLU(gate) * up over a fused gate|up projection (T, 2I) -> (T, I), numerics of `GatedMLP`.

The PyTorch path rounds SiLU's result to the activation dtype before the
product, and the product again; so does this kernel.
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


def fusable(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens:
        _kernel()[(tokens, -(-n // BLOCK))](x, out, x.stride(0), out.stride(0), n, BLOCK=BLOCK, num_warps=4)
    return out
