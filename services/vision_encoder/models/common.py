"""Pieces the vision towers share: patch embedding as a linear layer, 2-D rotary, checkpoint rules.

A Conv3d / Conv2d whose stride equals its kernel is a matmul over flattened
patches; the checkpoint's 5-D / 4-D kernel is flattened by the parameter's
weight loader, so no model needs a convolution (faster on GPUs, and the packed
rows of native-resolution towers are already flattened patches).
"""

from __future__ import annotations

import torch
from torch import nn

from modalmesh import kernels
from modalmesh.kernels import rotary as rotary_kernels
from modalmesh.layers import ReplicatedLinear
from modalmesh.layers.rotary import rotate_half
from modalmesh.weights import WeightsMapper
from modalmesh.weights.param import default_weight_loader

# Spellings of the fused qkv and the output projection across checkpoints.
ATTENTION_NAMES = WeightsMapper(
    substr={".attn.qkv.": ".attn.qkv_proj.", ".attn.out_proj.": ".attn.proj.",
            ".self_attn.out_proj.": ".self_attn.proj.", ".attention.out_proj.": ".attention.proj."},
    suffix={".attention.in_proj_weight": ".attention.qkv_proj.weight",
            ".attention.in_proj_bias": ".attention.qkv_proj.bias"},
)


class PatchEmbed(ReplicatedLinear):
    """Conv with stride == kernel over flattened patches: (N, C*k...) -> (N, out). Loads conv kernels."""

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2 and loaded.dim() > 2:  # (out, C, [T,] P, P) conv kernel -> (out, C*[T*]P*P)
            loaded = loaded.reshape(loaded.shape[0], -1)
        default_weight_loader(param, loaded, shard_id)


class VisionRotary2D(nn.Module):
    """Axial 2-D RoPE of the Qwen2-VL towers: head_dim/4 frequencies for rows, the same for columns.

    cos/sin are (T, head_dim) float32: [h-angles | w-angles] twice, rotating the whole head
    (rotate_half layout). Computed once per forward and shared by every layer.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D rotary needs head_dim divisible by 4, got {head_dim}")
        self.head_dim, self.theta = head_dim, float(theta)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T, 2) int (row, column) -> cos, sin (T, head_dim) float32."""
        spatial = self.head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=positions.device)
                                         / spatial))
        freqs = positions[..., None].float() * inv_freq  # (T, 2, head_dim/4)
        freqs = freqs.flatten(1)  # (T, head_dim/2): h then w
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated in float32 by cos/sin (T, D), returned in x's dtype."""
    xf = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` of q and k; with `fused`, one Triton kernel on CUDA (modalmesh.kernels.rotary)."""
    if fused and kernels.usable(q) and rotary_kernels.qk_fusable(q, k, cos, sin):
        return rotary_kernels.rotate_qk(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
