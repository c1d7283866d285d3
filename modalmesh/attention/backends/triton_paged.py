"""`triton_paged`: our own paged-KV decode kernel (Triton), for the LLM.

Decode (one new token per sequence) runs one Triton program per (sequence, kv
head): it walks the sequence's pages through the block table, keeps an online
softmax for the whole GQA group of query heads, and never gathers pages into a
dense copy. It reads lengths and pages from device tensors only, so a decode
step can be captured in a CUDA graph. Prefill is delegated: new sequences (no
cached prefix) go to the fastest varlen kernel installed (FA3, torch varlen,
FA2) on the new tokens; a chunk continuing a cached prefix uses SDPA over the
gathered pages.
"""

from __future__ import annotations

import torch

from modalmesh.attention import registry
from modalmesh.attention.backends.base import AttentionBackend
from modalmesh.attention.metadata import VarlenMetadata

_VARLEN_DELEGATES = ("fa3", "torch_varlen", "fa2")
_BLOCK_N = 32


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        Q, K, V, Out, BlockTable, ContextLens, scale,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        DV: tl.constexpr, DV_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOW_LEFT: tl.constexpr, IEEE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(ContextLens + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        heads = kvh * GROUP + g
        q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=(g[:, None] < GROUP) & (d[None, :] < D), other=0.0)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DV_PAD), tl.float32)
        start = 0
        if WINDOW_LEFT >= 0:
            start = tl.maximum(ctx - 1 - WINDOW_LEFT, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, ctx, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < ctx
            if WINDOW_LEFT >= 0:
                valid = valid & (n >= ctx - 1 - WINDOW_LEFT)
            page = tl.load(BlockTable + seq * stride_bt + n // PAGE, mask=n < ctx, other=0)
            offset = n % PAGE
            k = tl.load(K + page[:, None] * stride_kp + offset[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=valid[:, None] & (d[None, :] < D), other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + page[:, None] * stride_vp + offset[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
                        mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + seq * stride_ot + heads[:, None] * stride_oh + dv[None, :], out.to(Out.dtype.element_ty),
                 mask=(g[:, None] < GROUP) & (dv[None, :] < DV))

    return paged_decode


def _pad(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, *, scale: float, window=None, kernel=None) -> torch.Tensor:
    """q (B, H, D) of one new token per sequence -> (B, H, Dv), attending over each sequence's pages."""
    kernel = kernel or _kernel()
    batch, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    group = heads // kv_heads
    out = q.new_empty((batch, heads, dim_v))
    if batch == 0:
        return out
    left = -1 if window is None or window[0] < 0 else int(window[0])
    kernel[(batch, kv_heads)](
        q, k_cache, v_cache, out, block_table, context_lens, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=group, GROUP_PAD=_pad(group), D=dim, D_PAD=_pad(dim), DV=dim_v, DV_PAD=_pad(dim_v), PAGE=page,
        BLOCK_N=_BLOCK_N, WINDOW_LEFT=left, IEEE=q.dtype == torch.float32,
    )
    return out


class TritonPaged(AttentionBackend):
    def probe(self) -> None:
        import triton  # noqa: F401 - an ImportError becomes the recorded reason

        self._decode = _kernel()

    def _sdpa(self, q: torch.Tensor):
        """SDPA for what the kernel does not do; the efficient kernel wants head dims in multiples of 8."""
        name = "sdpa_efficient" if q.device.type == "cuda" and q.shape[-1] % 8 == 0 else "sdpa_math"
        return registry.probe(name).backend

    def dense(self, q, k, v, *, causal, scale, window):
        return self._sdpa(q).dense(q, k, v, causal=causal, scale=scale, window=window)

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        if meta.is_decode:
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.context_lens, scale=scale,
                                window=window, kernel=self._decode)
        if meta.without_prefix and window is None:
            delegate = self._varlen_delegate(q)
            if delegate is not None:
                rows_k = k_cache.view(-1, *k_cache.shape[2:])
                rows_v = v_cache.view(-1, *v_cache.shape[2:])
                k, v = rows_k[meta.slot_mapping], rows_v[meta.slot_mapping]
                varlen = meta.cached("varlen_meta", lambda: VarlenMetadata(
                    meta.cu_seqlens_q, meta.max_seqlen_q, meta.query_lens))
                return delegate.varlen(q, k, v, varlen, causal=causal, scale=scale, window=None)
        return self._sdpa(q).paged(q, k_cache, v_cache, meta, causal=causal, scale=scale, window=window)

    def _varlen_delegate(self, q):
        for name in _VARLEN_DELEGATES:
            probe = registry.probe(name)
            target = probe.backend and next((t for t in probe.backend.spec.targets if t.kind == q.device.type), None)
            if target is not None and q.dtype in target.dtypes and _fits(target, q.shape[-1]):
                return probe.backend
        return None


def _fits(target, head_dim: int) -> bool:
    return (target.max_head_dim is None or head_dim <= target.max_head_dim) and head_dim % target.head_dim_multiple == 0


__all__ = ["TritonPaged", "paged_decode"]
