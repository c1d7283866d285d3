"""torch_naive: attention as plain matmul + softmax with FP32 accumulation. The test oracle.

Deliberately simple and independent of the rest of the package (its own masking,
Python loops over sequences and pages), so agreement with it means something.
Runs everywhere, serves every layout; slow and memory-hungry (S_q x S_k scores).
"""

from __future__ import annotations

import torch

from modalmesh.attention.backends.base import AttentionBackend


def reference_attention(q, k, v, *, causal: bool, scale: float, window) -> torch.Tensor:
    """q (..., S_q, H, D), k (..., S_k, H_kv, D), v (..., S_k, H_kv, Dv) -> (..., S_q, H, Dv).

    Queries are the last S_q of the S_k positions (bottom-right alignment). A query
    row with no visible key yields zeros (flash-attention's convention).
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s_q, heads = q.shape[-3], q.shape[-2]
    s_k, kv_heads = k.shape[-3], k.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    kf = k.to(acc).repeat_interleave(heads // kv_heads, dim=-2)
    vf = v.to(acc).repeat_interleave(heads // kv_heads, dim=-2)
    scores = torch.einsum("...qhd,...khd->...hqk", q.to(acc), kf) * scale
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    q_pos = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
    k_pos = torch.arange(s_k, device=q.device)[None, :]
    if causal:
        visible = visible & (k_pos <= q_pos)
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (k_pos >= q_pos - left)
        if right >= 0:
            visible = visible & (k_pos <= q_pos + right)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: 0/0 -> 0
    out = torch.einsum("...hqk,...khd->...qhd", probs, vf)
    return out.to(q.dtype)


class NaiveBackend(AttentionBackend):
    def dense(self, q, k, v, *, causal, scale, window):
        return reference_attention(q, k, v, causal=causal, scale=scale, window=window)

    def varlen(self, q, k, v, meta, *, causal, scale, window):
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
        start = 0
        for n in meta.seqlens:
            part = slice(start, start + n)
            out[part] = reference_attention(q[part], k[part], v[part], causal=causal, scale=scale, window=window)
            start += n
        return out

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
        page_size = k_cache.shape[1]
        table = meta.block_table.cpu()
        start = 0
        for b, (n_new, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            pages = table[b, : -(-n_ctx // page_size)].long().to(k_cache.device)
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n_ctx]
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n_ctx]
            part = slice(start, start + n_new)
            out[part] = reference_attention(q[part], k, v, causal=causal, scale=scale, window=window)
            start += n_new
        return out
