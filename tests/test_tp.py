"""Tensor parallelism over a real gloo process group: TP=2 layers reproduce the TP=1 outputs.

Each rank builds the layers with the process group's rank/size (nothing passed
explicitly), loads the *full* tensors through the parameters' weight loaders,
and runs the collectives for real (all-gather, all-reduce). Worker functions
are module-level so spawned ranks can import them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modalmesh import distributed
from modalmesh.layers import (
    ColumnParallelLinear,
    GatedMLP,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

HIDDEN, HEADS, HEAD_DIM = 16, 4, 4


def _full_tensors():
    g = torch.Generator().manual_seed(1234)  # identical on every rank

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "x": r(3, 5, HIDDEN),
        "col_w": r(12, HIDDEN), "col_b": r(12),
        "q": r(HEADS * HEAD_DIM, HIDDEN), "k1": r(HEAD_DIM, HIDDEN), "v1": r(HEAD_DIM, HIDDEN),
        "qb": r(HEADS * HEAD_DIM), "kb1": r(HEAD_DIM), "vb1": r(HEAD_DIM),
        "o_w": r(HIDDEN, HEADS * HEAD_DIM), "o_b": r(HIDDEN),
        "gate": r(24, HIDDEN), "up": r(24, HIDDEN), "down": r(HIDDEN, 24),
        "table": r(11, HIDDEN), "ids": torch.randint(0, 11, (3, 5), generator=g),
    }


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {distributed.tp_rank()} {what}: {m}")


def _tp_layers_worker(rank: int, world_size: int) -> None:
    assert distributed.tp_rank() == rank and distributed.tp_size() == world_size == 2
    t = _full_tensors()
    x = t["x"]

    # Column-parallel with gathered output == the full linear.
    col = ColumnParallelLinear(HIDDEN, 12, bias=True, gather_output=True)
    assert col.weight.shape == (6, HIDDEN)
    col.weight.weight_loader(col.weight, t["col_w"])
    col.bias.weight_loader(col.bias, t["col_b"])
    _close(col(x), F.linear(x, t["col_w"], t["col_b"]), "column")

    # QKV with a single KV head, replicated on both ranks; then attention-shaped data through
    # a row-parallel O projection: the all-reduced result equals the TP=1 projection.
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, 1, bias=True)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_replicas) == (2, 1, 2)
    for sid, w, b in (("q", t["q"], t["qb"]), ("k", t["k1"], t["kb1"]), ("v", t["v1"], t["vb1"])):
        qkv.weight.weight_loader(qkv.weight, w, sid)
        qkv.bias.weight_loader(qkv.bias, b, sid)
    q, k, v = qkv.split(qkv(x))
    q_full = F.linear(x, t["q"], t["qb"])
    heads = slice(rank * 2 * HEAD_DIM, (rank + 1) * 2 * HEAD_DIM)
    _close(q, q_full[..., heads], "q heads")
    _close(k, F.linear(x, t["k1"], t["kb1"]), "replicated k")
    _close(v, F.linear(x, t["v1"], t["vb1"]), "replicated v")
    attn_out_full = q_full * 0.5  # stand-in for attention output: per-head, so it shards like q
    o = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=True)
    o.weight.weight_loader(o.weight, t["o_w"])
    o.bias.weight_loader(o.bias, t["o_b"])
    _close(o(q * 0.5), F.linear(attn_out_full, t["o_w"], t["o_b"]), "row-parallel o_proj")

    # SwiGLU MLP: merged column -> row, one all-reduce.
    mlp = GatedMLP(HIDDEN, 24, "silu")
    mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, t["gate"], 0)
    mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, t["up"], 1)
    mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, t["down"])
    ref = F.linear(F.silu(F.linear(x, t["gate"])) * F.linear(x, t["up"]), t["down"])
    _close(mlp(x), ref, "gated mlp")
    assert isinstance(mlp.gate_up_proj, MergedColumnParallelLinear)

    # Vocabulary-parallel embedding (11 rows over 2 ranks: uneven) and LM head.
    emb = VocabParallelEmbedding(11, HIDDEN)
    emb.weight.weight_loader(emb.weight, t["table"])
    _close(emb(t["ids"]), F.embedding(t["ids"], t["table"]), "embedding")
    head = ParallelLMHead(11, HIDDEN)
    head.tie_to(emb)
    _close(head(x), F.linear(x, t["table"]), "lm head")


def _llama_checkpoint_worker(rank: int, world_size: int, path: str) -> None:
    """A whole strict load of a real checkpoint at TP=2, compared with the HF modules."""
    from test_weights_loader import build_llama
    from transformers import LlamaForCausalLM

    from modalmesh.weights import QKV_GATE_UP, CheckpointReader, load_weights

    ref = LlamaForCausalLM.from_pretrained(path).eval()
    model, cfg = build_llama(path)
    load_weights(model, CheckpointReader(path), stacked=QKV_GATE_UP, metrics=False, progress=False)
    x = torch.randn(2, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    qw, kw = 2 * cfg.head_dim, cfg.head_dim  # per rank: 2 of 4 query heads, 1 of 2 KV heads
    with torch.no_grad():
        for mine, theirs in zip(model.model.layers, ref.model.layers):
            _close(mine.mlp(x), theirs.mlp(x), "llama mlp")
            q, k, _v = mine.self_attn.qkv_proj.split(mine.self_attn.qkv_proj(x))
            _close(q, theirs.self_attn.q_proj(x)[..., rank * qw:(rank + 1) * qw], "llama q")
            _close(k, theirs.self_attn.k_proj(x)[..., rank * kw:(rank + 1) * kw], "llama k")
            full_heads = theirs.self_attn.q_proj(x)
            _close(mine.self_attn.o_proj(full_heads[..., rank * qw:(rank + 1) * qw]),
                   theirs.self_attn.o_proj(full_heads), "llama o_proj")
        ids = torch.tensor([[1, 5, 95, 47]])
        _close(model.lm_head(model.model.embed_tokens(ids)), ref.lm_head(ref.model.embed_tokens(ids)), "llama logits")


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def test_tp2_layers_reproduce_tp1_outputs():
    distributed.launch(2, _tp_layers_worker, backend="gloo")


def test_tp2_strict_load_of_a_real_checkpoint(tmp_path):
    from test_weights_loader import save_tiny_llama

    save_tiny_llama(tmp_path)  # 4 heads of 8 dims, 2 KV heads, vocab 96
    distributed.launch(2, _llama_checkpoint_worker, str(tmp_path), backend="gloo")


def test_a_failing_rank_fails_the_launch():
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        distributed.launch(2, _failing_worker, backend="gloo")


def test_without_a_group_the_process_is_rank_0_of_1():
    assert (distributed.tp_rank(), distributed.tp_size()) == (0, 1)
    x = torch.ones(3)
    assert distributed.all_reduce(x) is x and distributed.all_gather(x) is x
