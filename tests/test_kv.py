"""KV pool sizing arithmetic, the page allocator, the cache layout contract, and the pool gauges."""

from __future__ import annotations

import random

import pytest
import torch

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError, InvalidArgument
from modalmesh.kv import (
    KVLayout,
    KVPlan,
    KVPool,
    LayerKV,
    PageAllocator,
    build_kv_pool,
    free_device_memory,
    plan_kv_pool,
)
from modalmesh.metrics import Metrics

CFG = dict(model_type="llama", hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
           intermediate_size=128, vocab_size=100, max_position_embeddings=256)


# ---- sizing ----------------------------------------------------------------------------------


def test_bytes_per_token_from_the_config():
    cfg = ModelConfig.from_hf(CFG)  # head_dim 8
    layout = KVLayout.from_model_config(cfg, dtype=torch.float16)
    assert layout.bytes_per_token == 3 * 4 * (8 + 8) * 2
    assert KVLayout.from_model_config(cfg, tp_size=2, dtype=torch.float16).bytes_per_token == 3 * 2 * 16 * 2
    # tp > kv heads: each rank keeps one (replicated) head
    assert KVLayout.from_model_config(cfg, tp_size=8, dtype=torch.float16).bytes_per_token == 3 * 1 * 16 * 2
    mla_like = ModelConfig.from_hf(dict(CFG, v_head_dim=4))
    assert KVLayout.from_model_config(mla_like, dtype=torch.float32).bytes_per_token == 3 * 4 * (8 + 4) * 4


def test_v_head_dim_zero_sentinel_never_sizes_a_zero_width_v_cache():
    cfg = ModelConfig.from_hf(dict(CFG, v_head_dim=0, qk_rope_head_dim=0, kv_lora_rank=512, use_mla=False))
    layout = KVLayout.from_model_config(cfg, dtype=torch.bfloat16)
    assert {layer.v_head_dim for layer in layout.layers} == {8}
    pool = KVPool(layout, plan_kv_pool(layout, max_model_len=32, kv_cache_tokens=64), "cpu",
                  metrics=Metrics("t", process_metrics=False))
    assert pool.v_caches[0].shape == (4, 16, 4, 8)
    with pytest.raises(ConfigError, match="zero-width"):
        KVLayout((LayerKV(4, 8, 0),), torch.float16)


def test_sliding_layers_with_their_own_dimensions():
    cfg = ModelConfig.from_hf(dict(CFG, sliding_window=64, layer_types=["sliding_attention", "full_attention",
                                                                        "sliding_attention"],
                                   swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=4))
    layout = KVLayout.from_model_config(cfg, dtype=torch.float32)
    assert layout.layers == (LayerKV(2, 16, 4), LayerKV(4, 8, 8), LayerKV(2, 16, 4))
    assert layout.bytes_per_token == 4 * (2 * 20 + 4 * 16 + 2 * 20)
    assert layout.describe("head_dim") == "16/8"


def test_capacity_from_free_memory_rounds_down_to_pages():
    layout = KVLayout((LayerKV(1, 4, 4),), torch.float32)  # 32 bytes/token, 512 bytes per 16-token page
    plan = plan_kv_pool(layout, max_model_len=100, free_bytes=10_000, mem_fraction=0.5)
    assert plan.num_pages == 5000 // 512 == 9 and plan.capacity_tokens == 144
    assert plan.nbytes == 144 * 32 <= 5000
    plan = plan_kv_pool(layout, max_model_len=100, free_bytes=10_000, mem_fraction=0.5, page_size=32)
    assert plan.num_pages == 4 and plan.capacity_tokens == 128


def test_explicit_token_count_rounds_up_to_pages():
    layout = KVLayout((LayerKV(1, 4, 4),), torch.float32)
    plan = plan_kv_pool(layout, max_model_len=100, kv_cache_tokens=100)
    assert plan == KVPlan(num_pages=7, page_size=16, bytes_per_token=32) and plan.capacity_tokens == 112
    with pytest.raises(ConfigError, match="only 0.00 GiB is free"):
        plan_kv_pool(layout, max_model_len=100, kv_cache_tokens=100, free_bytes=1000)


def test_not_even_one_max_length_request_fits():
    layout = KVLayout((LayerKV(1, 4, 4),), torch.float32)
    with pytest.raises(ConfigError, match=r"holds 144 tokens .* one max-length request needs 200"):
        plan_kv_pool(layout, max_model_len=200, free_bytes=10_000, mem_fraction=0.5)
    with pytest.raises(ConfigError, match="needs 200"):
        plan_kv_pool(layout, max_model_len=200, kv_cache_tokens=190)
    assert plan_kv_pool(layout, max_model_len=200, kv_cache_tokens=200).num_pages == 13
    with pytest.raises(ConfigError, match="mem-fraction"):
        plan_kv_pool(layout, max_model_len=1, free_bytes=10, mem_fraction=1.5)


def test_free_device_memory_on_cpu_is_positive():
    assert free_device_memory("cpu") > 0


# ---- allocator -------------------------------------------------------------------------------


def test_allocate_extend_free_and_slots():
    a = PageAllocator(num_pages=4, page_size=4)
    assert a.allocate("r1", 5)  # 2 pages
    assert a.pages("r1") == [0, 1] and a.num_tokens("r1") == 5
    assert a.slot_mapping("r1") == [0, 1, 2, 3, 4]
    assert a.allocate("r2", 3)
    assert a.pages("r2") == [2] and a.slot_mapping("r2") == [8, 9, 10]
    assert a.extend("r1", 3)  # 8 tokens: still 2 pages
    assert a.pages("r1") == [0, 1] and a.slot_mapping("r1", 5) == [5, 6, 7]
    assert a.extend("r1", 1)  # token 8 needs a third page
    assert a.pages("r1") == [0, 1, 3] and a.slot_mapping("r1", 8, 9) == [12]
    assert (a.used_tokens, a.num_free_pages) == (12, 0)
    assert a.block_table(["r1", "r2"]) == [[0, 1, 3], [2, 0, 0]]
    assert a.block_table(["r2"], max_pages=4, pad=-1) == [[2, -1, -1, -1]]
    assert a.free("r1") == 3
    assert (a.used_tokens, a.num_free_pages) == (3, 3)
    a.check()


def test_exhaustion_is_a_clean_no_room_signal():
    a = PageAllocator(num_pages=3, page_size=4)
    assert a.allocate("big", 9)  # 3 pages
    assert not a.can_allocate(1)
    assert a.allocate("late", 1) is False and "late" not in a  # nothing changed
    assert a.extend("big", 3) is True  # fills the last page's tail: no new page needed
    assert a.extend("big", 1) is False and a.num_tokens("big") == 12
    assert a.used_tokens == 12
    a.free("big")
    assert a.allocate("late", 12)
    a.check()


def test_misuse_is_an_invalid_argument():
    a = PageAllocator(num_pages=2, page_size=4)
    a.allocate("r", 2)
    with pytest.raises(InvalidArgument, match="already holds"):
        a.allocate("r", 1)
    with pytest.raises(InvalidArgument, match="holds no KV pages"):
        a.free("other")
    with pytest.raises(InvalidArgument, match="outside"):
        a.slot_mapping("r", 0, 3)
    with pytest.raises(InvalidArgument, match="max_pages=0"):
        a.block_table(["r"], max_pages=0)


def test_random_workload_never_leaks_pages():
    rng = random.Random(0)
    a = PageAllocator(num_pages=64, page_size=16)
    live: dict[int, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(0, 100)
            ok = a.allocate(step, n)
            assert ok == (a.pages_for(n) <= 64 - sum(a.pages_for(t) for t in live.values()))
            if ok:
                live[step] = n
        elif op < 0.8 and live:
            sid = rng.choice(list(live))
            k = rng.randint(1, 20)
            free_pages = 64 - sum(a.pages_for(t) for t in live.values())
            ok = a.extend(sid, k)
            assert ok == (a.pages_for(live[sid] + k) - a.pages_for(live[sid]) <= free_pages)
            if ok:
                live[sid] += k
        elif live:
            sid = rng.choice(list(live))
            assert a.free(sid) == a.pages_for(live.pop(sid))
        a.check()
        assert a.used_tokens == sum(live.values())
        assert a.num_used_pages == sum(a.pages_for(t) for t in live.values())
    for sid in list(live):
        a.free(sid)
    assert a.num_free_pages == 64 and a.used_tokens == 0
    a.check()


# ---- the pool: layout contract and gauges -----------------------------------------------------


def _pool(metrics, pages=8, page=4):
    layout = KVLayout((LayerKV(2, 3, 5), LayerKV(2, 3, 5)), torch.float32)
    return KVPool(layout, KVPlan(num_pages=pages, page_size=page, bytes_per_token=layout.bytes_per_token), "cpu",
                  metrics=metrics)


def _gauge(metrics, name, **labels):
    return metrics.registry.get_sample_value(f"modalmesh_kv_pool_{name}", {"service": "t", "pool": "kv", **labels})


def test_cache_tensors_follow_the_attention_contract():
    pool = _pool(Metrics("t", process_metrics=False))
    assert len(pool.k_caches) == 2 and pool.k_caches[0].shape == (8, 4, 2, 3) and pool.v_caches[1].shape == (8, 4, 2, 5)
    assert pool.nbytes == 2 * 8 * 4 * 2 * (3 + 5) * 4
    assert pool.allocate("a", 3) and pool.allocate("b", 6)
    # Prefill writes each new token's K at its slot...
    k_new = torch.randn(9, 2, 3)
    slots = pool.slot_mapping([("a", 0, 3), ("b", 0, 6)])
    assert slots.dtype == torch.int64 and slots.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    pool.k_caches[0].view(-1, 2, 3)[slots] = k_new
    # ...and a paged kernel finds it again through block_table and context_lens.
    table, lens = pool.block_table(["a", "b"]), pool.context_lens(["a", "b"])
    assert table.dtype == torch.int32 and table.tolist() == [[0, 0], [1, 2]]
    assert lens.dtype == torch.int32 and lens.tolist() == [3, 6]
    gathered = [torch.stack([pool.k_caches[0][table[b, i // 4], i % 4] for i in range(lens[b])]) for b in range(2)]
    torch.testing.assert_close(torch.cat(gathered), k_new)
    assert pool.extend("a", 2)  # decode: token 4 of "a" opens a new page
    assert pool.slot_mapping([("a", 3, 5)]).tolist() == [3, 12]


def test_usage_gauges_track_exactly():
    metrics = Metrics("t", process_metrics=False)
    pool = _pool(metrics)
    assert _gauge(metrics, "capacity_tokens") == 32 and _gauge(metrics, "used_tokens") == 0
    assert _gauge(metrics, "bytes") == pool.nbytes and _gauge(metrics, "page_size") == 4
    info = metrics.registry.get_sample_value("modalmesh_kv_pool_info", {
        "service": "t", "pool": "kv", "dtype": "float32", "layers": "2", "kv_heads": "2", "head_dim": "3",
        "v_head_dim": "5"})
    assert info == 1
    pool.allocate("a", 5)
    pool.allocate("b", 10)
    assert _gauge(metrics, "used_tokens") == 15 and _gauge(metrics, "usage_ratio") == 15 / 32
    pool.extend("a", 1)
    assert _gauge(metrics, "used_tokens") == 16
    assert not pool.allocate("c", 30)  # no room: the gauges do not move
    assert _gauge(metrics, "used_tokens") == 16
    pool.free("b")
    assert _gauge(metrics, "used_tokens") == 6 and _gauge(metrics, "usage_ratio") == 6 / 32
    pool.free("a")
    assert _gauge(metrics, "used_tokens") == 0 and pool.allocator.num_free_pages == 8


def test_build_kv_pool_from_a_config(monkeypatch):
    cfg = ModelConfig.from_hf(CFG)
    metrics = Metrics("t", process_metrics=False)
    pool = build_kv_pool(cfg, "cpu", kv_cache_tokens=300, dtype=torch.float16, metrics=metrics)
    assert pool.plan.capacity_tokens == 304 and pool.k_caches[0].shape == (19, 16, 4, 8)
    assert pool.k_caches[0].dtype == torch.float16 and len(pool.k_caches) == 3
    assert _gauge(metrics, "capacity_tokens") == 304
    with pytest.raises(ConfigError, match="one max-length request needs 256"):
        build_kv_pool(cfg, "cpu", kv_cache_tokens=200, metrics=metrics)
    # Sized from measured free memory: 1 MiB * 0.5 at 768 bytes/token (fp32) -> 682 tokens -> 42 pages.
    monkeypatch.setattr("modalmesh.kv.pool.free_device_memory", lambda device: 1 << 20)
    pool = build_kv_pool(cfg, "cpu", mem_fraction=0.5, metrics=metrics)
    assert pool.layout.bytes_per_token == 768 and pool.plan.num_pages == 42
    assert pool.nbytes <= (1 << 19)


def test_reserved_page_leaves_circulation_without_counting_as_used():
    from modalmesh.kv.allocator import PageAllocator

    alloc = PageAllocator(num_pages=3, page_size=4)
    page = alloc.reserve_page()
    assert alloc.capacity_tokens == 8 and alloc.used_tokens == 0 and alloc.num_free_pages == 2
    assert alloc.allocate("a", 8) and page not in alloc.pages("a")
    assert not alloc.allocate("b", 1)
    alloc.free("a")
    assert alloc.num_free_pages == 2 and page not in alloc._free
