"""Writing new tokens' k/v into the paged KV pool (layout owned by modalmesh.kv).

Contract with the KV package, per layer:
    k_cache: (num_pages, page_size, num_kv_heads, head_dim)
    v_cache: (num_pages, page_size, num_kv_heads, v_head_dim)
    slot of a token = page_index * page_size + offset_in_page
    slot_mapping: int64 (T,), one valid slot per new token (padding tokens need a scratch slot)
    block_table:  int32 (B, max_pages_per_seq), each sequence's pages in order
    context_lens: int32 (B,), tokens in the cache per sequence, the new ones included
The caches must be contiguous: a slot is a flat row of the (num_pages * page_size) view.
"""

from __future__ import annotations

import torch


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                v_head_dim: int) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            "k_cache/v_cache must be (num_pages, page_size, num_kv_heads, head_dim), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} disagree on pages/heads")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape[3] != v_head_dim:
        raise ValueError(
            f"cache heads/dims {tuple(k_cache.shape[2:])}/{v_cache.shape[3]} do not match the layer's "
            f"{num_kv_heads} kv heads of dim {head_dim}/{v_head_dim}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v of T new tokens, (T, H_kv, D) and (T, H_kv, Dv), into their slots of the pool."""
    if k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"{k.shape[0]} new tokens but {slot_mapping.shape[0]} slots")
    rows_k = k_cache.view(-1, *k_cache.shape[2:])
    rows_v = v_cache.view(-1, *v_cache.shape[2:])
    rows_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    rows_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_pages(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(num_pages, page_size, H, D) pool + (B, L) slots -> (B, L, H, D) dense k or v."""
    return cache.view(-1, *cache.shape[2:])[slots]
