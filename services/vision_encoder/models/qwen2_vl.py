"""Qwen2-VL vision tower: native-resolution ViT with 2-D RoPE, packed attention, 2x2 patch merger.

Input: the rows of every image of a batch concatenated, ``(sum_i t_i*h_i*w_i, C*T*P*P)``
(merge blocks contiguous, as the image processor emits them), and each image's
``grid_thw``. Images are never stacked: each frame is one packed-attention
sequence (``cu_seqlens`` from the grids, built once per forward). Output: the
merged rows ``(sum_i t_i*h_i*w_i / merge^2, out_hidden)`` in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from modalmesh import distributed
from modalmesh.attention import Attention, VarlenMetadata
from modalmesh.config import ModelConfig
from modalmesh.layers import (
    MLP,
    ColumnParallelLinear,
    LayerNorm,
    QKVParallelLinear,
    RowParallelLinear,
    residual_norm,
)
from modalmesh.layers.linear import divide
from modalmesh.layers.mlp import get_activation
from modalmesh.models import CheckpointModel
from modalmesh.weights import QKV_GATE_UP, WeightsMapper
from services.vision_encoder.models.common import (
    ATTENTION_NAMES,
    PatchEmbed,
    VisionRotary2D,
    rotate_qk,
)

Grid = tuple[int, int, int]
COMPONENT = "vision_encoder"
NORM_EPS = 1e-6  # fixed in the architecture (not in the config)


@lru_cache(maxsize=256)
def grid_positions(t: int, h: int, w: int, merge: int) -> np.ndarray:
    """(t*h*w, 2) int64 (row, column) of each patch, in the processor's merge-block order."""
    rows = np.broadcast_to(np.arange(h)[:, None], (h, w))
    cols = np.broadcast_to(np.arange(w)[None, :], (h, w))
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    out = np.tile(np.stack([rows, cols], axis=-1), (t, 1)).astype(np.int64)
    out.flags.writeable = False
    return out


def batch_positions(grids: Sequence[Grid], merge: int, device) -> torch.Tensor:
    host = np.concatenate([grid_positions(*g, merge) for g in grids]) if grids else np.zeros((0, 2), np.int64)
    return torch.from_numpy(host).to(device, non_blocking=True)


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """One packed-attention sequence per frame: h*w patches, t times per image."""
    return [h * w for t, h, w in grids for _ in range(t)]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, *, dtype: torch.dtype | None = None, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.head_dim = dim // num_heads
        self.num_heads = divide(num_heads, distributed.tp_size(), "vision attention heads")
        self.qkv_proj = QKVParallelLinear(dim, self.head_dim, num_heads, bias=True)
        self.proj = RowParallelLinear(dim, dim, bias=True)
        self.attn = Attention(self.num_heads, self.head_dim, component=COMPONENT, layouts=("varlen",), dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_qk(q, k, cos, sin, self.fused)
        out = self.attn(q, k, v.contiguous(), meta)
        return self.proj(out.reshape(tokens, self.num_heads * self.head_dim))


class Qwen2VisionBlock(nn.Module):
    norm = LayerNorm

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, *, dtype=None, fused: bool = False):
        super().__init__()
        self.norm1 = self.norm(dim, NORM_EPS, fused=fused)
        self.norm2 = self.norm(dim, NORM_EPS, fused=fused)
        self.attn = VisionAttention(dim, num_heads, dtype=dtype, fused=fused)
        self.mlp = self.make_mlp(dim, mlp_hidden, act, fused)

    @staticmethod
    def make_mlp(dim: int, hidden: int, act: str, fused: bool) -> nn.Module:
        return MLP(dim, hidden, act, bias=True, names=("fc1", "fc2"), fused=fused)

    def forward(self, x, residual, cos, sin, meta):
        """(last sub-layer's output, residual stream) -> (this MLP's output, stream): `residual_norm`."""
        normed, residual = residual_norm(self.norm1, x, residual)
        normed, residual = self.norm2(self.attn(normed, cos, sin, meta), residual)
        return self.mlp(normed), residual


class PatchMerger(nn.Module):
    """norm -> concatenate each merge x merge block -> Linear, GELU, Linear into the LLM's width."""

    def __init__(self, out_dim: int, context_dim: int, merge: int, norm: type[nn.Module] = LayerNorm, *,
                 fused: bool = False):
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = norm(context_dim, NORM_EPS, fused=fused)
        self.fc1 = ColumnParallelLinear(self.hidden, self.hidden, bias=True)
        self.fc2 = RowParallelLinear(self.hidden, out_dim, bias=True)
        self.act = get_activation("gelu")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Of the blocks' last output and residual stream (`residual_norm`)."""
        return self.fc2(self.act(self.fc1(residual_norm(self.ln_q, x, residual)[0].view(-1, self.hidden))))


class Qwen2VisionTransformer(nn.Module, CheckpointModel):
    """``visual.*`` of Qwen2VLForConditionalGeneration."""

    architectures = ("Qwen2VLForConditionalGeneration", "Qwen2VLModel")
    model_types = ("qwen2_vl",)
    processor_kind = "qwen2_vl"
    # Hub (transformers 4) layout visual.*, transformers 5 model.visual.*; only these tensors are opened.
    checkpoint_prefixes = ("visual.", "model.visual.")
    weights_mapper = WeightsMapper(
        prefix={"model.visual.": "", "visual.": ""},
        substr={"patch_embed.proj.": "patch_embed.", "merger.mlp.0.": "merger.fc1.", "merger.mlp.2.": "merger.fc2."},
    ) | ATTENTION_NAMES
    stacked_params = QKV_GATE_UP

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype | None = None, fused_kernels: bool = True):
        super().__init__()
        self.cfg = cfg
        self.fused_kernels = fused_kernels  # on CUDA (modalmesh.kernels): rotary, add + norm, the MLP's activation
        self.dim = cfg.hidden_size  # embed_dim
        self.num_heads = cfg.num_heads
        self.head_dim = self.dim // self.num_heads
        self.patch_size = int(cfg.get("patch_size", 14))
        self.temporal_patch_size = int(cfg.get("temporal_patch_size", 2))
        self.in_channels = int(cfg.get("in_channels", cfg.get("in_chans", 3)))
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.out_hidden_size = self._out_hidden(cfg)
        self.dtype = dtype
        patch_dim = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        self.patch_embed = PatchEmbed(patch_dim, self.dim, bias=False)
        self.rotary = VisionRotary2D(self.head_dim, cfg.rope.theta)
        self.blocks = nn.ModuleList([self._block(cfg, dtype) for _ in range(cfg.num_layers)])
        self.merger = self._merger()

    @staticmethod
    def _out_hidden(cfg: ModelConfig) -> int:
        return int(cfg.get("hidden_size"))  # Qwen2-VL: vision_config.hidden_size is the LLM's width

    def _block(self, cfg: ModelConfig, dtype) -> nn.Module:
        mlp_hidden = int(self.dim * float(cfg.get("mlp_ratio", 4)))
        return Qwen2VisionBlock(self.dim, self.num_heads, mlp_hidden, cfg.hidden_act or "quick_gelu", dtype=dtype,
                                fused=self.fused_kernels)

    def _merger(self) -> nn.Module:
        return PatchMerger(self.out_hidden_size, self.dim, self.merge, fused=self.fused_kernels)

    @property
    def patch_dim(self) -> int:
        return self.patch_embed.input_size

    def merged_rows(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        cos, sin = self.rotary(batch_positions(grids, self.merge, device))
        meta = VarlenMetadata.from_seqlens(frame_lengths(grids), device)
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, cos, sin, meta)
        return self.merger(x, residual)
