"""`Attention`: the only attention a model calls. It holds no weights.

    attn = Attention(num_heads=16, head_dim=64, num_kv_heads=4, component="vision_encoder",
                     layouts=("varlen",), dtype=torch.bfloat16)
    out = attn(q, k, v, meta)           # q (T, 16, 64), k/v (T, 4, 64), meta: VarlenMetadata

The backend is selected when the layer is built (component overrides, defaults,
ranking; see selector.py). Each call checks cheaply (one cached lookup) that the
chosen backend takes this call's layout, dtype and device; if not, the call is
rerouted and counted, or, for a backend explicitly named for this component,
cast to its compute dtype and back.

Layouts: dense (B, S, H, D) with no metadata; packed (T, H, D) with a
`VarlenMetadata`; paged with a `PagedMetadata` and ``kv_cache=(k_cache, v_cache)``,
where k/v are the new tokens' and are written into the pool before attending.
Metadata may also come from ``with attention_metadata(meta):`` around the model call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from modalmesh.attention.capability import Needs
from modalmesh.attention.metadata import PagedMetadata, VarlenMetadata, current_metadata
from modalmesh.attention.paged import check_cache, store_kv
from modalmesh.attention.selector import AttentionSelector, current_selector


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int | None = None,
        v_head_dim: int | None = None,
        component: str,
        causal: bool = False,
        window: tuple[int, int] | None = None,
        scale: float | None = None,
        layouts: Iterable[str] = ("dense",),
        page_size: int | None = None,
        dtype: torch.dtype | None = None,
        default_backend: str | None = None,
        supported_backends: Iterable[str] | None = None,
        selector: AttentionSelector | None = None,
        seqlen_hint: int | None = None,
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads <= 0 or head_dim <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        if window is not None and (len(window) != 2 or min(window) < -1):
            raise ValueError(f"window must be (left, right) with -1 for unbounded, got {window!r}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim or head_dim
        self.causal = causal
        self.window = tuple(window) if window is not None and tuple(window) != (-1, -1) else None
        self.scale = float(scale) if scale is not None else head_dim**-0.5
        self.needs = Needs(
            dtype=dtype or torch.get_default_dtype(),
            head_dim=head_dim,
            v_head_dim=self.v_head_dim,
            layouts=tuple(layouts),
            causal=causal,
            window=self.window,
            gqa=num_kv_heads != num_heads,
            page_size=page_size,
            seqlen_hint=seqlen_hint,
        )
        self.selector = selector or current_selector()
        self.selection = self.selector.select(
            component, self.needs, default=default_backend, supported=supported_backends
        )

    @property
    def backend_name(self) -> str:
        return self.selection.backend

    def extra_repr(self) -> str:
        return (f"component={self.selection.component}, backend={self.backend_name}, heads={self.num_heads}/"
                f"{self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}, window={self.window}")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: VarlenMetadata | PagedMetadata | None = None,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        kv_written: bool = False,
    ) -> torch.Tensor:
        meta = meta if meta is not None else current_metadata()
        layout = "dense"
        if isinstance(meta, PagedMetadata):
            layout = "paged"
        elif isinstance(meta, VarlenMetadata):
            layout = "varlen"
        tokens = self._check(layout, q, k, v, meta, kv_cache)
        page_size = kv_cache[0].shape[1] if layout == "paged" else None
        offset = layout == "dense" and self.causal and q.shape[1] != k.shape[1]
        route = self.selector.route(self.selection, layout, q.dtype, q.device, page_size, offset)
        if layout == "paged" and meta.token_seq is not None and not route.backend.spec.graph_safe:
            # Per-token form: only graph-safe kernels read it as it is; converted once a step, not per layer.
            meta = meta.cached("per_token_as_decode", meta.per_token_as_decode)
        if route.rerouted_from is not None:
            self.selector.count_reroute(self.selection, route)
        if layout == "paged" and not kv_written:  # kv_written: the caller's fused kernel stored them
            store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        if tokens == 0:
            return q.new_empty((*q.shape[:-1], self.v_head_dim))
        in_dtype = q.dtype
        if route.cast_dtype is not None:
            q, k, v = (x.to(route.cast_dtype) for x in (q, k, v))
        kw = dict(causal=self.causal, scale=self.scale, window=self.window)
        backend = route.backend
        if layout == "dense":
            out = backend.dense(q, k, v, **kw)
        elif layout == "varlen":
            out = backend.varlen(q, k, v, meta, **kw)
        else:
            k_cache, v_cache = kv_cache
            if route.cast_dtype is not None and k_cache.dtype != route.cast_dtype:
                raise ValueError(f"{backend.name} computes in {route.cast_dtype}; the KV pool is {k_cache.dtype}")
            out = backend.paged(q, k_cache, v_cache, meta, **kw)
        return out.to(in_dtype)

    def warm_paged(self, kv_cache: tuple[torch.Tensor, torch.Tensor], max_seqs: int) -> None:
        """Compile ahead of serving what this layer's paged backend would compile in its first steps of up to
        `max_seqs` sequences (the backend's `warm_paged`). Layers of the same shape share what it compiles."""
        k_cache, v_cache = kv_cache
        route = self.selector.route(self.selection, "paged", k_cache.dtype, k_cache.device, k_cache.shape[1], False)
        q = torch.zeros((1, self.num_heads, self.head_dim), dtype=route.cast_dtype or k_cache.dtype,
                        device=k_cache.device)
        route.backend.warm_paged(q, k_cache, v_cache, causal=self.causal, scale=self.scale, window=self.window,
                                 max_seqs=max_seqs)

    def _check(self, layout, q, k, v, meta, kv_cache) -> int:
        """Validate shapes against the layer (model bugs, so ValueError); return the token count."""
        token_dims = 2 if layout == "dense" else 1
        want_q = (self.num_heads, self.head_dim)
        if q.dim() != token_dims + 2 or tuple(q.shape[-2:]) != want_q:
            shape = "(B, S, H, D)" if layout == "dense" else "(T, H, D)"
            raise ValueError(f"{layout} attention wants q {shape} with H, D = {want_q}; got {tuple(q.shape)}")
        if tuple(k.shape[-2:]) != (self.num_kv_heads, self.head_dim) or v.shape[-2:] != (
                self.num_kv_heads, self.v_head_dim) or k.shape[:-2] != v.shape[:-2] or k.dim() != q.dim():
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match {self.num_kv_heads} kv heads "
                             f"of dim {self.head_dim}/{self.v_head_dim}")
        if layout == "dense":
            if k.shape[0] != q.shape[0]:
                raise ValueError(f"q batch {q.shape[0]} != k batch {k.shape[0]}")
            return q.shape[0] * q.shape[1]
        if layout == "varlen":
            if q.shape[0] != meta.total_tokens or k.shape[0] != q.shape[0]:
                raise ValueError(f"packed q/k hold {q.shape[0]}/{k.shape[0]} tokens; metadata has {meta.total_tokens}")
            return q.shape[0]
        if kv_cache is None:
            raise ValueError("paged attention needs kv_cache=(k_cache, v_cache)")
        check_cache(*kv_cache, self.num_kv_heads, self.head_dim, self.v_head_dim)
        if kv_cache[0].shape[1] != meta.page_size:
            raise ValueError(f"pool pages hold {kv_cache[0].shape[1]} tokens; metadata says {meta.page_size}")
        if q.shape[0] != meta.slot_mapping.shape[0] or k.shape[0] != q.shape[0]:
            raise ValueError(f"{q.shape[0]} new tokens but {meta.slot_mapping.shape[0]} slots in the metadata")
        return q.shape[0]
