"""Shared nn building blocks: TP linears, vocab-parallel embedding, norms (RMS, layer, group), MLPs.

Rotary embeddings and attention live in `modalmesh.attention` / their own modules.
"""

from modalmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from modalmesh.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from modalmesh.layers.mlp import MLP, GatedMLP, get_activation
from modalmesh.layers.norm import GroupNorm, LayerNorm, RMSNorm, residual_norm

__all__ = [
    "ColumnParallelLinear", "GatedMLP", "GroupNorm", "LayerNorm", "LinearBase", "MLP", "MergedColumnParallelLinear",
    "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "get_activation", "residual_norm",
]
