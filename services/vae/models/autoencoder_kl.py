"""AutoencoderKL decoder (SD 1.x/2.x, SDXL, SD3, FLUX): architecture only.

Module names follow diffusers' (``decoder.mid_block.attentions.0.to_q``,
``decoder.up_blocks.0.upsamplers.0.conv``, ``post_quant_conv``) so its checkpoints
load by name. How checkpoints map onto it is class data (modalmesh/models.py):

* Only ``decoder.*`` and ``post_quant_conv.*`` are read (``checkpoint_prefixes``):
  encoder and quant-conv tensors stay on disk.
* `LEGACY_ATTENTION` (``weights_mapper``): diffusers < 0.14 named the mid-block
  attention ``query`` / ``key`` / ``value`` / ``proj_attn``; today it is ``to_q`` /
  ``to_k`` / ``to_v`` / ``to_out.0`` (what diffusers' own
  ``_convert_deprecated_attention_blocks`` does).
* ``weight_loaders``: some checkpoints store those projections as 1x1 convolution
  weights ``(C, C, 1, 1)``; the parameters are linears ``(C, C)``. The rule is a
  ``weight_loader`` on the matching parameters, so the model has no format branch.

Attention goes through `modalmesh.attention`. Each GroupNorm that a SiLU follows takes it in
(``GroupNorm(silu=True)``); with ``fused_kernels`` both run as one Triton kernel family on CUDA
(`modalmesh.kernels.group_norm`: PyTorch's own GroupNorm left most of an H100 idle at 1024²).

    model = AutoencoderKLDecoder(cfg, dtype=torch.float32)
    pixels = model(z)            # z as AutoencoderKL.decode takes it -> (B, 3, 8h, 8w) in about [-1, 1]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modalmesh import kernels
from modalmesh.attention import Attention
from modalmesh.kernels import group_norm as group_norm_kernels
from modalmesh.kernels import residual as residual_kernels
from modalmesh.layers import GroupNorm
from modalmesh.models import CheckpointModel
from modalmesh.weights import WeightMismatchError, WeightsMapper, default_weight_loader
from services.vae.config import VAEConfig

_ATTN = r"(\.mid_block\.attentions\.\d+)\."
# WeightsMapper applies only the first matching regex per name, and each name matches one of these.
LEGACY_ATTENTION = WeightsMapper(regex=(
    (_ATTN + r"query\.", r"\1.to_q."),
    (_ATTN + r"key\.", r"\1.to_k."),
    (_ATTN + r"value\.", r"\1.to_v."),
    (_ATTN + r"proj_attn\.", r"\1.to_out.0."),
))


def conv1x1_as_linear(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Load a linear weight from either a (out, in) matrix or an (out, in, 1, 1) 1x1-conv kernel."""
    if loaded.dim() == 4:
        if tuple(loaded.shape[2:]) != (1, 1):
            raise WeightMismatchError(f"a {list(loaded.shape)} kernel is not a 1x1 convolution")
        loaded = loaded[:, :, 0, 0]
    default_weight_loader(param, loaded, shard_id)


class ResnetBlock(nn.Module):
    """norm1+SiLU, conv1, norm2+SiLU, conv2, plus the (1x1-projected) input.

    With fused kernels the convolutions run without their biases, which ride the passes after them: conv1's
    in norm2, conv2's in the residual add (PyTorch adds a convolution's bias in a pass of its own). The block
    also takes a bias its input still lacks (`input_bias`, from the convolution before it): it rides norm1
    and the residual add, through the shortcut's 1x1 projection where there is one. Its residual add takes
    the GroupNorm statistics of its output (`group_norm_kernels.add_with_moments`), which the next block's
    norm1 (or the norm after the block) then need not read the output for."""

    def __init__(self, cin: int, cout: int, groups: int, eps: float, fused: bool):
        super().__init__()
        self.fused = fused
        self.norm1 = GroupNorm(groups, cin, eps, silu=True, fused=fused)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = GroupNorm(groups, cout, eps, silu=True, fused=fused)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.conv_shortcut is None else self.conv_shortcut(x)

    def forward(self, x: torch.Tensor, input_bias: torch.Tensor | None = None,
                moments: group_norm_kernels.Moments | None = None
                ) -> tuple[torch.Tensor, group_norm_kernels.Moments | None]:
        """(the block's output for input x + `input_bias` per channel, its GroupNorm moments where the residual
        kernel took them, else None). `moments` are x's own (from the block before)."""
        if not (self.fused and kernels.usable(x)):
            if input_bias is not None:
                x = x + input_bias.to(x.dtype).view(-1, 1, 1)
            return self.shortcut(x) + self.conv2(self.norm2(self.conv1(self.norm1(x)))), None
        h = F.conv2d(self.norm1(x, pre_bias=input_bias, moments=moments), self.conv1.weight, None, padding=1)
        h = F.conv2d(self.norm2(h, pre_bias=self.conv1.bias), self.conv2.weight, None, padding=1)
        residual, bias = self._residual(x, input_bias)
        if residual_kernels.fusable(h, bias, residual):
            return group_norm_kernels.add_with_moments(h, bias, residual)
        return residual_kernels.reference(h, bias, residual), None

    def _residual(self, x: torch.Tensor, input_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The shortcut of x without any bias, and the biases the output still lacks, summed in float32: conv2's,
        the shortcut's, and `input_bias` (through the shortcut's 1x1 projection, W (x + p) = W x + W p)."""
        bias = self.conv2.bias.float()
        if self.conv_shortcut is None:
            return x, bias if input_bias is None else bias + input_bias.float()
        weight = self.conv_shortcut.weight
        bias = bias + self.conv_shortcut.bias.float()
        if input_bias is not None:
            bias = torch.addmv(bias, weight.flatten(1).float(), input_bias.float())
        return F.conv2d(x, weight), bias


class SpatialSelfAttention(nn.Module):
    """Group norm, single-head self-attention over the h*w positions, output projection, residual."""

    def __init__(self, channels: int, head_dim: int, groups: int, eps: float, dtype: torch.dtype | None,
                 seqlen_hint: int | None, fused: bool):
        super().__init__()
        self.heads, self.head_dim = channels // head_dim, head_dim
        self.group_norm = GroupNorm(groups, channels, eps, fused=fused)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])
        self.attn = Attention(self.heads, head_dim, component="vae", dtype=dtype, seqlen_hint=seqlen_hint)

    def forward(self, x: torch.Tensor, moments: group_norm_kernels.Moments | None = None) -> torch.Tensor:
        b, c, h, w = x.shape
        seq = self.group_norm(x, moments=moments).flatten(2).transpose(1, 2)  # (B, h*w, C)
        q, k, v = (proj(seq).view(b, h * w, self.heads, self.head_dim) for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](self.attn(q, k, v).reshape(b, h * w, c))
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class MidBlock(nn.Module):
    def __init__(self, cfg: VAEConfig, channels: int, dtype, seqlen_hint, fused: bool):
        super().__init__()
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups, eps, fused) for _ in range(2)])
        self.attentions = nn.ModuleList(
            [SpatialSelfAttention(channels, cfg.attention_head_dim, groups, eps, dtype, seqlen_hint, fused)]
            if cfg.mid_block_add_attention else [])

    def forward(self, x: torch.Tensor, input_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, group_norm_kernels.Moments | None]:
        """(output, its GroupNorm moments or None), as ResnetBlock.forward."""
        x, moments = self.resnets[0](x, input_bias)
        for attn in self.attentions:
            x, moments = attn(x, moments), None
        return self.resnets[1](x, None, moments)


def upsample_nearest_2x(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2.0, mode="nearest"), in x's memory format.

    In channels-last it is a broadcast copy of whole pixels: PyTorch's NHWC nearest kernel took 2.7 ms of
    the decoder at 1024² bf16 on an H100, against 1.0 ms for its NCHW one."""
    if x.dim() != 4 or x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
        return F.interpolate(x, scale_factor=2.0, mode="nearest")
    n, c, h, w = x.shape
    pixels = x.permute(0, 2, 3, 1)  # (N, H, W, C), contiguous
    out = pixels[:, :, None, :, None, :].expand(n, h, 2, w, 2, c).reshape(n, 2 * h, 2 * w, c)
    return out.permute(0, 3, 1, 2)  # (N, C, 2H, 2W) in channels-last


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self._phases: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (weight alias, version, phases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(upsample_nearest_2x(x))

    def forward_with_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, group_norm_kernels.Moments]:
        """forward(x) on the fused path, with its output's GroupNorm moments: four 2x2 convolutions on x instead of
        a 3x3 on the upsampled x (16 of 36 multiply-adds; the three upsamplers' convolutions were 2.8 of the SDXL
        decoder's 9.9 TFLOP at 1024²), interleaved with the bias by the next norm's statistics pass."""
        return group_norm_kernels.upsampled_conv_with_moments(x, self.phase_weight(), self.conv.bias)

    def phase_weight(self) -> torch.Tensor:
        """The conv's weight as `phase_weights`, kept while the weight is the same storage, dtype and device at
        the same version: loaded again in place, cast or moved, they are made again (the kept alias pins the old
        storage, so a new weight at a reused address is not mistaken for it). Weights loaded under inference_mode
        carry no version counter, so theirs are made on every call."""
        weight = self.conv.weight.detach()  # an alias: shares the storage and the version counter
        if weight.is_inference():
            return group_norm_kernels.phase_weights(weight)
        kept = self._phases
        if (kept is None or kept[0].data_ptr() != weight.data_ptr() or kept[0].dtype != weight.dtype
                or kept[0].device != weight.device or kept[1] != weight._version):
            with torch.inference_mode(False):  # a normal tensor, usable outside inference_mode as well
                kept = self._phases = weight, weight._version, group_norm_kernels.phase_weights(weight)
        return kept[2]


class UpDecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, groups: int, eps: float, upsample: bool, fused: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, groups, eps, fused)
                                      for i in range(layers)])
        self.upsamplers = nn.ModuleList([Upsample(cout)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x, _ = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x

    def forward_fused(self, x: torch.Tensor, moments: group_norm_kernels.Moments | None
                      ) -> tuple[torch.Tensor, group_norm_kernels.Moments | None]:
        """forward(x) on the fused path, x's `moments` taken by the block before, as (output, its moments or
        None). The upsampler runs as 2x2 convolutions on the last resnet's output
        (`Upsample.forward_with_moments`)."""
        for resnet in self.resnets:
            x, moments = resnet(x, None, moments)
        if self.upsamplers is None:
            return x, moments
        return self.upsamplers[0].forward_with_moments(x)


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig, dtype, seqlen_hint, fused: bool):
        super().__init__()
        channels = list(reversed(cfg.block_out_channels))
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        self.conv_in = nn.Conv2d(cfg.latent_channels, channels[0], 3, padding=1)
        self.mid_block = MidBlock(cfg, channels[0], dtype, seqlen_hint, fused)
        self.up_blocks = nn.ModuleList(
            UpDecoderBlock(channels[max(i - 1, 0)], channels[i], cfg.layers_per_block + 1, groups, eps,
                           upsample=i < len(channels) - 1, fused=fused)
            for i in range(len(channels)))
        self.conv_norm_out = GroupNorm(groups, channels[-1], eps, silu=True, fused=fused)
        self.conv_out = nn.Conv2d(channels[-1], cfg.out_channels, 3, padding=1)
        self.fused = fused

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.fused and kernels.usable(z):
            return self._forward_folded(z)
        x, _ = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.conv_norm_out(x))

    def _forward_folded(self, z: torch.Tensor) -> torch.Tensor:
        """forward's math with each convolution's bias carried to the next pass that reads its output (a bias add
        of its own is a pass over the tensor: 8 of them were 2.0 ms of the decoder at 1024² bf16 on an H100):
        conv_in's rides the mid block's first GroupNorm and residual add, each upsampler's the pass that
        interleaves its phases; and each GroupNorm's statistics come from the pass that wrote its input."""
        x = F.conv2d(z, self.conv_in.weight, None, padding=1)
        x, moments = self.mid_block(x, input_bias=self.conv_in.bias)
        for block in self.up_blocks:
            x, moments = block.forward_fused(x, moments)
        return self.conv_out(self.conv_norm_out(x, moments=moments))


class AutoencoderKLDecoder(nn.Module, CheckpointModel):
    """post_quant_conv (when the config has one) followed by the decoder: AutoencoderKL.decode's math."""

    architectures = ("AutoencoderKL",)
    checkpoint_prefixes = ("decoder.", "post_quant_conv.")
    weights_mapper = LEGACY_ATTENTION
    weight_loaders = (
        ("decoder.mid_block.attentions.*.to_[qkv].weight", conv1x1_as_linear),
        ("decoder.mid_block.attentions.*.to_out.0.weight", conv1x1_as_linear),
    )

    def __init__(self, cfg: VAEConfig, *, dtype: torch.dtype | None = None, seqlen_hint: int | None = None,
                 fused_kernels: bool = True):
        super().__init__()
        self.config = cfg
        self.post_quant_conv = (nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1)
                                if cfg.use_post_quant_conv else None)
        self.decoder = Decoder(cfg, dtype, seqlen_hint, fused_kernels)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)
