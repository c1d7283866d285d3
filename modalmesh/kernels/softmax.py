"""softmax(scale * x) along the last dim of float32 scores, written in a half-precision dtype, in one kernel.

Attention as two GEMMs (`modalmesh.attention.backends.chunked_matmul`) gets float32 scores from the first
and feeds the second half-precision probabilities. PyTorch takes three passes for that (scale, softmax, cast:
20 bytes per score moved); this one reads each row twice, the second time mostly from L2 (a row of 16,384
scores is 64 KiB), and writes it once in the output dtype. Max and sum run online over the row's blocks in
float32, per lane; the probabilities are rounded once, to the output dtype.
"""

from __future__ import annotations

import functools

import torch

from modalmesh.kernels import block

BLOCK = 4096  # scores per step along a row


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_softmax(X, Out, n, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        # float64 under torch.compile (float32 from Triton's launch): a float64 `x` changed the loop's carried types
        scale = scale.to(tl.float32)
        x_row, out_row = X + row * n, Out + row * n
        cols = tl.arange(0, BLOCK)
        # online max and sum per lane, merged at the end; a lane that has seen only padding (-inf) adds nothing
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < n, other=-float("inf")) * scale
            m_new = tl.maximum(m, x)
            seen = m_new > -float("inf")
            total = tl.where(seen, total * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        row_max = tl.max(m, axis=0)
        inv = 1.0 / tl.sum(tl.where(m > -float("inf"), total * tl.exp(m - row_max), 0.0), axis=0)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")) * scale
            tl.store(out_row + start + cols, (tl.exp(x - row_max) * inv).to(Out.dtype.element_ty), mask=mask)

    return scaled_softmax


def fusable(scores: torch.Tensor) -> bool:
    """Dense float32 scores with a non-empty last dim."""
    return scores.dtype == torch.float32 and scores.is_contiguous() and scores.numel() > 0


def scaled_softmax(scores: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scale * scores, dim=-1) in `dtype`; `scores` dense float32."""
    n = scores.shape[-1]
    out = torch.empty(scores.shape, dtype=dtype, device=scores.device)
    block_n = min(block(n), BLOCK)
    _kernel()[(scores.numel() // n,)](scores, out, n, float(scale), BLOCK=block_n,
                                      num_warps=8 if block_n >= 2048 else 4)
    return out


def reference(scores: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's path: softmax in float32, then one rounding to `dtype`."""
    return torch.softmax(scores * scale, dim=-1).to(dtype)
