"""Normalisation layers with replicated parameters (same on every TP rank).

RMSNorm follows the Llama/Qwen reference exactly: statistics in float32, the
normalised activations cast back to the input dtype before the weight scales
them. ``forward(x, residual)`` fuses the residual add that precedes every
pre-norm in a decoder layer and returns the new residual as well. Built with
``fused=True``, it runs as one Triton kernel on CUDA (`modalmesh.kernels.norm`).
LayerNorm has the same ``forward(x, residual)`` for the pre-LN towers, and with
``fused=True`` the same one kernel (`modalmesh.kernels.layer_norm`).

GroupNorm is nn.GroupNorm (same parameters, so checkpoints load by the same names)
with the SiLU that follows it in a VAE's resnet blocks folded in (``silu=True``);
``fused=True`` runs both as `modalmesh.kernels.group_norm` on CUDA, in NCHW or
channels-last; ``forward(x, pre_bias)`` also adds a per-channel bias first (the bias of
the convolution before it, which that convolution then leaves out), and ``forward(x, moments=)``
takes x's statistics from the kernel that wrote x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modalmesh import kernels
from modalmesh.kernels import group_norm as group_norm_kernels
from modalmesh.kernels import layer_norm as layer_norm_kernels
from modalmesh.kernels import norm as norm_kernels
from modalmesh.weights.param import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype | None = None,
                 fused: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and kernels.usable(x) and norm_kernels.fusable(x, residual):
            return norm_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + (", fused" if self.fused else "")


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, fused: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype), requires_grad=False)
            set_weight_loader(self.bias, default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and kernels.usable(x) and layer_norm_kernels.fusable(x, residual, self.weight, self.bias):
            return layer_norm_kernels.layer_norm(x, self.weight, self.bias, self.eps, residual)
        if residual is not None:
            x = x + residual
            return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps), x
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}" + (", fused" if self.fused else "")


def residual_norm(norm: RMSNorm | LayerNorm, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's step on the residual stream: (norm(x + residual), x + residual), where `x` is the
    last sub-layer's output, or (norm(x), x) at the stream's start (`residual` None). Carrying the stream
    this way puts every residual add inside the next norm's kernel."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class GroupNorm(nn.GroupNorm):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, *, silu: bool = False,
                 fused: bool = False):
        super().__init__(num_groups, num_channels, eps=eps)
        self.silu = silu
        self.fused = fused

    def forward(self, x: torch.Tensor, pre_bias: torch.Tensor | None = None,
                moments: group_norm_kernels.Moments | None = None) -> torch.Tensor:
        """GroupNorm(+SiLU) of x, or of x + `pre_bias` per channel (a convolution's bias that its conv left
        out, so the add rides this pass instead of a pass of its own). `moments`: x's statistics, taken by the
        kernel that wrote x (`group_norm_kernels.add_with_moments`); the PyTorch path has no use for them."""
        if self.fused and kernels.usable(x) and group_norm_kernels.fusable(x, self.num_groups, self.weight,
                                                                           self.bias, pre_bias):
            return group_norm_kernels.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, silu=self.silu,
                                                 pre_bias=pre_bias, moments=moments)
        if pre_bias is not None:
            x = x + pre_bias.to(x.dtype).view(-1, *[1] * (x.dim() - 2))
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y

    def extra_repr(self) -> str:
        return super().extra_repr() + (", silu" if self.silu else "") + (", fused" if self.fused else "")
