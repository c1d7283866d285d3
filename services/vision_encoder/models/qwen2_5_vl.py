"""Qwen2.5-VL vision tower: the Qwen2-VL tower with RMSNorm, SwiGLU and window attention.

Patches are reordered so each attention window (``window_size`` pixels square, in
merged-patch units) is contiguous; layers in ``fullatt_block_indexes`` attend over
the whole frame, the others over their window. Both are packed varlen batches
(frames and windows of every image concatenated), so one `VarlenMetadata` per kind
serves all layers. After the merger the inverse permutation restores raster order.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from modalmesh.attention import VarlenMetadata
from modalmesh.config import ModelConfig
from modalmesh.layers import GatedMLP, RMSNorm
from services.vision_encoder.models.qwen2_vl import (
    Grid,
    PatchMerger,
    Qwen2VisionBlock,
    Qwen2VisionTransformer,
    batch_positions,
    frame_lengths,
)


@lru_cache(maxsize=256)
def grid_windows(t: int, h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """For one image: the order of its merged patches grouped by window, and each window's patch count.

    `window` is the window side in merged patches. Empty windows are dropped.
    """
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    pad_h, pad_w = -gh % window, -gw % window
    padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
    nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
    padded = padded.reshape(t, nh, window, nw, window).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
    valid = padded >= 0
    order = padded[valid]
    lengths = tuple(int(n) * merge * merge for n in valid.sum(axis=1) if n)
    order.flags.writeable = False
    return order, lengths


def batch_windows(grids: Sequence[Grid], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    orders, lengths, offset = [], [], 0
    for t, h, w in grids:
        order, lens = grid_windows(t, h, w, merge, window)
        orders.append(order + offset)
        lengths.extend(lens)
        offset += t * (h // merge) * (w // merge)
    return np.concatenate(orders), lengths


class Qwen2_5VisionBlock(Qwen2VisionBlock):
    norm = RMSNorm

    @staticmethod
    def make_mlp(dim: int, hidden: int, act: str, fused: bool) -> nn.Module:
        return GatedMLP(dim, hidden, act, bias=True, fused=fused)


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    """``visual.*`` of Qwen2_5_VLForConditionalGeneration."""

    architectures = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel")
    model_types = ("qwen2_5_vl",)

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype | None = None, fused_kernels: bool = True):
        super().__init__(cfg, dtype=dtype, fused_kernels=fused_kernels)
        self.full_attention_layers = frozenset(int(i) for i in cfg.get("fullatt_block_indexes") or ())
        window_size = int(cfg.get("window_size", 112))
        self.window = window_size // self.merge // self.patch_size  # in merged patches
        if self.window <= 0:
            raise ValueError(f"window_size {window_size} is smaller than one merged patch")

    @staticmethod
    def _out_hidden(cfg: ModelConfig) -> int:
        return int(cfg.get("out_hidden_size"))

    def _block(self, cfg: ModelConfig, dtype) -> nn.Module:
        return Qwen2_5VisionBlock(self.dim, self.num_heads, cfg.intermediate_size, cfg.hidden_act or "silu",
                                  dtype=dtype, fused=self.fused_kernels)

    def _merger(self) -> nn.Module:
        return PatchMerger(self.out_hidden_size, self.dim, self.merge, norm=RMSNorm, fused=self.fused_kernels)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        device = pixel_values.device
        unit = self.merge * self.merge
        order, window_lengths = batch_windows(grids, self.merge, self.window)
        order_t = torch.from_numpy(order).to(device, non_blocking=True)
        inverse = torch.from_numpy(np.argsort(order, kind="stable")).to(device, non_blocking=True)

        def by_window(t: torch.Tensor) -> torch.Tensor:  # permute merge blocks into window order
            return t.view(-1, unit, *t.shape[1:])[order_t].flatten(0, 1)

        x = by_window(self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)))
        cos, sin = (by_window(c) for c in self.rotary(batch_positions(grids, self.merge, device)))
        full = VarlenMetadata.from_seqlens(frame_lengths(grids), device)
        windowed = VarlenMetadata.from_seqlens(window_lengths, device)
        residual = None
        for i, block in enumerate(self.blocks):
            x, residual = block(x, residual, cos, sin, full if i in self.full_attention_layers else windowed)
        return self.merger(x, residual)[inverse]
