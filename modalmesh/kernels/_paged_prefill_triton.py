"""The Triton source of `modalmesh.kernels.paged_prefill` (imported only when the kernel first runs: Triton
resolves a kernel's helpers among its module's globals, and the package stays importable without Triton)."""

import triton
import triton.language as tl


@triton.jit
def _keys(acc, m_i, l_i, q, K, V, BlockTable, seq, n0, end, ctx, kvh, qk_scale,
          stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
          D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, PAGE: tl.constexpr,
          BLOCK_N: tl.constexpr, WINDOW_LEFT: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One block of keys [n0, n0 + BLOCK_N) into every row's running softmax."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    if MASKED:
        present = n < end
        page = tl.load(BlockTable + seq * stride_bt + n // PAGE, mask=present, other=0)
    else:  # below every row's causal length: all present
        present = n >= 0
        page = tl.load(BlockTable + seq * stride_bt + n // PAGE)
    offset = n % PAGE
    k = tl.load(K + page[:, None] * stride_kp + offset[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=present[:, None] & (d[None, :] < D), other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASKED:
        visible = n[None, :] < ctx[:, None]
        if WINDOW_LEFT >= 0:
            visible = visible & (n[None, :] >= ctx[:, None] - 1 - WINDOW_LEFT)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet (a window starting past this block) keeps max -inf: shift
    # by 0 instead, so its terms are exp2(-inf) = 0 and never NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + page[:, None] * stride_vp + offset[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
                mask=present[:, None] & (dv[None, :] < DV), other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i

@triton.jit(do_not_specialize=["stride_bt"])
def paged_prefill(
    Q, K, V, Out, BlockTable, Blocks, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    IEEE: tl.constexpr,
):
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    qk_scale = qk_scale.to(tl.float32)  # float64 under torch.compile: the softmax's loop-carried state stays float32
    seq = tl.load(Blocks + blk * 4)  # block-table row
    first = tl.load(Blocks + blk * 4 + 1).to(tl.int64)  # the block's first token's row in q and out
    tokens = tl.load(Blocks + blk * 4 + 2)
    c0 = tl.load(Blocks + blk * 4 + 3)  # the first token's causal length; token i's is c0 + i
    r = tl.arange(0, BLOCK_M)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    live = tok < tokens
    ctx = c0 + tok  # rows past the block's tokens see more keys, never fewer: finite, and not stored
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + (first + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=live[:, None] & (d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    end = c0 + tokens - 1  # the last token's causal length: no row needs a key at or past it
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(c0 - 1 - WINDOW_LEFT, 0) // BLOCK_N * BLOCK_N
        split = lo  # every block masked: each row's window starts elsewhere
    else:
        lo = 0
        split = c0 // BLOCK_N * BLOCK_N  # keys below c0 are visible to every row
    for n0 in range(lo, split, BLOCK_N):
        acc, m_i, l_i = _keys(acc, m_i, l_i, q, K, V, BlockTable, seq, n0, end, ctx, kvh, qk_scale,
                              stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                              D, D_PAD, DV, DV_PAD, PAGE, BLOCK_N, WINDOW_LEFT, False, IEEE)
    for n0 in range(split, end, BLOCK_N):
        acc, m_i, l_i = _keys(acc, m_i, l_i, q, K, V, BlockTable, seq, n0, end, ctx, kvh, qk_scale,
                              stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                              D, D_PAD, DV, DV_PAD, PAGE, BLOCK_N, WINDOW_LEFT, True, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (first + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=live[:, None] & (dv[None, :] < DV))
