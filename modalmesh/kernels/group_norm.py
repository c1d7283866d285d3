"""GroupNorm (+ SiLU) over (N, C, H, W) in NCHW or channels-last, numerics of `F.group_norm` (+ `F.silu`).

Why not PyTorch's: its CUDA GroupNorm reduces each (sample, group) in one thread block. A VAE decoding
1024² has 32 groups of 16 channels × 1M pixels per sample, so 32 blocks do all the work on a GPU of
132 SMs: on an H100 that reduction was 46 of the decoder's 89 ms at bf16 (2026-12-05, `bench/vae.py
--profile`). In channels-last it also copies its input to NCHW and back.

Here a group's statistics are split over many programs:
  1. `partial_moments`: each program takes a block of channels over one chunk of the pixels and keeps,
     per channel, the chunk's mean and sum of squared deviations (Welford per lane of the tile, the lanes
     merged once with Chan's formula: stable where E[x²] - E[x]² is not);
  2. `group_moments`: one program per (sample, group) merges its channels' chunks into the group's mean
     and rstd = 1 / sqrt(var + eps) (biased variance, as GroupNorm), and keeps each of its channels'
     a = rstd * weight and b' = bias - a * mean (PyTorch's own order);
  3. `apply`: y = x * a + b' per channel, rounded to the activation dtype; with SiLU, y * sigmoid(y) of
     that rounded y, rounded again (what `F.silu(F.group_norm(x))` rounds).
A residual add whose sum a GroupNorm reads next (each VAE resnet block's output) can run as `partial_moments`
itself (`add_with_moments`): it stores the sum and keeps its moments, and `group_norm(..., moments=)` starts at
step 2, one read of the tensor fewer. So can a nearest-2x upsample + 3x3 convolution (`upsampled_conv_with_moments`),
run as four 2x2 convolutions whose outputs the statistics pass interleaves.
Pixels are addressed through the tensor's strides, so NCHW and channels-last take the same kernels and the
output keeps the input's memory format.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from modalmesh.kernels import block


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, tiles per program and warps of the two pixel passes, and the stats pass's parallelism
    (`bench/group_norm.py` sweeps them)."""

    stats_tile: int = 2048  # elements per tile of partial_moments (BLOCK_S x BLOCK_C)
    apply_tile: int = 2048  # elements per tile of apply
    programs: int = 1024  # stats programs per call: several per SM on any current GPU
    stats_block_c: int = 256  # at most this many channels per tile in channels-last (NCHW tiles take 4)
    apply_block_c: int = 256
    apply_tiles: int = 1  # apply tiles per program, walked in turn: its per-channel parameters computed once
    apply_warps: int = 0  # warps per apply program; 0: 8 for tiles of 2,048 elements or more, else 4
    # warps per stats program (0: as apply's rule). 4, where the rule gave 8 to the decoder's 2,048-element tiles:
    # the 1024² bf16 SDXL decode 0.3-0.5 ms faster, alternated twice on an H100 (2026-12-07, `bench/vae.py`); each
    # stats pass alone over the decoder's shapes 2.62 against 2.91 ms (`bench/group_norm.py --passes`)
    stats_warps: int = 4


DEFAULT = LaunchConfig()
MOMENTS_TILE = 2048  # (chunk, channel) partials group_moments merges per step


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_moments(X, PreBias, R, Out, Mean, M2, S, C, stride_n, stride_c, stride_s, o_n, o_c, o_s, out_w,
                        src_w, chunk_s, iters, HAS_PRE_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                        PHASES: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        # RESIDUAL: x + pre_bias + R is rounded to the activation dtype and stored to Out (R of Out's strides), and
        # the moments are those of what was stored: the pass a residual add makes anyway.
        # PHASES: X is (N, 4C, h + 1, w + 1), the four phases of a nearest-2x-upsample + 3x3 convolution computed
        # as 2x2 convolutions (`phase_weights`); output pixel (y, x) of the (2h, 2w) image (rows of `out_w`) is
        # phase 2 * (y % 2) + x % 2 at pixel ((y + 1) // 2, (x + 1) // 2) of X (rows of `src_w`). x + pre_bias is
        # rounded and stored to Out, and the moments are those of what was stored.
        chunk, n, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        chans = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = chans < C
        if HAS_PRE_BIAS:
            pre_bias = tl.load(PreBias + chans, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # Welford per lane (a row of the tile and a channel) over the chunk's tiles, merged across the rows once
        # at the end: a reduction across rows per tile (a barrier each) made channels-last, whose tiles are
        # short in rows, 17x slower than NCHW (25 of 57 ms of the decoder at 1024² on an H100)
        count = tl.zeros([BLOCK_S, 1], dtype=tl.float32)
        mean = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        chans64 = chans.to(tl.int64)[None, :]
        for i in range(iters):
            rows = chunk * chunk_s + i * BLOCK_S + tl.arange(0, BLOCK_S)
            valid = (rows < S)[:, None]
            rows64 = rows.to(tl.int64)
            if PHASES:  # per pixel, in int32 (rows < S < 2^31); only the offsets need 64 bits
                yy = rows // out_w
                xx = rows - yy * out_w
                src = (((yy + 1) // 2) * src_w + (xx + 1) // 2).to(tl.int64)
                phase = ((yy % 2) * 2 + xx % 2).to(tl.int64)
                offs = n.to(tl.int64) * stride_n + src[:, None] * stride_s + (phase[:, None] * C + chans64) * stride_c
            else:
                offs = n.to(tl.int64) * stride_n + rows64[:, None] * stride_s + chans64 * stride_c
            x = tl.load(X + offs, mask=valid & cmask[None, :], other=0.0).to(tl.float32)
            if HAS_PRE_BIAS:
                x += pre_bias
            if RESIDUAL or PHASES:
                out_offs = n.to(tl.int64) * o_n + rows64[:, None] * o_s + chans64 * o_c
                if RESIDUAL:  # (x + b) + r in float32, one rounding: what the residual kernel computes
                    x += tl.load(R + out_offs, mask=valid & cmask[None, :], other=0.0).to(tl.float32)
                y = x.to(Out.dtype.element_ty)
                tl.store(Out + out_offs, y, mask=valid & cmask[None, :])
                x = y.to(tl.float32)
            count += valid.to(tl.float32)
            delta = tl.where(valid, x - mean, 0.0)  # a lane past the end of the pixels adds nothing
            # one reciprocal per row of the tile, not a division per element (a row's lanes share their count)
            mean += delta * (1.0 / tl.maximum(count, 1.0))
            m2 += delta * (x - mean)
        # Chan's merge of the lanes (every lane of a chunk's first tile holds a pixel, so `total` > 0)
        total = tl.sum(count, axis=0)
        chunk_mean = tl.sum(count * mean, axis=0) / total
        d = mean - chunk_mean[None, :]
        chunk_m2 = tl.sum(m2 + count * d * d, axis=0)
        out = (n * tl.num_programs(0) + chunk) * C + chans
        tl.store(Mean + out, chunk_mean, mask=cmask)
        tl.store(M2 + out, chunk_m2, mask=cmask)

    @triton.jit
    def group_moments(Mean, M2, W, B, PreBias, Scale, Shift, S, C, G, cpg, chunk_s, chunks, total, eps,
                      HAS_PRE_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CG: tl.constexpr):
        # `total` (S * cpg, a float) comes from the host: Triton compiles an int argument equal to 1 as a
        # constant, which has no `.to`, so a 1x1 latent (S == 1) failed to compile when it was cast here.
        # torch.compile launches a Triton kernel with its float arguments as float64 (Triton's own launcher as
        # float32): cast, or a float64 mean changes the type of the second loop's accumulator, which does not compile
        total, eps = total.to(tl.float32), eps.to(tl.float32)
        ng = tl.program_id(0)
        n, g = ng // G, ng % G
        chans = g * cpg + tl.arange(0, BLOCK_CG)
        cmask = tl.arange(0, BLOCK_CG) < cpg
        acc = tl.zeros([BLOCK_K, BLOCK_CG], dtype=tl.float32)
        for k0 in range(0, chunks, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = (ks < chunks)[:, None] & cmask[None, :]
            cnt = tl.minimum(S - ks * chunk_s, chunk_s).to(tl.float32)
            m = tl.load(Mean + (n * chunks + ks)[:, None] * C + chans[None, :], mask=mask, other=0.0)
            acc += tl.where(mask, m * cnt[:, None], 0.0)
        mean = tl.sum(tl.sum(acc, axis=1), axis=0) / total
        acc = tl.zeros([BLOCK_K, BLOCK_CG], dtype=tl.float32)
        for k0 in range(0, chunks, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = (ks < chunks)[:, None] & cmask[None, :]
            cnt = tl.minimum(S - ks * chunk_s, chunk_s).to(tl.float32)
            offs = (n * chunks + ks)[:, None] * C + chans[None, :]
            m = tl.load(Mean + offs, mask=mask, other=0.0)
            q = tl.load(M2 + offs, mask=mask, other=0.0)
            d = m - mean
            acc += tl.where(mask, q + d * d * cnt[:, None], 0.0)
        var = tl.sum(tl.sum(acc, axis=1), axis=0) / total
        rstd = 1.0 / tl.sqrt(var + eps)
        # the group's channels' y = x * a + b': a = rstd * weight, b' = bias - a * mean (PyTorch's own order), kept
        # per (sample, channel) so that `apply` reads two float32 vectors rather than gathering its groups' moments
        a = rstd * tl.load(W + chans, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(B + chans, mask=cmask, other=0.0).to(tl.float32) - a * mean
        if HAS_PRE_BIAS:  # (x + p) * a + b' = x * a + (b' + p * a)
            b += tl.load(PreBias + chans, mask=cmask, other=0.0).to(tl.float32) * a
        tl.store(Scale + n * C + chans, a, mask=cmask)
        tl.store(Shift + n * C + chans, b, mask=cmask)

    @triton.jit
    def apply(X, Out, Scale, Shift, S, C, stride_n, stride_c, stride_s, o_n, o_c, o_s, SILU: tl.constexpr,
              BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, TILES: tl.constexpr):
        # pixel tiles on grid axis 0: axes 1 and 2 stop at 65,535 (a 1024² channels-last tensor has 65,536 tiles)
        sb, n, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        chans = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = chans < C
        a = tl.load(Scale + n * C + chans, mask=cmask, other=0.0)
        b = tl.load(Shift + n * C + chans, mask=cmask, other=0.0)
        chans64 = chans.to(tl.int64)[None, :]
        for t in tl.static_range(TILES):
            rows = (sb * TILES + t) * BLOCK_S + tl.arange(0, BLOCK_S)
            mask = (rows < S)[:, None] & cmask[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x = tl.load(X + n.to(tl.int64) * stride_n + rows64 * stride_s + chans64 * stride_c, mask=mask, other=0.0)
            y = (x.to(tl.float32) * a[None, :] + b[None, :]).to(Out.dtype.element_ty)
            if SILU:
                y32 = y.to(tl.float32)
                y = (y32 / (1.0 + tl.exp(-y32))).to(Out.dtype.element_ty)
            tl.store(Out + n.to(tl.int64) * o_n + rows64 * o_s + chans64 * o_c, y, mask=mask)

    return partial_moments, group_moments, apply


def _pixel_strides(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(stride_n, stride_c, stride_s) when the spatial dims of `x` flatten to one stride, else None."""
    if x.dim() < 3:
        return None
    dims = [d for d in range(2, x.dim()) if x.shape[d] > 1]  # a dim of size 1 may carry any stride
    for outer, inner in zip(dims, dims[1:]):
        if x.stride(outer) != x.stride(inner) * x.shape[inner]:
            return None
    return x.stride(0), x.stride(1), x.stride(dims[-1]) if dims else 1


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fusable(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
            pre_bias: torch.Tensor | None = None) -> bool:
    """A float (N, C, *spatial) in NCHW or channels-last (any layout whose pixels flatten to one stride), C
    split evenly into `groups`, with a per-channel affine of C (and a per-channel `pre_bias` of C). Anything
    else takes PyTorch's path, which also raises its errors."""
    return (weight is not None and bias is not None and x.dtype in FLOAT_DTYPES and x.dim() >= 3
            and x.numel() > 0 and groups > 0 and x.shape[1] % groups == 0
            and weight.numel() == bias.numel() == x.shape[1] and _pixel_strides(x) is not None
            and (pre_bias is None or pre_bias.numel() == x.shape[1]))


def _tile(stride_c: int, channels: int, tile: int, max_block_c: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_C) of `tile` elements: long along whichever axis is contiguous, so loads coalesce."""
    if stride_c == 1:  # channels-last: a pixel's channels are adjacent
        block_c = min(block(channels), max_block_c)
        return max(tile // block_c, 1), block_c
    block_c = min(block(channels), 4)
    return tile // block_c, block_c


def _warps(setting: int, tile_elements: int) -> int:
    """A pass's warps per program: `setting`, or where it is 0, 8 for tiles of 2,048 elements or more, else 4."""
    return setting or (8 if tile_elements >= 2048 else 4)


def plan(n: int, c: int, s: int, stride_c: int, config: LaunchConfig = DEFAULT) -> tuple[int, int, int, int]:
    """(BLOCK_S, BLOCK_C, chunks, iters): the stats kernel's tiles, and its pixel chunks of `iters` tiles each,
    about `config.programs` programs in all. The last chunk may hold tiles past the end of the pixels."""
    block_s, block_c = _tile(stride_c, c, config.stats_tile, config.stats_block_c)
    c_blocks = -(-c // block_c)
    s_tiles = -(-s // block_s)
    chunks = min(max(-(-config.programs // (n * c_blocks)), 1), s_tiles)
    iters = -(-s_tiles // chunks)
    return block_s, block_c, -(-s // (iters * block_s)), iters


@dataclasses.dataclass(frozen=True)
class Moments:
    """One tensor's per-channel partial statistics: its pixels cut into chunks of `chunk_s`, each chunk's mean and
    sum of squared deviations per channel, (N, chunks, C) float32 each. Any grouping of the channels merges them.
    `of` names the tensor they were taken of (its storage, shape and strides)."""

    mean: torch.Tensor
    m2: torch.Tensor
    chunk_s: int
    of: tuple

    @staticmethod
    def identity(x: torch.Tensor) -> tuple:
        return x.data_ptr(), tuple(x.shape), x.stride(), x.dtype

    def covers(self, x: torch.Tensor) -> bool:
        """Whether these are x's own moments (the tensor they were taken of, not one merely of its shape)."""
        return self.of == Moments.identity(x)


def _partial_moments(x: torch.Tensor, pre_bias: torch.Tensor | None, config: LaunchConfig,
                     residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     phases: bool = False) -> Moments:
    """The moments of x (+ pre_bias), or, where `out` is given, of what is stored there: x + pre_bias + `residual`
    (of out's strides) or, with `phases`, x's four phases interleaved (+ pre_bias); see `partial_moments`."""
    partial_moments = _kernels()[0]
    target = x if out is None else out  # the tensor whose moments these are: its pixels are the ones walked
    n, c = target.shape[0], target.shape[1]
    s = target[0, 0].numel()
    o_n, o_c, o_s = _pixel_strides(target)
    stride_n, stride_c, stride_s = _pixel_strides(x)
    block_s, block_c, chunks, iters = plan(n, c, s, o_c, config)
    f32 = dict(dtype=torch.float32, device=x.device)
    moments = Moments(torch.empty((n, chunks, c), **f32), torch.empty((n, chunks, c), **f32), iters * block_s,
                      Moments.identity(target))
    has_pre_bias, has_residual = pre_bias is not None, residual is not None
    partial_moments[(chunks, n, -(-c // block_c))](
        x, pre_bias if has_pre_bias else x, residual if has_residual else x, target,
        moments.mean, moments.m2, s, c, stride_n, stride_c, stride_s, o_n, o_c, o_s, target.shape[-1],
        x.shape[-1], moments.chunk_s, iters, HAS_PRE_BIAS=has_pre_bias, RESIDUAL=has_residual, PHASES=phases,
        BLOCK_S=block_s, BLOCK_C=block_c, num_warps=_warps(config.stats_warps, block_s * block_c))
    return moments  # pointers a flag turns off are never read


def add_with_moments(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                     config: LaunchConfig | None = None) -> tuple[torch.Tensor, Moments]:
    """((h + bias per channel) + residual in float32, rounded once to h's dtype, in h's memory format; its
    moments): what `residual.add_bias_residual` computes, bit for bit.

    A VAE resnet block's residual add feeds the next GroupNorm: taking that norm's statistics in the add's own
    pass saves the norm a read of the tensor. h and residual must be of one shape, dtype and dense layout
    (`residual.fusable`): the kernel reads both, and writes the sum, through h's strides."""
    if (residual.shape != h.shape or residual.stride() != h.stride() or residual.dtype != h.dtype
            or _pixel_strides(h) is None or bias.numel() != h.shape[1]):
        raise ValueError("add_with_moments: h and residual of one shape, dtype and layout, a bias per channel")
    out = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=h.device)  # h's strides, as residual's
    return out, _partial_moments(h, bias, config or DEFAULT, residual, out)


# Nearest 2x upsampling then a 3x3 convolution (padding 1), per output phase: for output row 2i + a, the two rows
# of a 2x2 window over x (rows k - 1 and k of x, k = i + a) take these rows of the 3x3 kernel, summed (phase 0:
# x[i - 1] <- row 0, x[i] <- rows 1, 2; phase 1: x[i] <- rows 0, 1, x[i + 1] <- row 2). Columns likewise.
PHASE_TAPS = (((0,), (1, 2)), ((0, 1), (2,)))


def phase_weights(weight: torch.Tensor) -> torch.Tensor:
    """(Co, Ci, 3, 3) -> (4 Co, Ci, 2, 2): the four phases' 2x2 kernels, phase 2a + b in block 2a + b; the taps
    summed in float32 and rounded once to the weight's dtype."""
    w = weight.float()
    rows = [torch.stack([w[:, :, list(taps)].sum(2) for taps in PHASE_TAPS[a]], 2) for a in (0, 1)]
    return torch.cat([torch.stack([rows[a][..., list(taps)].sum(-1) for taps in PHASE_TAPS[b]], -1)
                      for a in (0, 1) for b in (0, 1)]).to(weight.dtype)


def upsampled_conv_with_moments(x: torch.Tensor, phase_weight: torch.Tensor, bias: torch.Tensor,
                                config: LaunchConfig | None = None) -> tuple[torch.Tensor, Moments]:
    """(conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), weight, bias, padding=1) in x's memory format;
    its moments), with `phase_weight` = phase_weights(weight).

    The convolution runs as four 2x2 ones on x itself, as one of 4 Co output channels over (h + 1, w + 1): 16 of
    the 36 multiply-adds per output of the 3x3 on the upsampled input, which is never made. The phases are
    interleaved into the output, with the bias added, by the statistics pass of the GroupNorm that reads it next."""
    if phase_weight.shape != (4 * bias.numel(), x.shape[1], 2, 2):
        raise ValueError(f"upsampled_conv_with_moments: phase weights of {tuple(phase_weight.shape)}; "
                         f"phase_weights() of a ({bias.numel()}, {x.shape[1]}, 3, 3) kernel is wanted")
    phases = torch.nn.functional.conv2d(x, phase_weight, None, padding=1)
    n, c4, hp, wp = phases.shape
    fmt = torch.contiguous_format if x.is_contiguous() else torch.channels_last
    out = torch.empty((n, c4 // 4, 2 * (hp - 1), 2 * (wp - 1)), dtype=phases.dtype, device=phases.device,
                      memory_format=fmt)
    return out, _partial_moments(phases, bias, config or DEFAULT, out=out, phases=True)


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float, *,
               silu: bool = False, pre_bias: torch.Tensor | None = None, moments: Moments | None = None,
               config: LaunchConfig | None = None) -> torch.Tensor:
    """F.group_norm(x, groups, weight, bias, eps), followed by F.silu with `silu`; `x` is (N, C, *spatial).

    `pre_bias` (C,) is added to x per channel first, in float32 (a convolution's bias, left out of it: the
    add costs a pass over x of its own). `moments` are x's own, taken by the pass that wrote it
    (`add_with_moments`), so the statistics pass is skipped."""
    if moments is not None and (pre_bias is not None or not moments.covers(x)):
        raise ValueError("moments are of x itself (the tensor they were taken of), with no pre_bias beside them")
    _, group_moments, apply = _kernels()
    config = config or DEFAULT
    n, c = x.shape[0], x.shape[1]
    s = x[0, 0].numel()
    cpg = c // groups
    stride_n, stride_c, stride_s = _pixel_strides(x)
    if moments is None:
        moments = _partial_moments(x, pre_bias, config)
    scale, shift = (torch.empty((n, c), dtype=torch.float32, device=x.device) for _ in range(2))
    block_cg = block(cpg)
    chunks = moments.mean.shape[1]
    has_pre_bias = pre_bias is not None
    group_moments[(n * groups,)](moments.mean, moments.m2, weight, bias, pre_bias if has_pre_bias else bias, scale,
                                 shift, s, c, groups, cpg, moments.chunk_s, chunks, float(s * cpg), float(eps),
                                 HAS_PRE_BIAS=has_pre_bias, BLOCK_K=max(MOMENTS_TILE // block_cg, 1),
                                 BLOCK_CG=block_cg, num_warps=4)
    out = torch.empty_like(x)  # the input's memory format (a dense one where `x` is a view)
    block_s, block_c = _tile(stride_c, c, config.apply_tile, config.apply_block_c)
    c_blocks = -(-c // block_c)
    tiles = max(1, min(config.apply_tiles, -(-s // block_s)))  # no program walks only tiles past the end
    apply[(-(-s // (block_s * tiles)), n, c_blocks)](
        x, out, scale, shift, s, c, stride_n, stride_c, stride_s, *_pixel_strides(out), SILU=silu, BLOCK_S=block_s,
        BLOCK_C=block_c, TILES=tiles, num_warps=_warps(config.apply_warps, block_s * block_c))
    return out
