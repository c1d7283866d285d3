"""out = residual + (h + bias per channel) over (N, C, H, W), in NCHW or channels-last, in one pass.

A VAE resnet block ends with `x + conv2(h)`. PyTorch's convolution adds its bias in a kernel of its own
(cuDNN's output, then `add_`), so the block's end was two passes over the largest tensors of the decoder:
the bias adds were 6.3 of its 42 ms at 1024² bf16 on an H100 (2026-12-05). Here the convolution runs
without its bias and this kernel adds both. It rounds once to the activation dtype, where PyTorch's path
rounds after the bias and again after the sum: within one rounding of it, and closer to float32.

The VAE's resnet blocks run this add as the next GroupNorm's statistics pass (`group_norm.add_with_moments`,
the same sum bit for bit): this kernel is the reference that is tested against, and `fusable` says which pairs
both take.

The bias may be float32 (biases folded in from earlier layers, summed without rounding).
"""

from __future__ import annotations

import functools

import torch

from modalmesh.kernels.group_norm import FLOAT_DTYPES

BLOCK = 2048


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_bias_residual(H, Bias, R, Out, numel, C, channel_stride, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        chans = (offs // channel_stride) % C  # channels-last: channel_stride 1; NCHW: H * W
        h = tl.load(H + offs, mask=mask, other=0.0)
        r = tl.load(R + offs, mask=mask, other=0.0)
        b = tl.load(Bias + chans, mask=mask, other=0.0)
        y = h.to(tl.float32) + b.to(tl.float32) + r.to(tl.float32)
        tl.store(Out + offs, y.to(h.dtype), mask=mask)

    return add_bias_residual


def _channel_stride(x: torch.Tensor) -> int | None:
    """Elements between neighbouring channels of a dense NCHW (H * W) or channels-last (1) 4-D tensor."""
    if x.dim() != 4:
        return None
    if x.is_contiguous():
        return x.shape[2] * x.shape[3]
    if x.is_contiguous(memory_format=torch.channels_last):
        return 1
    return None


def fusable(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> bool:
    """h and residual of one shape, dtype and dense layout (NCHW or channels-last), a bias of C."""
    return (h.shape == residual.shape and h.dtype == residual.dtype and h.dtype in FLOAT_DTYPES
            and h.stride() == residual.stride() and _channel_stride(h) is not None and h.numel() > 0
            and bias.numel() == h.shape[1])


def add_bias_residual(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + h + bias, in h's dtype and memory format."""
    out = torch.empty_like(h)
    numel = h.numel()
    _kernel()[(-(-numel // BLOCK),)](h, bias, residual, out, numel, h.shape[1], _channel_stride(h), BLOCK=BLOCK,
                                     num_warps=8)
    return out


def reference(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """PyTorch's path (what a convolution with its bias, then the residual add, computes)."""
    return residual + (h + bias.to(h.dtype).view(-1, *[1] * (h.dim() - 2)))
