"""torch_varlen: torch.nn.attention.varlen.varlen_attn (flash-attention kernels shipped in torch).

Its keyword set grew across torch releases (is_causal, then window_size,
enable_gqa, and block_table/seqused_k for paged KV), so `probe` reads the
signature and narrows the capability record to what this torch has.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from modalmesh.attention.backends.base import AttentionBackend, first, repeat_kv
from modalmesh.attention.capability import PAGED, WINDOW


def flash_window(causal: bool, window) -> tuple[int, int]:
    """(left, right) as flash kernels take it; causal is right = 0."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    return left, right


class TorchVarlen(AttentionBackend):
    def probe(self) -> None:
        # Its first call imports torch._dynamo (6.8 s on the H200 host): the LLM's start-up warm-up
        # (ModelRunner._warm_up) makes that call, so no request waits for it.
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        self._fn = varlen_attn
        self._window_kw = "window_size" in params
        self._causal_kw = "is_causal" in params
        self._gqa_kw = "enable_gqa" in params
        if not (self._window_kw or self._causal_kw):
            raise RuntimeError("this torch's varlen_attn has neither is_causal nor window_size")
        drop = set()
        if not self._window_kw:
            drop.add(WINDOW)
        if not ("block_table" in params and "seqused_k" in params and self._gqa_kw):
            drop.add(PAGED)
        if drop:
            targets = tuple(dataclasses.replace(t, features=t.features - drop) for t in self.spec.targets)
            self.spec = dataclasses.replace(self.spec, targets=targets)

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, **paged):
        kw = dict(scale=scale, **paged)
        if self._window_kw:
            kw["window_size"] = flash_window(causal, window)
        else:
            kw["is_causal"] = causal
        heads, kv_heads = q.shape[1], k.shape[-2]
        if kv_heads != heads:
            if self._gqa_kw:
                kw["enable_gqa"] = True
            else:
                k, v = repeat_kv(k, heads), repeat_kv(v, heads)
        return first(self._fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw))

    def dense(self, q, k, v, *, causal, scale, window):
        batch, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
        steps = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
        out = self._call(
            q.reshape(batch * s_q, *q.shape[2:]), k.reshape(batch * s_k, *k.shape[2:]),
            v.reshape(batch * s_k, *v.shape[2:]), steps * s_q, steps * s_k, s_q, s_k,
            causal=causal, scale=scale, window=window,
        )
        return out.view(batch, s_q, *out.shape[1:])

    def varlen(self, q, k, v, meta, *, causal, scale, window):
        cu, n = meta.cu_seqlens, meta.max_seqlen
        return self._call(q, k, v, cu, cu, n, n, causal=causal, scale=scale, window=window)

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        return self._call(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_context_len,
            causal=causal, scale=scale, window=window, seqused_k=meta.context_lens, block_table=meta.block_table,
        )
