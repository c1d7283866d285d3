"""What every language model of the LLM service is: the interface the engine calls.

    model = load_llm(dir, device="cuda", dtype=torch.bfloat16)[0]
    x = model.embed(ids)                       # (T,) -> (T, H); the engine splices encoder rows in
    h = model(positions, meta, kv_caches, inputs_embeds=x)   # (T, H), final norm applied
    logits = model.compute_logits(h[last_rows])              # (N, vocab) float32

T is the sum of the new tokens of every sequence in the batch (packed, no
padding); `meta` (PagedMetadata) says which tokens belong to which sequence and
where their k/v go in the pool; ``kv_caches[i]`` is the pool's ``.layer(i)``.
Positions are (T,), or (3, T) for M-RoPE models (a (T,) tensor is accepted there
too: text-only tokens have equal positions on the three axes).

A family declares, as class data (modalmesh.models.CheckpointModel), which HF
architectures it serves, which checkpoint tensors it reads (`checkpoint_prefixes`:
vision/audio towers are never opened) and how names map (`weights_mapper`,
`stacked_params`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from modalmesh.attention import AttentionSelector, PagedMetadata
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.layers.rotary import RotaryEmbedding
from modalmesh.models import CheckpointModel
from modalmesh.weights import LEGACY_BUFFERS, QKV_GATE_UP, StackedMapping, WeightsMapper

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class CausalLM(nn.Module, CheckpointModel):
    uses_mrope: ClassVar[bool] = False
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("model.", "lm_head.")
    weights_mapper: ClassVar[WeightsMapper] = LEGACY_BUFFERS
    stacked_params: ClassVar[StackedMapping] = QKV_GATE_UP

    def __init__(self, cfg: ModelConfig, *, selector: AttentionSelector, dtype: torch.dtype | None = None,
                 page_size: int = 16, fused_kernels: bool = False):
        super().__init__()
        self.cfg = cfg
        self.fused_kernels = fused_kernels  # the layers' Triton kernels on CUDA (modalmesh.kernels)
        self.dtype = dtype or torch.get_default_dtype()
        self.page_size = page_size
        # Handed in by whoever builds the model (each TP rank builds its own from the config): every
        # attention layer selects through it, never through a process-wide selector.
        self.selector = selector

    # ---- what a family provides -------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- shared helpers ---------------------------------------------------------------------
    def _rotary(self) -> RotaryEmbedding:
        """One rotary table per model, built on the CPU (never on meta) and moved with the model."""
        rope = self.cfg.rope
        if self.uses_mrope and not rope.mrope_section:
            raise ConfigError(f"{type(self).__name__} rotates with M-RoPE but the config has no mrope_section")
        params = {"rope_type": "default" if rope.type == "mrope" else rope.type, "rope_theta": rope.theta,
                  "factor": rope.factor, "original_max_position_embeddings": rope.original_max_position_embeddings,
                  **dict(rope.params)}
        with torch.device("cpu"):
            return RotaryEmbedding(self.cfg.head_dim, rope.rotary_dim, self.cfg.max_position_embeddings or 4096,
                                   params, mrope_section=rope.mrope_section if self.uses_mrope else None)

    def _inputs(self, positions: torch.Tensor, meta: PagedMetadata, kv_caches: KVCaches,
                input_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a forward call; returns (hidden (T, H), positions (T,) or (3, T))."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        tokens = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"inputs_embeds must be (T, {self.cfg.hidden_size}), got {tuple(hidden.shape)}")
        if self.uses_mrope and positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        want = (3, tokens) if self.uses_mrope else (tokens,)
        if tuple(positions.shape) != want:
            raise ValueError(f"positions must be {want} for {type(self).__name__}, got {tuple(positions.shape)}")
        if len(kv_caches) != self.cfg.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.cfg.num_layers} layers")
        if meta.slot_mapping.shape[0] != tokens:
            raise ValueError(f"{tokens} tokens but the metadata holds {meta.slot_mapping.shape[0]} slots")
        return hidden.to(self.lm_head.weight.dtype), positions
