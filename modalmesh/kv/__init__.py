"""KV cache: sizing and tensors (pool.py), page bookkeeping (allocator.py)."""

from modalmesh.kv.allocator import PageAllocator, block_table_tensor, context_lens_tensor, slot_mapping_tensor
from modalmesh.kv.pool import (
    DEFAULT_PAGE_SIZE,
    KVLayout,
    KVPlan,
    KVPool,
    LayerKV,
    build_kv_pool,
    free_device_memory,
    plan_kv_pool,
)

__all__ = [
    "DEFAULT_PAGE_SIZE", "KVLayout", "KVPlan", "KVPool", "LayerKV", "PageAllocator", "build_kv_pool", "block_table_tensor",
    "context_lens_tensor", "free_device_memory", "plan_kv_pool", "slot_mapping_tensor",
]
