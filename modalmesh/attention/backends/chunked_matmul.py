"""matmul_chunked: dense attention as two GEMMs per block of queries, for head dims no fused kernel takes.

The VAE's mid-block attends over every latent pixel with one head of 512 channels. Flash-style kernels stop at
head dim 256, so in half precision it fell to SDPA's memory-efficient kernel: 4.5 ms at 16,384 tokens on an
H100, about 120 TFLOP/s, where cuBLAS runs such products at 600+ (2026-12-05). Here each block of queries is

    scores = q kᵀ            cuBLAS in the input dtype, float32 out (`bmm(..., out_dtype=float32)`)
    probs  = softmax(scale * scores), rounded to the input dtype   (`modalmesh.kernels.softmax`, one pass)
    out    = probs v         cuBLAS, float32 accumulation

Flash kernels also round the probabilities to the input dtype before their second product. Query blocks are
sized so a block's scores and probabilities stay within WORKSPACE_BYTES (a bounded temporary, not the (S, S)
matrix). No masks (causal, windows) and no packed or paged layouts; GQA repeats the kv heads. Off CUDA (the
CPU tests) the products run in float32 and the softmax is PyTorch's.
"""

from __future__ import annotations

import torch

from modalmesh import kernels
from modalmesh.attention.backends.base import AttentionBackend, repeat_kv
from modalmesh.kernels import softmax as softmax_kernels

WORKSPACE_BYTES = 384 << 20  # a block's float32 scores plus its probabilities


def float32_scores(q: torch.Tensor, k_t: torch.Tensor) -> torch.Tensor:
    """q @ k_t per batch in float32: cuBLAS's half-precision product with float32 output on CUDA (no rounding
    of the scores to the input dtype), float32 operands elsewhere (the products of half-precision values are
    exact in float32 either way)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return torch.bmm(q, k_t, out_dtype=torch.float32)
    return torch.bmm(q.float(), k_t.float())


def blocks(batch_heads: int, s_q: int, s_k: int, element_size: int) -> tuple[int, int]:
    """(batch-heads, queries) per step: whole heads while they fit WORKSPACE_BYTES, else blocks of queries."""
    per_query = s_k * (4 + element_size)
    queries = max(1, WORKSPACE_BYTES // per_query)
    if queries < s_q:
        return 1, queries
    return max(1, min(batch_heads, queries // s_q)), s_q


class ChunkedMatmul(AttentionBackend):
    def probe(self) -> None:
        if not hasattr(torch.ops.aten.bmm, "dtype"):
            raise RuntimeError(f"torch {torch.__version__} has no bmm with out_dtype")

    def dense(self, q, k, v, *, causal, scale, window):
        if causal or window is not None:
            raise ValueError(f"{self.name} takes no mask (causal or window)")
        b, s_q, heads, d = q.shape
        s_k, dv = k.shape[1], v.shape[-1]
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
        bh = b * heads
        q_h = q.transpose(1, 2).reshape(bh, s_q, d)  # views where heads == 1 (the VAE)
        k_t = k.permute(0, 2, 3, 1).reshape(bh, d, s_k)
        v_h = v.transpose(1, 2).reshape(bh, s_k, dv)
        out = q.new_empty((bh, s_q, dv))
        step_heads, step_queries = blocks(bh, s_q, s_k, q.element_size())
        for h0 in range(0, bh, step_heads):
            heads_ = slice(h0, h0 + step_heads)
            for q0 in range(0, s_q, step_queries):
                queries = slice(q0, q0 + step_queries)
                scores = float32_scores(q_h[heads_, queries], k_t[heads_])
                out[heads_, queries] = torch.bmm(self._softmax(scores, scale, q.dtype), v_h[heads_])
        return out.view(b, heads, s_q, dv).transpose(1, 2)

    @staticmethod
    def _softmax(scores: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        if kernels.usable(scores) and softmax_kernels.fusable(scores):
            return softmax_kernels.scaled_softmax(scores, scale, dtype)
        return softmax_kernels.reference(scores, scale, dtype)
