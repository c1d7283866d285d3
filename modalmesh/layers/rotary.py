"""Rotary position embeddings: default, linear, llama3 and YaRN scaling; partial rotary; M-RoPE.

Layout is the "neox" one every supported family uses: the rotary part of a head
is split in two halves rotated against each other (``rotate_half``). A
cos/sin table over positions is built once per model and indexed per forward.
M-RoPE (Qwen2-VL): positions are (3, T) — temporal, height, width — and the
frequency bands are split by ``mrope_section``, band i taking component i % 3.
`rotate_and_store` rotates q and k and writes k and v into the paged KV pool in
one Triton kernel (`modalmesh.kernels.rotary`), where `can_fuse` allows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from modalmesh import kernels
from modalmesh.errors import ConfigError
from modalmesh.kernels import rotary as rotary_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(rotary_dim: int, params: Mapping, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rotary_dim // 2,) and the attention scaling applied to cos/sin."""
    rope_type = params.get("rope_type", "default") or "default"
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, params, max_position)
    raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _yarn(dim: int, base: float, params: Mapping, max_position: int) -> tuple[torch.Tensor, float]:
    original = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q (T, Hq, D) and k (T, Hk, D) at `positions` (T,) or (3, T) for M-RoPE."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: Mapping,
                 mrope_section: tuple[int, ...] | None = None):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        if mrope_section is not None and sum(mrope_section) != rotary_dim // 2:
            raise ConfigError(f"mrope_section {list(mrope_section)} must sum to rotary_dim/2 = {rotary_dim // 2}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.mrope_section = tuple(mrope_section) if mrope_section else None
        inv_freq, self.attention_scaling = rope_inv_freq(rotary_dim, params, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin", self._table(max_position, inv_freq.device), persistent=False)

    def _table(self, length: int, device) -> torch.Tensor:
        freqs = torch.arange(length, device=device, dtype=torch.float32)[:, None] * self.inv_freq.float().to(device)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling  # (L, rotary_dim)

    def ensure(self, length: int) -> None:
        """Make the table cover positions [0, length): call once with the serving limit."""
        if length > self.cos_sin.shape[0]:
            self.cos_sin = self._table(length, self.cos_sin.device)

    def _table_for(self, positions: torch.Tensor) -> torch.Tensor:
        # On an accelerator, reading positions.max() would stall the host every layer: callers size
        # the table up front with ensure(); on the CPU the check is free, so the table grows there.
        if positions.device.type == "cpu" and positions.numel():
            needed = int(positions.max()) + 1
            if needed > self.cos_sin.shape[0]:
                self.ensure(max(needed, 2 * self.cos_sin.shape[0]))
        return self.cos_sin

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table_for(positions)[positions]  # (T, rd) or (3, T, rd)
        half = self.rotary_dim // 2
        cos, sin = table[..., :half], table[..., half:]
        if self.mrope_section is not None:
            if positions.dim() == 1:
                raise ValueError("M-RoPE needs (3, T) positions")
            cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(self.mrope_section, dim=-1))], dim=-1)
            sin = torch.cat([s[i % 3] for i, s in enumerate(sin.split(self.mrope_section, dim=-1))], dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos[:, None, :], sin[:, None, :]  # broadcast over heads

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def can_fuse(self, positions: torch.Tensor, q: torch.Tensor) -> bool:
        """Whether `rotate_and_store` can take these inputs (else: `forward`, then the attention's store)."""
        return kernels.usable(q) and rotary_kernels.fusable(positions, q, self.rotary_dim, self.mrope_section)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotated q; rotated k and v written into `kv_cache` at `slot_mapping` (one kernel)."""
        return rotary_kernels.rope_and_store(positions, q, k, v, self._table_for(positions), kv_cache[0],
                                             kv_cache[1], slot_mapping, self.mrope_section)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rot = x[..., :rd].float()
        rotated = (rot * cos + rotate_half(rot) * sin).to(x.dtype)
        return rotated if rd == x.shape[-1] else torch.cat((rotated, x[..., rd:]), dim=-1)
