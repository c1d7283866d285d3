"""Batch metadata and the paged-KV contract: slots, store_kv, validation, SDPA layout choice."""

from __future__ import annotations

import pytest
import torch

from modalmesh.attention import PagedMetadata, VarlenMetadata, masks, store_kv
from modalmesh.attention.paged import check_cache


def test_slot_mapping_positions_and_lengths():
    table = torch.tensor([[3, 0, 6], [5, 1, 2]], dtype=torch.int32)
    meta = PagedMetadata.build([2, 5], [7, 9], table, 4)
    # Sequence 0: positions 5, 6 -> page table[0][1] = 0, offsets 1, 2.
    # Sequence 1: positions 4..8 -> pages 1 (offsets 0..3) and 2 (offset 0).
    assert meta.slot_mapping.tolist() == [1, 2, 4, 5, 6, 7, 8]
    assert meta.positions.tolist() == [5, 6, 4, 5, 6, 7, 8]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 7] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.cu_seqlens_k.tolist() == [0, 7, 16]
    assert meta.context_lens.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_seqlen_q, meta.max_context_len, meta.is_decode, meta.without_prefix) == (5, 9, False, False)
    decode = PagedMetadata.decode([1, 4], table[:, :1], 4)
    assert decode.slot_mapping.tolist() == [12, 23] and decode.is_decode
    assert PagedMetadata.build([3], [3], table[:1], 4).without_prefix


def test_slots_given_by_the_kv_package_are_kept():
    slots = torch.tensor([9, 10])
    meta = PagedMetadata.build([2], [2], torch.tensor([[2]]), 8, slot_mapping=slots)
    assert meta.slot_mapping.tolist() == [9, 10]


@pytest.mark.parametrize("args, message", [
    (([3], [2], torch.zeros(1, 1), 4), "query_len must be in 0..context_len"),
    (([1], [9], torch.zeros(1, 2), 4), "holds 2 pages per sequence; 3 are needed"),
    (([1, 1], [1, 1], torch.zeros(1, 1), 4), "must be \\(batch=2"),
    (([1], [1, 2], torch.zeros(1, 1), 4), "equal length"),
])
def test_paged_metadata_validation(args, message):
    with pytest.raises(ValueError, match=message):
        PagedMetadata.build(*args)


def test_store_kv_writes_exactly_the_given_slots():
    k_cache, v_cache = torch.zeros(3, 4, 2, 5), torch.zeros(3, 4, 2, 7)
    k, v = torch.randn(3, 2, 5), torch.randn(3, 2, 7)
    store_kv(k, v, k_cache, v_cache, torch.tensor([11, 0, 5]))
    expected_k = torch.zeros(12, 2, 5)
    expected_k[[11, 0, 5]] = k
    assert torch.equal(k_cache.view(12, 2, 5), expected_k)
    assert torch.equal(v_cache[2, 3], v[0]) and torch.equal(v_cache[0, 0], v[1]) and torch.equal(v_cache[1, 1], v[2])
    assert v_cache.view(12, -1).any(-1).sum() == 3  # nothing else written
    with pytest.raises(ValueError, match="3 new tokens but 2 slots"):
        store_kv(k, v, k_cache, v_cache, torch.tensor([1, 2]))


def test_store_kv_converts_to_the_pool_dtype():
    k_cache = torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16)
    store_kv(torch.ones(1, 1, 4), torch.ones(1, 1, 4), k_cache, k_cache.clone(), torch.tensor([1]))
    assert k_cache[0, 1].float().sum() == 4


@pytest.mark.parametrize("k_cache, v_cache, message", [
    (torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2), "must be \\(num_pages"),
    (torch.zeros(2, 4, 2, 8), torch.zeros(3, 4, 2, 8), "disagree"),
    (torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), "do not match"),
    (torch.zeros(2, 8, 2, 4).transpose(1, 3), torch.zeros(2, 4, 2, 8), "contiguous"),
])
def test_cache_layout_checks(k_cache, v_cache, message):
    with pytest.raises(ValueError, match=message):
        check_cache(k_cache, v_cache, 2, 8, 8)


def test_varlen_metadata():
    meta = VarlenMetadata.from_cu_seqlens(torch.tensor([0, 3, 3, 7]))
    assert meta.seqlens == (3, 0, 4) and meta.max_seqlen == 4 and meta.cu_seqlens.dtype == torch.int32
    assert meta.positions.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert meta.sequence_ids.tolist() == [0, 0, 0, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="non-decreasing"):
        VarlenMetadata.from_cu_seqlens(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="sdpa_strategy"):
        VarlenMetadata.from_seqlens([1], sdpa_strategy="loop")


def test_sdpa_layout_picks_the_smaller_mask():
    # One long sequence among short ones: T^2 = 169 < B * max^2 = 405.
    assert masks.varlen_strategy(VarlenMetadata.from_seqlens([9, 1, 1, 1, 1])) == "block_diag"
    # Equal lengths: B * max^2 = 48 < T^2 = 144.
    assert masks.varlen_strategy(VarlenMetadata.from_seqlens([4, 4, 4])) == "padded"
    assert masks.varlen_strategy(VarlenMetadata.from_seqlens([4, 4, 4], sdpa_strategy="block_diag")) == "block_diag"


def test_padding_rows_never_produce_nan():
    meta = VarlenMetadata.from_seqlens([3, 1])
    mask = masks.padded_mask(meta, causal=True, window=None)
    assert mask.shape == (2, 1, 3, 3)
    assert mask.any(-1).all()  # every row, padding included, sees at least one key
    assert mask[1, 0, 0].tolist() == [True, False, False]  # the real token of sequence 1 sees only itself
