"""modalmesh.layers in one process: each TP rank's shard built explicitly and checked against the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from modalmesh.errors import ConfigError
from modalmesh.layers import (
    MLP,
    ColumnParallelLinear,
    LayerNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_activation,
)
from modalmesh.weights import WeightMismatchError


def _load(layer, **tensors):
    for name, t in tensors.items():
        p = getattr(layer, name)
        p.weight_loader(p, t)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_column_parallel_shards_concatenate_to_the_full_output(tp):
    torch.manual_seed(0)
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(5, 8)
    outs = []
    for rank in range(tp):
        layer = ColumnParallelLinear(8, 12, bias=True, tp_rank=rank, tp_size=tp)
        _load(layer, weight=w, bias=b)
        assert layer.weight.shape == (12 // tp, 8)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_partial_sums_add_up_to_the_full_output(tp):
    torch.manual_seed(0)
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(5, 8)
    partial = torch.zeros(5, 6)
    for rank in range(tp):
        layer = RowParallelLinear(8, 6, bias=True, tp_rank=rank, tp_size=tp)
        _load(layer, weight=w, bias=b)
        torch.testing.assert_close(layer.bias, b)  # whole on every rank
        partial += F.linear(x.chunk(tp, -1)[rank], layer.weight)
    torch.testing.assert_close(partial + b, F.linear(x, w, b))


@pytest.mark.parametrize("tp", [1, 2])
def test_padded_mlp_shards_compute_the_checkpoints_mlp(tp):
    # pad_to rounds each rank's width up with zero rows (fc1) and columns (fc2). The parameters hold NaN before
    # loading, so padding the loader left unset would reach the output
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(200, 8), torch.randn(200), torch.randn(8, 200), torch.randn(8)
    x = torch.randn(5, 8)
    ref = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    out = torch.zeros(5, 8)
    for rank in range(tp):
        mlp = MLP(8, 200, "gelu_pytorch_tanh", pad_to=128, tp_rank=rank, tp_size=tp)
        assert mlp.fc1.weight.shape == (128 * (2 // tp), 8) and mlp.fc2.weight.shape == (8, 128 * (2 // tp))
        for p in mlp.parameters():
            p.data.fill_(float("nan"))
        _load(mlp.fc1, weight=w1, bias=b1)
        _load(mlp.fc2, weight=w2, bias=b2)
        with torch.no_grad():
            h = mlp.act(mlp.fc1(x))
            out += F.linear(h, mlp.fc2.weight)  # this rank's partial sum (the all-reduce's input)
    torch.testing.assert_close(out + b2, ref)


def test_padding_is_refused_where_it_would_misplace_outputs():
    with pytest.raises(ConfigError, match="a fused layer's outputs are split by size"):
        MergedColumnParallelLinear(8, [100, 100], pad_to=128, tp_rank=0, tp_size=1)
    with pytest.raises(ConfigError, match="gathered outputs"):
        ColumnParallelLinear(8, 100, gather_output=True, pad_to=128, tp_rank=0, tp_size=2)
    with pytest.raises(ConfigError, match="input_is_parallel"):
        RowParallelLinear(100, 8, input_is_parallel=False, pad_to=128, tp_rank=0, tp_size=2)
    with pytest.raises(ConfigError, match="pad_to = 0 should be a positive integer"):
        ColumnParallelLinear(8, 100, pad_to=0, tp_rank=0, tp_size=1)
    assert ColumnParallelLinear(8, 128, pad_to=128, tp_rank=0, tp_size=1).weight.shape == (128, 8)  # a multiple


def test_row_parallel_slices_a_replicated_input():
    torch.manual_seed(0)
    w, x = torch.randn(6, 8), torch.randn(5, 8)
    layer = RowParallelLinear(8, 6, bias=False, input_is_parallel=False, tp_rank=1, tp_size=2)
    _load(layer, weight=w)
    # all_reduce is the identity outside a process group: the output is this rank's partial sum.
    torch.testing.assert_close(layer(x), F.linear(x[:, 4:], w[:, 4:]))


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column_places_each_shard(tp):
    torch.manual_seed(0)
    gate, up = torch.randn(10, 4), torch.randn(10, 4)
    for rank in range(tp):
        a = MergedColumnParallelLinear(4, [10, 10], bias=False, tp_rank=rank, tp_size=tp)
        a.weight.weight_loader(a.weight, gate, 0)
        a.weight.weight_loader(a.weight, up, 1)
        n = 10 // tp
        torch.testing.assert_close(a.weight, torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]]))
        fused = MergedColumnParallelLinear(4, [10, 10], bias=False, tp_rank=rank, tp_size=tp)
        fused.weight.weight_loader(fused.weight, torch.cat([gate, up]))  # already-fused checkpoint
        torch.testing.assert_close(fused.weight, a.weight)


def _qkv_reference(H, KV, D, Dv=None):
    Dv = Dv or D
    torch.manual_seed(0)
    return torch.randn(H * D, 16), torch.randn(KV * D, 16), torch.randn(KV * Dv, 16)


@pytest.mark.parametrize(("H", "KV", "tp"), [(4, 2, 1), (4, 2, 2), (4, 2, 4), (4, 1, 4), (4, 4, 2)])
def test_qkv_splits_heads_and_replicates_kv_heads(H, KV, tp):
    D = 3
    q, k, v = _qkv_reference(H, KV, D)
    for rank in range(tp):
        layer = QKVParallelLinear(16, D, H, KV, bias=False, tp_rank=rank, tp_size=tp)
        for sid, t in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, t, sid)
        heads = H // tp
        kv_per_rank = max(1, KV // tp)
        kv_head0 = (rank // max(1, tp // KV)) * kv_per_rank
        mq, mk, mv = layer.weight.split([layer.q_size, layer.kv_size, layer.v_size])
        torch.testing.assert_close(mq, q[rank * heads * D:(rank + 1) * heads * D])
        torch.testing.assert_close(mk, k[kv_head0 * D:(kv_head0 + kv_per_rank) * D])
        torch.testing.assert_close(mv, v[kv_head0 * D:(kv_head0 + kv_per_rank) * D])
        # A checkpoint that already concatenates q|k|v (wqkv) loads to the same shard.
        fused = QKVParallelLinear(16, D, H, KV, bias=False, tp_rank=rank, tp_size=tp)
        fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
        torch.testing.assert_close(fused.weight, layer.weight)


def test_qkv_with_a_different_v_head_dim():
    q, k, v = _qkv_reference(2, 2, 4, Dv=3)
    layer = QKVParallelLinear(16, 4, 2, 2, bias=False, v_head_size=3)
    for sid, t in zip("qkv", (q, k, v)):
        layer.weight.weight_loader(layer.weight, t, sid)
    x = torch.randn(5, 16)
    oq, ok, ov = layer.split(layer(x))
    assert ov.shape == (5, 6)
    torch.testing.assert_close(ov, F.linear(x, v))


def test_qkv_per_head_interleaved_layout():
    H, D = 2, 3
    q, k, v = _qkv_reference(H, H, D)
    interleaved = torch.stack([q.view(H, D, 16), k.view(H, D, 16), v.view(H, D, 16)], dim=1).reshape(3 * H * D, 16)
    layer = QKVParallelLinear(16, D, H, bias=False)
    layer.weight.weight_loader(layer.weight, interleaved, "qkv_per_head")
    torch.testing.assert_close(layer.weight, torch.cat([q, k, v]))


def test_tp_sizes_that_do_not_divide_are_config_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        QKVParallelLinear(16, 4, 4, 2, tp_rank=0, tp_size=8)
    with pytest.raises(ConfigError, match="cannot replicate 2 KV heads"):
        QKVParallelLinear(16, 4, 6, 2, tp_rank=0, tp_size=3)
    with pytest.raises(ConfigError, match="output size = 10"):
        ColumnParallelLinear(4, 10, tp_rank=0, tp_size=4)


def test_loaders_check_shapes_and_shard_ids():
    col = ColumnParallelLinear(8, 12, bias=False, tp_rank=0, tp_size=2)
    with pytest.raises(WeightMismatchError, match="should have 12 along dim 0"):
        col.weight.weight_loader(col.weight, torch.zeros(6, 8))  # an already-sharded tensor
    with pytest.raises(WeightMismatchError, match=r"\[12, 7\] does not fit parameter shape \[6, 8\]"):
        col.weight.weight_loader(col.weight, torch.zeros(12, 7))
    with pytest.raises(WeightMismatchError, match="not fused"):
        col.weight.weight_loader(col.weight, torch.zeros(12, 8), "q")
    qkv = QKVParallelLinear(16, 4, 2, 2, bias=False)
    with pytest.raises(ValueError, match="shard id 'x'"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(8, 16), "x")
    rep = ReplicatedLinear(4, 4, bias=False)
    with pytest.raises(WeightMismatchError):
        rep.weight.weight_loader(rep.weight, torch.zeros(4, 5))


def test_layers_on_meta_allocate_nothing():
    with torch.device("meta"):
        layer = QKVParallelLinear(4096, 128, 32, 8, bias=True)
    assert layer.weight.is_meta and layer.weight.shape == (6144, 4096)
    assert layer.weight.shard_ids == ("q", "k", "v")


@pytest.mark.parametrize("tp", [1, 3])
def test_vocab_parallel_embedding_and_lm_head(tp):
    torch.manual_seed(0)
    V, E = 10, 4
    table, ids, h = torch.randn(V, E), torch.randint(0, V, (3, 5)), torch.randn(3, 5, E)
    emb_sum, logits = torch.zeros(3, 5, E), []
    for rank in range(tp):
        emb = VocabParallelEmbedding(V, E, tp_rank=rank, tp_size=tp)
        _load(emb, weight=table)
        emb_sum += emb(ids)  # each rank contributes the rows it owns; all_reduce sums them
        head = ParallelLMHead(V, E, tp_rank=rank, tp_size=tp)
        _load(head, weight=table)
        logits.append(F.linear(h, head.weight))
        if rank == tp - 1 and tp > 1:
            assert torch.all(head.weight[V - emb.vocab_start:] == 0)  # padding rows past the vocabulary
    torch.testing.assert_close(emb_sum, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, -1)[..., :V], F.linear(h, table))


def test_rms_norm_matches_llama_reference():
    torch.manual_seed(0)
    ref = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    mine = RMSNorm(16, eps=1e-5)
    _load(mine, weight=ref.weight.detach())
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 16, dtype=dtype) * 3
        with torch.no_grad():
            torch.testing.assert_close(mine.to(dtype)(x), ref.to(dtype)(x), atol=0, rtol=0)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    mine, ref = mine.float(), ref.float()
    with torch.no_grad():
        out, new_residual = mine(x, r)
        torch.testing.assert_close(new_residual, x + r)
        torch.testing.assert_close(out, ref(x + r))


def test_layer_norm_matches_torch():
    ref = torch.nn.LayerNorm(8, eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    mine = LayerNorm(8, eps=1e-5)
    _load(mine, weight=ref.weight.detach(), bias=ref.bias.detach())
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x))


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "relu"])
def test_activations_match_transformers(name):
    x = torch.randn(100) * 4
    torch.testing.assert_close(get_activation(name)(x), ACT2FN[name](x), atol=1e-6, rtol=1e-6)


def test_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation 'gelu_fancy'"):
        get_activation("gelu_fancy")
