"""RoPE of q and k, and the write of k and v into the paged KV pool, in one kernel.

Numerics of `modalmesh.layers.rotary.RotaryEmbedding` (neox layout, float32
rotation, rounded to the activation dtype) followed by
`modalmesh.attention.paged.store_kv` (k and v cast to the pool's dtype, written
at each token's slot). One program per token: it reads the token's position and
slot, rotates every q head into a fresh contiguous q and every k head straight
into the pool. The attention kernels then read k and v from the pool only.
Full-width rotary: 1-D positions (Llama, Qwen2, Qwen3), or M-RoPE's (3, T) ones
(Qwen2-VL, Qwen2.5-VL), where each frequency takes its cos / sin at the position
of its section (temporal, height, width), as `RotaryEmbedding._cos_sin` picks
them. Partial rotary keeps the PyTorch path.

`rotate_qk` is the vision towers' form (Qwen2-VL, Qwen2.5-VL): cos and sin given
per token (T, D) in float32 (their 2-D rotary), q and k rotated into fresh
contiguous tensors, no cache. The PyTorch path (`vision_encoder.models.common.
apply_rotary`) is seven kernels over a float32 copy per tensor; this is one for both.
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
    def rope_and_store(Q, K, V, Positions, Slots, CosSin, QOut, KCache, VCache,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_pos,
                       HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                       HALF: tl.constexpr, HALF_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                       MROPE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(Slots + t)
        d = tl.arange(0, HALF_PAD)
        dmask = d < HALF
        if MROPE:  # frequencies [0, S0) at the temporal position, [S0, S0 + S1) the height's, the rest the width's
            p0 = tl.load(Positions + t)
            p1 = tl.load(Positions + stride_pos + t)
            p2 = tl.load(Positions + 2 * stride_pos + t)
            pos = tl.where(d < S0, p0, tl.where(d < S0 + S1, p1, p2))
        else:
            pos = tl.load(Positions + t)
        cos = tl.load(CosSin + pos * stride_cs + d, mask=dmask, other=0.0)[None, :]
        sin = tl.load(CosSin + pos * stride_cs + HALF + d, mask=dmask, other=0.0)[None, :]

        hq = tl.arange(0, HQ_PAD)[:, None]
        qmask = (hq < HQ) & dmask[None, :]
        q1 = tl.load(Q + t * stride_qt + hq * stride_qh + d[None, :], mask=qmask, other=0.0)
        q2 = tl.load(Q + t * stride_qt + hq * stride_qh + HALF + d[None, :], mask=qmask, other=0.0)
        a, b = q1.to(tl.float32), q2.to(tl.float32)
        out = QOut + t * (HQ * 2 * HALF) + hq * (2 * HALF) + d[None, :]
        tl.store(out, (a * cos - b * sin).to(q1.dtype), mask=qmask)
        tl.store(out + HALF, (b * cos + a * sin).to(q1.dtype), mask=qmask)

        hk = tl.arange(0, HK_PAD)[:, None]
        kmask = (hk < HK) & dmask[None, :]
        k1 = tl.load(K + t * stride_kt + hk * stride_kh + d[None, :], mask=kmask, other=0.0)
        k2 = tl.load(K + t * stride_kt + hk * stride_kh + HALF + d[None, :], mask=kmask, other=0.0)
        a, b = k1.to(tl.float32), k2.to(tl.float32)
        row = KCache + slot * (HK * 2 * HALF) + hk * (2 * HALF) + d[None, :]
        dtype = KCache.dtype.element_ty
        tl.store(row, (a * cos - b * sin).to(k1.dtype).to(dtype), mask=kmask)
        tl.store(row + HALF, (b * cos + a * sin).to(k1.dtype).to(dtype), mask=kmask)

        dv = tl.arange(0, DV_PAD)[None, :]
        vmask = (hk < HK) & (dv < DV)
        v = tl.load(V + t * stride_vt + hk * stride_vh + dv, mask=vmask, other=0.0)
        tl.store(VCache + slot * (HK * DV) + hk * DV + dv, v.to(VCache.dtype.element_ty), mask=vmask)

    return rope_and_store


def fusable(positions: torch.Tensor, q: torch.Tensor, rotary_dim: int,
            mrope_section: tuple[int, ...] | None) -> bool:
    if mrope_section is None:
        shaped = positions.dim() == 1 and positions.stride(0) == 1
    else:  # three sections (temporal, height, width); (3, T) positions with unit stride along T
        shaped = (len(mrope_section) == 3 and positions.dim() == 2 and positions.shape[0] == 3
                  and positions.stride(1) == 1)
    return shaped and rotary_dim == q.shape[-1] and q.stride(-1) == 1


def rope_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, mrope_section: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rotated q (T, Hq, D), contiguous; rotated k and v written into their slots of the pool.

    `cos_sin` is the rotary table (L, D): cos | sin of each position, float32, covering every position.
    `mrope_section`: M-RoPE's three section sizes over D / 2 frequencies, with `positions` (3, T)."""
    tokens, hq, dim = q.shape
    hk, dv = k.shape[1], v.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_store wants unit-stride heads and contiguous caches")
    half = dim // 2
    if mrope_section is not None and (len(mrope_section) != 3 or sum(mrope_section) != half):
        raise ValueError(f"mrope_section {tuple(mrope_section)} must be 3 sizes summing to {half}")
    q_out = torch.empty((tokens, hq, dim), dtype=q.dtype, device=q.device)
    if tokens:
        s0, s1, _ = mrope_section if mrope_section is not None else (0, 0, 0)
        _kernel()[(tokens,)](
            q, k, v, positions, slot_mapping, cos_sin, q_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
            positions.stride(0) if mrope_section is not None else 0,
            HQ=hq, HK=hk, HQ_PAD=block(hq), HK_PAD=block(hk), HALF=half, HALF_PAD=block(half), DV=dv,
            DV_PAD=block(dv), MROPE=mrope_section is not None, S0=s0, S1=s1, num_warps=4)
    return q_out


@functools.cache
def _qk_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rotate_qk(Q, K, Cos, Sin, QOut, KOut, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                  H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # t * stride passes 2**31 elements in a long packed batch
        d = tl.arange(0, HALF_PAD)
        dmask = d < HALF
        cos1 = tl.load(Cos + t * stride_ct + d, mask=dmask, other=0.0)[None, :]
        cos2 = tl.load(Cos + t * stride_ct + HALF + d, mask=dmask, other=0.0)[None, :]
        sin1 = tl.load(Sin + t * stride_st + d, mask=dmask, other=0.0)[None, :]
        sin2 = tl.load(Sin + t * stride_st + HALF + d, mask=dmask, other=0.0)[None, :]
        h = tl.arange(0, H_PAD)[:, None]
        mask = (h < H) & dmask[None, :]
        for which in tl.static_range(2):
            X = Q if which == 0 else K
            Out = QOut if which == 0 else KOut
            stride_t = stride_qt if which == 0 else stride_kt
            stride_h = stride_qh if which == 0 else stride_kh
            x1 = tl.load(X + t * stride_t + h * stride_h + d[None, :], mask=mask, other=0.0)
            x2 = tl.load(X + t * stride_t + h * stride_h + HALF + d[None, :], mask=mask, other=0.0)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            out = Out + t * (H * 2 * HALF) + h * (2 * HALF) + d[None, :]
            # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], in float32. The compiler may fuse a
            # product into the sum (FMA), so this equals PyTorch's separate products within float32 rounding,
            # not bit for bit, before the one rounding to the activation dtype
            tl.store(out, (a * cos1 + (-b) * sin1).to(x1.dtype), mask=mask)
            tl.store(out + HALF, (b * cos2 + a * sin2).to(x1.dtype), mask=mask)

    return rotate_qk


def qk_fusable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (q.dim() == 3 and q.shape == k.shape and q.shape[-1] % 2 == 0 and q.stride(-1) == 1
            and k.stride(-1) == 1 and cos.shape == sin.shape == (q.shape[0], q.shape[-1])
            and cos.stride(-1) == 1 and sin.stride(-1) == 1)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (T, H, D) rotated by cos / sin (T, D), float32, rotate_half layout: contiguous, q's dtype."""
    tokens, heads, dim = q.shape
    q_out, k_out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device), torch.empty(
        (tokens, heads, dim), dtype=k.dtype, device=k.device)
    if tokens:
        half = dim // 2
        _qk_kernel()[(tokens,)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                cos.stride(0), sin.stride(0), H=heads, H_PAD=block(heads), HALF=half,
                                HALF_PAD=block(half), num_warps=4)
    return q_out, k_out
