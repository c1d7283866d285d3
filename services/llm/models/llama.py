"""Llama, Qwen2 / Qwen2.5 and Qwen3: one pre-norm decoder, families differ by switches.

    RMSNorm -> q|k|v (GQA, optional bias) -> [Qwen3: per-head RMSNorm of q, k] -> RoPE
    -> paged attention -> o_proj -> +residual -> RMSNorm -> SwiGLU -> +residual

Switches are class data: a bool, or the name of a config key (default False).
RoPE scaling (linear, llama3, yarn) and partial rotary come from `cfg.rope`;
Qwen2 sliding-window layers (``cfg.layer_types``) attend over the last
``sliding_window`` tokens. Checkpoint names match the module tree except the
fused q|k|v and gate|up projections (`QKV_GATE_UP`). With ``fused_kernels``,
on CUDA, residual add + RMSNorm, RoPE + KV write and SiLU * up each run as one
Triton kernel (`modalmesh.kernels`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from modalmesh.attention import Attention, AttentionSelector, PagedMetadata
from modalmesh.config import ModelConfig
from modalmesh.layers import (
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from modalmesh.layers.rotary import RotaryEmbedding
from services.llm.models.base import CausalLM, KVCaches


class DecoderAttention(nn.Module):
    def __init__(self, lm: LlamaForCausalLM, layer: int):
        super().__init__()
        cfg = lm.cfg
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=lm.flag(lm.qkv_bias))
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=lm.flag(lm.o_bias))
        if lm.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, fused=lm.fused_kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, fused=lm.fused_kernels)
        self.fused = lm.fused_kernels
        window = (cfg.sliding_window - 1, 0) if cfg.layer_is_sliding(layer) else None
        self.attn = Attention(self.qkv_proj.num_heads, cfg.head_dim, num_kv_heads=self.qkv_proj.num_kv_heads,
                              component="llm", causal=True, window=window, layouts=("paged",),
                              page_size=lm.page_size, dtype=lm.dtype, selector=lm.selector)

    def forward(self, positions, x, meta, kv_cache, rotary: RotaryEmbedding) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = (t.view(tokens, -1, self.head_dim) for t in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused and rotary.can_fuse(positions, q):
            q = rotary.rotate_and_store(positions, q, k, v, kv_cache, meta.slot_mapping)
            out = self.attn(q, k, v, meta, kv_cache=kv_cache, kv_written=True)
        else:
            q, k = rotary(positions, q, k)
            out = self.attn(q, k, v, meta, kv_cache=kv_cache)
        return self.o_proj(out.reshape(tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, lm: LlamaForCausalLM, layer: int):
        super().__init__()
        cfg = lm.cfg
        fused = lm.fused_kernels
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, fused=fused)
        self.self_attn = DecoderAttention(lm, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, fused=fused)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act or "silu", bias=lm.flag(lm.mlp_bias),
                            fused=fused)

    def forward(self, positions, hidden, residual, meta, kv_cache, rotary):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_cache, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, lm: LlamaForCausalLM):
        super().__init__()
        cfg = lm.cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(lm, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, fused=lm.fused_kernels)
        self.rotary_emb = lm._rotary()


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    qkv_bias: ClassVar[bool | str] = "attention_bias"
    o_bias: ClassVar[bool | str] = "attention_bias"
    mlp_bias: ClassVar[bool | str] = "mlp_bias"
    qk_norm: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig, *, selector: AttentionSelector, dtype: torch.dtype | None = None,
                 page_size: int = 16, fused_kernels: bool = False):
        super().__init__(cfg, selector=selector, dtype=dtype, page_size=page_size, fused_kernels=fused_kernels)
        self.model = DecoderModel(self)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def flag(self, switch: bool | str) -> bool:
        return bool(self.cfg.get(switch, False)) if isinstance(switch, str) else switch

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, positions: torch.Tensor, meta: PagedMetadata, kv_caches: KVCaches,
                input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden, positions = self._inputs(positions, meta, kv_caches, input_ids, inputs_embeds)
        residual = None
        rotary = self.model.rotary_emb
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache, rotary)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return self.model.norm(hidden, residual)[0]


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    qkv_bias = True
    o_bias = False
    mlp_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    mlp_bias = False
    qk_norm = True
