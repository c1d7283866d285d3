"""A tiny real call of a chosen backend, on real hardware, before a model relies on it.

Importing a kernel proves little: a wheel can import and then fail with "no
kernel image is available for this device" on the first call, or compute
garbage for an arch it was not built for. When the platform was detected (not
faked), selection runs the winner once per layout on a few tokens and compares
with torch_naive; a failure rejects it with the reason, and the next one is tried.
"""

from __future__ import annotations

import torch

from modalmesh.attention.backends.naive import NaiveBackend
from modalmesh.attention.capability import Needs
from modalmesh.attention.metadata import PagedMetadata, VarlenMetadata
from modalmesh.attention.paged import store_kv

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}  # half precision: 2e-2


def smoke_test(backend, needs: Needs, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if `backend` serves `needs` correctly on `device`, else why not (one line)."""
    try:
        for layout in needs.layouts:
            got, want = _run(backend, needs, layout, device, dtype)
            if not torch.isfinite(got).all():
                return f"smoke test ({layout}): non-finite output"
            tol = _TOLERANCE.get(dtype, 2e-2)
            if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                err = (got.float() - want.float()).abs().max().item()
                return f"smoke test ({layout}): differs from torch_naive by {err:.3g}"
    except Exception as exc:  # noqa: BLE001 - the point is to catch whatever a broken kernel does
        lines = str(exc).strip().splitlines() or [""]
        return f"smoke test failed: {type(exc).__name__}: {lines[0][:200]}"
    return None


def _run(backend, needs: Needs, layout: str, device, dtype):
    gen = torch.Generator().manual_seed(0)
    kv_heads = 1 if needs.gqa else 2
    dv = needs.v_head_dim or needs.head_dim
    kw = dict(causal=needs.causal, scale=needs.head_dim**-0.5, window=needs.window)

    def rand(*shape):
        # Explicit device: models are often built under `with torch.device("meta")`.
        return torch.randn(*shape, generator=gen, device="cpu").to(device=device, dtype=dtype)

    ref = NaiveBackend(backend.spec)
    if layout == "dense":
        q, k, v = rand(1, 5, 2, needs.head_dim), rand(1, 5, kv_heads, needs.head_dim), rand(1, 5, kv_heads, dv)
        return backend.dense(q, k, v, **kw), ref.dense(q, k, v, **kw)
    if layout == "varlen":
        meta = VarlenMetadata.from_seqlens([3, 1, 4], device)
        q, k, v = rand(8, 2, needs.head_dim), rand(8, kv_heads, needs.head_dim), rand(8, kv_heads, dv)
        return backend.varlen(q, k, v, meta, **kw), ref.varlen(q, k, v, meta, **kw)
    page = needs.page_size or max(backend.spec.page_size_multiple, 4)
    per_seq = -(-3 // page)
    table = torch.arange(2 * per_seq, device=device).flip(0).view(2, per_seq).to(torch.int32)  # pages out of order
    meta = PagedMetadata.build([2, 1], [3, 2], table, page)
    k_cache, v_cache = rand(2 * per_seq, page, kv_heads, needs.head_dim), rand(2 * per_seq, page, kv_heads, dv)
    q = rand(3, 2, needs.head_dim)
    store_kv(rand(3, kv_heads, needs.head_dim), rand(3, kv_heads, dv), k_cache, v_cache, meta.slot_mapping)
    return backend.paged(q, k_cache, v_cache, meta, **kw), ref.paged(q, k_cache, v_cache, meta, **kw)
