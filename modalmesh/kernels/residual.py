"""out = residual + (h + bias per channel) over (N, C, H, W), in NCHW or channels-last, in one pass;
optionally written 2x nearest-upsampled, (N, C, 2H, 2W).

A VAE resnet block ends with `x + conv2(h)`. PyTorch's convolution adds its bias in a kernel of its own
(cuDNN's output, then `add_`), so the block's end was two passes over the largest tensors of the decoder:
the bias adds were 6.3 of its 42 ms at 1024² bf16 on an H100 (2026-12-05). Here the convolution runs
without its bias and this kernel adds both. It rounds once to the activation dtype, where PyTorch's path
rounds after the bias and again after the sum: within one rounding of it, and closer to float32.

A resnet block whose output a GroupNorm reads next runs this add as that norm's statistics pass instead
(`group_norm.add_with_moments`, the same sum bit for bit); this kernel's plain form is the reference for it.

A VAE up block's last resnet feeds its nearest 2x upsampler, and nothing else reads the block's output at its
own size. With ``upsample=True`` each sum goes straight to its 4 places in the upsampled output, so neither
the output at its own size nor a copy kernel's pass over it exists (the copies were 1.3 ms of the decoder at
1024² bf16 on an H100, 2026-12-05). The bias may be float32 (biases folded in from earlier layers, summed
without rounding).
"""

from __future__ import annotations

import functools

import torch

from modalmesh.kernels import block
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

    @triton.jit
    def add_bias_residual_upsampled(H, Bias, R, Out, C, rows_per_channel, row_len, pixel,
                                    CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
        # The input as rows of `row_len` elements, one program per block of a row: channels-last has N * H rows
        # of W pixels of C channels (pixel = C), NCHW N * C * H rows of W (pixel = 1). Element j of input row r
        # (column j // pixel) goes to output rows 2r and 2r + 1 (each 2 * row_len long), at 2j - j % pixel and
        # that + pixel: all from program ids, with no 64-bit division per element
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        j = blk * BLOCK + tl.arange(0, BLOCK)
        mask = j < row_len
        e = j % pixel
        if CHANNELS_LAST:
            chans = e
        else:
            chans = tl.zeros([BLOCK], dtype=tl.int32) + ((row // rows_per_channel) % C).to(tl.int32)
        src = row * row_len + j
        h = tl.load(H + src, mask=mask, other=0.0)
        r = tl.load(R + src, mask=mask, other=0.0)
        b = tl.load(Bias + chans, mask=mask, other=0.0)
        y = (h.to(tl.float32) + b.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        dst = Out + row * (4 * row_len) + (2 * j - e)
        tl.store(dst, y, mask=mask)
        tl.store(dst + pixel, y, mask=mask)
        tl.store(dst + 2 * row_len, y, mask=mask)
        tl.store(dst + 2 * row_len + pixel, y, mask=mask)

    return add_bias_residual, add_bias_residual_upsampled


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


def add_bias_residual(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, *,
                      upsample: bool = False) -> torch.Tensor:
    """residual + h + bias, in h's dtype and memory format; with `upsample`, nearest 2x upsampled."""
    plain, upsampled = _kernel()
    if not upsample:
        out = torch.empty_like(h)
        numel = h.numel()
        plain[(-(-numel // BLOCK),)](h, bias, residual, out, numel, h.shape[1], _channel_stride(h), BLOCK=BLOCK,
                                     num_warps=8)
        return out
    n, c, height, width = h.shape
    channels_last = not h.is_contiguous()  # fusable: then it is channels-last
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, c, 2 * height, 2 * width), dtype=h.dtype, device=h.device, memory_format=fmt)
    pixel = c if channels_last else 1
    rows, row_len = h.numel() // (width * pixel), width * pixel
    block_len = min(block(row_len), BLOCK)
    upsampled[(rows, -(-row_len // block_len))](h, bias, residual, out, c, height, row_len, pixel,
                                                CHANNELS_LAST=channels_last, BLOCK=block_len,
                                                num_warps=8 if block_len >= 1024 else 4)
    return out


def reference(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """PyTorch's path (what a convolution with its bias, then the residual add, computes)."""
    return residual + (h + bias.to(h.dtype).view(-1, *[1] * (h.dim() - 2)))
