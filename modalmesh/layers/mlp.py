"""Feed-forward blocks built on the TP linears: one all-reduce per block.

GatedMLP is SwiGLU (Llama, Qwen) or GeGLU by activation name: ``gate_up_proj``
(column-parallel, gate|up fused) -> act(gate) * up -> ``down_proj``
(row-parallel); built with ``fused=True``, SiLU * up is one Triton kernel on
CUDA (`modalmesh.kernels.activation`). MLP is the plain two-layer block (GPT-NeoX, ViTs); its module
names are arguments so checkpoints load without renames.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modalmesh import kernels
from modalmesh.kernels import activation as activation_kernels
from modalmesh.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def _gelu_new(x):  # GPT-2's tanh approximation, written out as in the reference
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})") from None


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False, *,
                 fused: bool = False, **tp):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, **tp)
        self.act = get_activation(hidden_act)
        self.fused = fused and self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused and kernels.usable(gate_up) and activation_kernels.fusable(gate_up):
            return self.down_proj(activation_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def linear_gelu_tanh(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(layer(x)) as one cuBLASLt GEMM with a bias + GELU epilogue (CUDA: `epilogue_fusable`)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(layer.bias, rows, layer.weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])


def epilogue_fusable(layer: ColumnParallelLinear, x: torch.Tensor) -> bool:
    # On CPU _addmm_activation's GELU is the erf form, so the epilogue is the tanh GELU on CUDA only.
    return (x.is_cuda and layer.bias is not None and not (layer.gather_output and layer.tp_size > 1)
            and x.dtype == layer.weight.dtype)


class MLP(nn.Module):
    """`pad_to`: the intermediate width rounded up to a multiple of it with zero weights (`ColumnParallelLinear`):
    every activation here maps 0 to 0, so the padded block computes what the checkpoint's does."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "gelu", bias: bool = True, *,
                 names: tuple[str, str] = ("fc1", "fc2"), fused: bool = False, pad_to: int = 1, **tp):
        super().__init__()
        self._names = names
        setattr(self, names[0], ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, pad_to=pad_to, **tp))
        setattr(self, names[1], RowParallelLinear(intermediate_size, hidden_size, bias=bias, pad_to=pad_to, **tp))
        self.act = get_activation(hidden_act)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, n) for n in self._names)
        if self.fused and self.act is _gelu_tanh and epilogue_fusable(up, x):
            return down(linear_gelu_tanh(up, x))
        h = up(x)
        if self.fused and self.act is _quick_gelu and kernels.usable(h) and activation_kernels.quick_gelu_fusable(h):
            return down(activation_kernels.quick_gelu(h))
        return down(self.act(h))
