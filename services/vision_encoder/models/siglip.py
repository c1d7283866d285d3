"""SigLIP vision model (fixed resolution): the image encoder of SigLIP and of many VLMs.

Input ``(B, C, H, W)`` at the configured ``image_size`` (every image the same size,
so a batch is dense). Outputs, by ``output``:

* ``"patch"`` (default): ``last_hidden_state`` after ``post_layernorm``,
  ``(B, num_patches, hidden)`` - what VLMs splice (one row per patch);
* ``"pooled"``: the attention-pooling head's output, ``(B, 1, hidden)``;
* ``"both"``: the patch rows followed by the pooled row, ``(B, num_patches + 1, hidden)``.
"""

from __future__ import annotations

import torch
from torch import nn

from modalmesh import distributed
from modalmesh.attention import Attention
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.layers import MLP, LayerNorm, QKVParallelLinear, RowParallelLinear, residual_norm
from modalmesh.layers.linear import divide
from modalmesh.models import CheckpointModel
from modalmesh.weights import QKV_GATE_UP, WeightsMapper
from modalmesh.weights.param import default_weight_loader, set_weight_loader
from services.vision_encoder.models.common import ATTENTION_NAMES, PatchEmbed

COMPONENT = "vision_encoder"
from services.vision_encoder.flags import SIGLIP_OUTPUTS as OUTPUTS  # noqa: E402 - --siglip-output's choices
# The encoder MLPs' width rounded up to a multiple of this, with zero weights (the same result): so400m's 4,304 as
# 4,352, whose fc1 + GELU and fc2 ran at 583 and 679 TFLOP/s on an H100, padded at 647 and 724 (`bench/gemm.py`)
MLP_PAD_TO = 128


class SiglipAttention(nn.Module):
    """Dense self-attention, or cross-attention from `query` rows when given (the pooling head)."""

    def __init__(self, dim: int, num_heads: int, *, dtype=None, seqlen_hint: int | None = None):
        super().__init__()
        self.head_dim = dim // num_heads
        self.num_heads = divide(num_heads, distributed.tp_size(), "vision attention heads")
        self.qkv_proj = QKVParallelLinear(dim, self.head_dim, num_heads, bias=True)
        self.proj = RowParallelLinear(dim, dim, bias=True)
        self.attn = Attention(self.num_heads, self.head_dim, component=COMPONENT, dtype=dtype,
                              seqlen_hint=seqlen_hint)

    def forward(self, x: torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
        if query is not None:
            q = self.qkv_proj(query).view(*query.shape[:2], 3, self.num_heads, self.head_dim)[:, :, 0]
        # Strided views of the qkv output: the attention backends take (B, S, H, D) with unit-stride heads, and
        # three copies per layer were 11 % of SigLIP-so400m's kernel time (H100, 2026-12-05)
        out = self.attn(q, k, v)
        return self.proj(out.reshape(*out.shape[:2], -1))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=None, seqlen_hint=None, fused: bool = False,
                 mlp_pad_to: int = MLP_PAD_TO):
        super().__init__()
        dim = cfg.hidden_size
        self.layer_norm1 = LayerNorm(dim, cfg.norm_eps, fused=fused)
        self.self_attn = SiglipAttention(dim, cfg.num_heads, dtype=dtype, seqlen_hint=seqlen_hint)
        self.layer_norm2 = LayerNorm(dim, cfg.norm_eps, fused=fused)
        self.mlp = MLP(dim, cfg.intermediate_size, cfg.hidden_act or "gelu_pytorch_tanh", bias=True, fused=fused,
                       pad_to=mlp_pad_to)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(last sub-layer's output, residual stream) -> (this MLP's output, stream): `residual_norm`."""
        normed, residual = residual_norm(self.layer_norm1, x, residual)
        normed, residual = self.layer_norm2(self.self_attn(normed), residual)
        return self.mlp(normed), residual


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=None, seqlen_hint=None, fused: bool = False,
                 mlp_pad_to: int = MLP_PAD_TO):
        super().__init__()
        self.layers = nn.ModuleList([SiglipEncoderLayer(cfg, dtype=dtype, seqlen_hint=seqlen_hint, fused=fused,
                                                        mlp_pad_to=mlp_pad_to) for _ in range(cfg.num_layers)])

    def forward(self, x: torch.Tensor, final_norm: LayerNorm) -> torch.Tensor:
        """final_norm(the last layer's residual stream): the stream's last add rides that norm."""
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return residual_norm(final_norm, x, residual)[0]


class PositionEmbedding(nn.Module):
    def __init__(self, num_positions: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions, dim), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, channels: int, patch: int, num_positions: int):
        super().__init__()
        self.patch = patch
        self.patch_embedding = PatchEmbed(channels * patch * patch, cfg.hidden_size, bias=True)
        self.position_embedding = PositionEmbedding(num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixel_values.shape
        p = self.patch
        gh, gw = h // p, w // p  # a "valid" conv drops the pixels past the last whole patch
        patches = pixel_values[:, :, : gh * p, : gw * p].reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, gh * gw, c * p * p)
        return self.patch_embedding(patches) + self.position_embedding.weight


class SiglipPoolingHead(nn.Module):
    """Multi-head attention pooling: a learned probe attends over the patches, then LayerNorm + MLP."""

    def __init__(self, cfg: ModelConfig, *, dtype=None, seqlen_hint=None, fused: bool = False):
        super().__init__()
        dim = cfg.hidden_size
        self.probe = nn.Parameter(torch.empty(1, 1, dim), requires_grad=False)
        set_weight_loader(self.probe, default_weight_loader)
        self.attention = SiglipAttention(dim, cfg.num_heads, dtype=dtype, seqlen_hint=seqlen_hint)
        self.layernorm = LayerNorm(dim, cfg.norm_eps, fused=fused)
        self.mlp = MLP(dim, cfg.intermediate_size, cfg.hidden_act or "gelu_pytorch_tanh", bias=True, fused=fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(x, query=self.probe.expand(x.shape[0], -1, -1))
        return h + self.mlp(self.layernorm(h))  # (B, 1, dim)


class SiglipVisionTower(nn.Module, CheckpointModel):
    """``SiglipVisionModel`` (transformers 5 layout at the top level; ``vision_model.*`` in SigLIP /
    hub checkpoints; ``vision_tower.vision_model.*`` in PaliGemma-style VLMs)."""

    architectures = ("SiglipVisionModel", "SiglipModel")
    model_types = ("siglip", "siglip_vision_model")
    processor_kind = "fixed"
    checkpoint_prefixes = ("embeddings.", "encoder.", "post_layernorm.", "head.", "vision_model.",
                           "vision_tower.vision_model.", "model.vision_tower.vision_model.")
    weights_mapper = WeightsMapper(
        prefix={"model.vision_tower.vision_model.": "", "vision_tower.vision_model.": "", "vision_model.": ""},
        skip_suffixes=("position_ids",),
    ) | ATTENTION_NAMES
    stacked_params = QKV_GATE_UP

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype | None = None, output: str = "patch",
                 fused_kernels: bool = True, mlp_pad_to: int = MLP_PAD_TO):
        super().__init__()
        if output not in OUTPUTS:
            raise ConfigError(f"SigLIP output {output!r}: expected one of {', '.join(OUTPUTS)}")
        self.cfg = cfg
        self.output = output
        # On CUDA: residual add + LayerNorm as one Triton kernel, the tanh GELU in the fc1 GEMM's epilogue
        self.fused_kernels = fused_kernels
        self.image_size = int(cfg.get("image_size", 224))
        self.patch_size = int(cfg.get("patch_size", 16))
        self.in_channels = int(cfg.get("num_channels", 3))
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.hidden_size = self.out_hidden_size = cfg.hidden_size
        self.embeddings = SiglipEmbeddings(cfg, self.in_channels, self.patch_size, self.num_patches)
        self.encoder = SiglipEncoder(cfg, dtype=dtype, seqlen_hint=self.num_patches, fused=fused_kernels,
                                     mlp_pad_to=mlp_pad_to)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps, fused=fused_kernels)
        has_head = bool(cfg.get("vision_use_head", True))
        if output != "patch" and not has_head:
            raise ConfigError(f"SigLIP output {output!r} needs the pooling head; this checkpoint has "
                              "vision_use_head = false")
        if output != "patch":
            self.head = SiglipPoolingHead(cfg, dtype=dtype, seqlen_hint=self.num_patches, fused=fused_kernels)
        elif has_head:  # patch rows only: the head's tensors are not needed, by rule
            self.weights_mapper = type(self).weights_mapper | WeightsMapper(skip_prefixes=("head.",))

    @property
    def rows_per_image(self) -> int:
        return {"patch": self.num_patches, "pooled": 1, "both": self.num_patches + 1}[self.output]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, rows_per_image, hidden)."""
        x = self.embeddings(pixel_values.to(self.embeddings.patch_embedding.weight.dtype))
        x = self.encoder(x, self.post_layernorm)
        if self.output == "patch":
            return x
        pooled = self.head(x)
        return pooled if self.output == "pooled" else torch.cat((x, pooled), dim=1)
