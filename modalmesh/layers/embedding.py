"""Token embedding and LM head, sharded over the vocabulary.

Each rank holds ``ceil(vocab / tp)`` rows; the last rank's tail past the real
vocabulary is zero. The embedding looks up the ids it owns and all-reduces;
the LM head computes its slice of the logits and all-gathers them.
`ParallelLMHead.tie_to(embedding)` shares the embedding's parameter (same
sharding), which is how tied checkpoints (no ``lm_head.weight``) load strictly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modalmesh import distributed
from modalmesh.weights.param import copy_into, narrow_checked, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int | None = None,
                 tp_size: int | None = None, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp_rank = distributed.tp_rank() if tp_rank is None else tp_rank
        self.tp_size = distributed.tp_size() if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = min(num_embeddings, self.tp_rank * self.rows_per_rank)
        self.vocab_end = min(num_embeddings, self.vocab_start + self.rows_per_rank)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=params_dtype),
                                   requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"shard id {shard_id!r} given for a vocabulary-parallel parameter")
        n = self.vocab_end - self.vocab_start
        copy_into(param.narrow(0, 0, n),
                  narrow_checked(loaded, 0, self.num_embeddings, self.vocab_start, n, "vocab-parallel", param))
        with torch.no_grad():
            param.narrow(0, n, param.shape[0] - n).zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        owned = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(owned, ids - self.vocab_start, torch.zeros_like(ids))
        y = F.embedding(local, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return distributed.all_reduce(y)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}:{self.vocab_end}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, **kw):
        super().__init__(num_embeddings, embedding_dim, **kw)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.rows_per_rank, dtype=self.weight.dtype), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_size) != (
                self.num_embeddings, self.embedding_dim, self.tp_size):
            raise ValueError("cannot tie an LM head to an embedding of a different shape or sharding")
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight, self.bias)
        if self.tp_size == 1:
            return logits
        return distributed.all_gather(logits, dim=-1)[..., : self.num_embeddings]
