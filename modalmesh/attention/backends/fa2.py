"""fa2: the flash-attn 2 package (``flash_attn``), imported only when probed.

Dense, packed and paged (flash_attn_varlen_func with block_table). Its paged path
wants pages of a multiple of 256 tokens, so a pool of 16-token pages is served by
another backend; `probe` drops window/paged support on versions without them.
"""

from __future__ import annotations

import dataclasses
import inspect

from modalmesh.attention.backends.base import AttentionBackend, first
from modalmesh.attention.backends.torch_varlen import flash_window
from modalmesh.attention.capability import PAGED, WINDOW


class FlashAttn2(AttentionBackend):
    def probe(self) -> None:
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        params = inspect.signature(flash_attn_varlen_func).parameters
        drop = set()
        if "window_size" not in params:
            drop.add(WINDOW)
        if "block_table" not in params:
            drop.add(PAGED)
        if drop:
            targets = tuple(dataclasses.replace(t, features=t.features - drop) for t in self.spec.targets)
            self.spec = dataclasses.replace(self.spec, targets=targets)
        self._dense, self._varlen = flash_attn_func, flash_attn_varlen_func

    @staticmethod
    def _kw(causal, scale, window):
        kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal)
        if window is not None:
            kw["window_size"] = flash_window(causal, window)
        return kw

    def dense(self, q, k, v, *, causal, scale, window):
        return first(self._dense(q, k, v, **self._kw(causal, scale, window)))

    def varlen(self, q, k, v, meta, *, causal, scale, window):
        cu, n = meta.cu_seqlens, meta.max_seqlen
        return first(self._varlen(q, k, v, cu, cu, n, n, **self._kw(causal, scale, window)))

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        return first(self._varlen(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_context_len,
            block_table=meta.block_table, **self._kw(causal, scale, window),
        ))
