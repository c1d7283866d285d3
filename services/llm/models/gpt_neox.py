"""GPT-NeoX / Pythia: LayerNorm, partial rotary, fused per-head q|k|v, parallel or sequential residual.

    parallel:    h = x + attn(ln1(x)) + mlp(ln2(x))
    sequential:  a = x + attn(ln1(x));  h = a + mlp(ln2(a))

``query_key_value`` is laid out (heads, 3, head_dim) along its rows; it loads into
a QKVParallelLinear through the "qkv_per_head" shard id. Checkpoint names are the
HF ones under ``gpt_neox.``/``embed_out.`` (rewritten to ``model.``/``lm_head.``);
the causal-mask buffers older checkpoints persisted (``.attention.bias``,
``.attention.masked_bias``) and ``rotary_emb.inv_freq`` are dropped by rule.
"""

from __future__ import annotations

import torch
from torch import nn

from modalmesh.attention import Attention, AttentionSelector, PagedMetadata
from modalmesh.config import ModelConfig
from modalmesh.layers import (
    MLP,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from modalmesh.layers.rotary import RotaryEmbedding
from modalmesh.weights import LEGACY_BUFFERS, StackedMapping, WeightsMapper
from services.llm.models.base import CausalLM, KVCaches


class NeoXAttention(nn.Module):
    def __init__(self, lm: GPTNeoXForCausalLM):
        super().__init__()
        cfg = lm.cfg
        bias = bool(cfg.get("attention_bias", True))
        self.head_dim = cfg.head_dim
        self.query_key_value = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, bias=bias)
        self.dense = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.attn = Attention(self.query_key_value.num_heads, cfg.head_dim, component="llm", causal=True,
                              layouts=("paged",), page_size=lm.page_size, dtype=lm.dtype, selector=lm.selector)

    def forward(self, positions, x, meta, kv_cache, rotary: RotaryEmbedding) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = (t.view(tokens, -1, self.head_dim) for t in self.query_key_value.split(self.query_key_value(x)))
        q, k = rotary(positions, q, k)
        return self.dense(self.attn(q, k, v, meta, kv_cache=kv_cache).reshape(tokens, -1))


class NeoXLayer(nn.Module):
    def __init__(self, lm: GPTNeoXForCausalLM):
        super().__init__()
        cfg = lm.cfg
        self.parallel_residual = bool(cfg.get("use_parallel_residual", True))
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = NeoXAttention(lm)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act or "gelu", bias=True,
                       names=("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, positions, x, meta, kv_cache, rotary) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(x), meta, kv_cache, rotary)
        if self.parallel_residual:
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        attn = attn + x
        return self.mlp(self.post_attention_layernorm(attn)) + attn


class NeoXModel(nn.Module):
    def __init__(self, lm: GPTNeoXForCausalLM):
        super().__init__()
        cfg = lm.cfg
        self.embed_in = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NeoXLayer(lm) for _ in range(cfg.num_layers))
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary_emb = lm._rotary()


class GPTNeoXForCausalLM(CausalLM):
    architectures = ("GPTNeoXForCausalLM",)
    model_types = ("gpt_neox",)
    checkpoint_prefixes = ("gpt_neox.", "embed_out.")
    weights_mapper = WeightsMapper(prefix={"gpt_neox.": "model.", "embed_out.": "lm_head."}) | LEGACY_BUFFERS
    stacked_params = StackedMapping([("query_key_value", "query_key_value", "qkv_per_head")])

    def __init__(self, cfg: ModelConfig, *, selector: AttentionSelector, dtype: torch.dtype | None = None,
                 page_size: int = 16, fused_kernels: bool = False):  # LayerNorm, GELU: nothing fused
        super().__init__(cfg, selector=selector, dtype=dtype, page_size=page_size, fused_kernels=fused_kernels)
        self.model = NeoXModel(self)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_in)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_in(input_ids)

    def forward(self, positions: torch.Tensor, meta: PagedMetadata, kv_caches: KVCaches,
                input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden, positions = self._inputs(positions, meta, kv_caches, input_ids, inputs_embeds)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, meta, kv_cache, self.model.rotary_emb)
        return self.model.final_layer_norm(hidden)
