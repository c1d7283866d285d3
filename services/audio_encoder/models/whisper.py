"""Whisper encoder: conv stem, sinusoidal positions, pre-LN transformer (transformers' WhisperEncoder).

    cfg = audio_config(dir, ModelConfig.from_hf(dir))       # services/audio_encoder/model.py
    model, report = build_and_load(WhisperAudioEncoder, cfg, dir, device="cuda", dtype=torch.bfloat16)
    hidden = model(mel)                       # (B, n_mels, 3000) -> (B, 1500, d_model)

`WhisperEncoder` is shared with Qwen2-Audio's audio tower, which runs it packed
(only each window's valid positions, `forward(mel, lengths, pool=2)`).
Positions come from the checkpoint's ``embed_positions.weight`` (the sinusoids
Whisper was trained with). Whisper's k projection has no bias: the fused
``qkv_proj`` bias takes the q and v shards and keeps k's part at zero unless a
checkpoint carries a k bias.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from modalmesh.attention import Attention, VarlenMetadata, attention_metadata
from modalmesh.config import ModelConfig
from modalmesh.layers import MLP, LayerNorm, QKVParallelLinear, RowParallelLinear, residual_norm
from modalmesh.models import CheckpointModel
from modalmesh.weights import StackedMapping, WeightsMapper
from modalmesh.weights.param import set_weight_loader

LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which Whisper and Qwen2-Audio use (not in their configs)

QKV = StackedMapping([("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")])
# Checkpoint layer names -> ours (fused qkv, `proj`, the MLP block).
LAYER_RENAMES = WeightsMapper(
    substr={".self_attn.out_proj.": ".self_attn.proj."},
    regex={r"\.layers\.(\d+)\.(fc[12])\.": r".layers.\1.mlp.\2."},
)


@dataclass(frozen=True)
class AudioEncoderDims:
    d_model: int
    layers: int
    heads: int
    ffn: int
    n_mels: int
    max_source_positions: int  # positions after the stride-2 conv: 1500 for 30 s
    act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def window_frames(self) -> int:
        """Mel frames of one window: the stem halves them into max_source_positions."""
        return 2 * self.max_source_positions

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> AudioEncoderDims:
        """From the audio part (Qwen2-Audio) or a Whisper config, whose encoder keys are top level."""
        n_mels = cfg.get("num_mel_bins")
        positions = cfg.get("max_source_positions") or cfg.max_position_embeddings
        if not n_mels or not positions:
            raise ValueError(f"{cfg.model_type}: config lacks num_mel_bins / max_source_positions")
        return cls(
            d_model=int(cfg.get("d_model") or cfg.hidden_size),
            layers=int(cfg.get("encoder_layers") or cfg.num_layers),
            heads=int(cfg.get("encoder_attention_heads") or cfg.num_heads),
            ffn=int(cfg.get("encoder_ffn_dim") or cfg.intermediate_size),
            n_mels=int(n_mels),
            max_source_positions=int(positions),
            act=str(cfg.get("activation_function") or cfg.hidden_act or "gelu"),
        )


@dataclass(frozen=True)
class AudioTowerConfig:
    """An audio checkpoint as the towers take it: the names a tower is picked by, the encoder's
    dims, and the language model's width (what Qwen2-Audio's projector maps to)."""

    architectures: tuple[str, ...]
    model_type: str
    dims: AudioEncoderDims
    text_hidden_size: int


@dataclass(frozen=True)
class PackedIndex:
    """Which positions a packed forward keeps and pools, for windows of `positions` positions.

    Built on the host (`build`); the model uploads `tensors()` with the batch's inputs in one copy
    (`with_tensors`), because an index made on the host and copied alone waits for the device's queue.
    """

    lengths: tuple[int, ...]  # valid positions per window
    positions: int  # positions per window in the stem's output (what `keep` strides by)
    keep: torch.Tensor  # int64 (T,): the kept rows of the flattened (windows * positions, d)
    cu_seqlens: torch.Tensor  # int32 (windows + 1,)
    first: torch.Tensor  # int64: each pooled group's first packed row (empty when pool == 1)

    @classmethod
    def build(cls, lengths: Sequence[int], positions: int, pool: int = 1) -> PackedIndex:
        lens = [int(n) for n in lengths]
        if not lens or min(lens) < 1 or max(lens) > positions:
            raise ValueError(f"lengths {lens} do not fit windows of {positions} positions")
        keep = torch.cat([b * positions + torch.arange(n) for b, n in enumerate(lens)])
        cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
        if pool > 1:
            first = torch.cat([int(s) + pool * torch.arange(n // pool) for s, n in zip(cu[:-1].tolist(), lens)])
        else:
            first = torch.zeros(0, dtype=torch.int64)
        return cls(tuple(lens), positions, keep, cu, first)

    def tensors(self) -> list[torch.Tensor]:
        return [self.keep, self.cu_seqlens, self.first]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> PackedIndex:
        keep, cu, first = tensors
        return PackedIndex(self.lengths, self.positions, keep, cu, first)


def conv_output_lengths(mel_frames: torch.Tensor | int):
    """Positions after the stem (conv stride 2) for `mel_frames` valid frames (HF's formula)."""
    return (mel_frames - 1) // 2 + 1


def _bias_without_k(qkv: QKVParallelLinear) -> None:
    """The fused bias needs only q and v shards; k's rows stay zero unless the checkpoint has them."""

    def load(param, loaded, shard_id=None):
        qkv.weight_loader(param, loaded, shard_id)
        if shard_id in ("q", "v"):
            if not getattr(param, "k_bias_loaded", False):
                param.data.narrow(0, qkv.q_size, qkv.kv_size).zero_()
        else:  # "k", or a fused q|k|v bias
            param.k_bias_loaded = True

    set_weight_loader(qkv.bias, load, ("q", "v"))


class WhisperAttention(nn.Module):
    def __init__(self, dims: AudioEncoderDims, *, layout: str, dtype: torch.dtype | None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(dims.d_model, dims.head_dim, dims.heads, bias=True)
        _bias_without_k(self.qkv_proj)
        self.proj = RowParallelLinear(dims.d_model, dims.d_model, bias=True)
        self.head_dim = dims.head_dim
        self.attn = Attention(self.qkv_proj.num_heads, dims.head_dim, component="audio_encoder", layouts=(layout,),
                              dtype=dtype, seqlen_hint=dims.max_source_positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in self.qkv_proj.split(self.qkv_proj(x)))
        return self.proj(self.attn(q, k, v).flatten(-2))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, dims: AudioEncoderDims, *, layout: str, dtype: torch.dtype | None, fused: bool = False):
        super().__init__()
        self.self_attn = WhisperAttention(dims, layout=layout, dtype=dtype)
        self.self_attn_layer_norm = LayerNorm(dims.d_model, LAYER_NORM_EPS, fused=fused)
        self.mlp = MLP(dims.d_model, dims.ffn, dims.act, bias=True, names=("fc1", "fc2"), fused=fused)
        self.final_layer_norm = LayerNorm(dims.d_model, LAYER_NORM_EPS, fused=fused)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last sub-layer's output, residual stream) -> (this MLP's output, stream): `residual_norm`."""
        normed, residual = residual_norm(self.self_attn_layer_norm, h, residual)
        normed, residual = self.final_layer_norm(self.self_attn(normed), residual)
        h = self.mlp(normed)
        if h.dtype == torch.float16:  # as the reference: the stream clamped after each layer, to stay finite
            limit = torch.finfo(h.dtype).max - 1000
            return (h + residual).clamp(-limit, limit), None
        return h, residual


class WhisperEncoder(nn.Module):
    """Conv stem + positions + pre-LN layers + final LayerNorm.

    layout "dense": every window runs all max_source_positions positions (Whisper, which
    attends over the padding of a 30 s window). layout "varlen": each window runs only its
    first `lengths[b]` positions, packed (Qwen2-Audio, whose tower masks padded keys).
    """

    def __init__(self, dims: AudioEncoderDims, *, layout: str = "dense", dtype: torch.dtype | None = None,
                 fused: bool = False):
        super().__init__()
        self.dims = dims
        self.layout = layout
        d = dims.d_model
        self.conv1 = nn.Conv1d(dims.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(dims.max_source_positions, d)
        self.layers = nn.ModuleList(
            [WhisperEncoderLayer(dims, layout=layout, dtype=dtype, fused=fused) for _ in range(dims.layers)])
        self.layer_norm = LayerNorm(d, LAYER_NORM_EPS, fused=fused)
        self.requires_grad_(False)

    def stem(self, input_features: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, F) -> (B, (F - 1) // 2 + 1, d) with positions added."""
        x = input_features.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)
        if x.shape[1] > self.dims.max_source_positions:
            raise ValueError(f"{input_features.shape[-1]} mel frames exceed the {self.dims.window_frames} of a window")
        # Written out row-major: an add keeps its input's transposed layout, and every layer's residual would
        # inherit it, each LayerNorm copying it back and each residual add running strided (HF's encoder
        # does this: 31 % of the encoder's kernel time at batch 16 on an H100, 2026-12-05)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return torch.add(x, self.embed_positions.weight[: x.shape[1]], out=out)

    def forward(self, input_features: torch.Tensor, lengths: Sequence[int] | None = None, pool: int = 1,
                index: PackedIndex | None = None):
        """Dense: (B, n_mels, window_frames) -> (B, max_source_positions, d).

        Packed (`lengths`: valid positions per window, after the stem; or `index`, already on the
        device): (sum(lengths[b] // pool), d), windows in order; `pool` = 2 averages neighbouring
        positions before the final norm.
        """
        h = self.stem(input_features)
        if lengths is None and index is None:
            if self.layout != "dense" or h.shape[1] != self.dims.max_source_positions:
                raise ValueError(f"dense Whisper input must be (B, {self.dims.n_mels}, {self.dims.window_frames})")
            return residual_norm(self.layer_norm, *self._layers(h))[0]
        if index is None:
            built = PackedIndex.build(lengths, h.shape[1], pool)
            index = built.with_tensors([t.to(h.device) for t in built.tensors()])
        if len(index.lengths) != h.shape[0] or index.positions != h.shape[1]:
            raise ValueError(f"lengths {list(index.lengths)} do not fit {h.shape[0]} windows of {h.shape[1]} positions")
        h = h.flatten(0, 1).index_select(0, index.keep)  # (T, d), window by window
        meta = VarlenMetadata(index.cu_seqlens, max(index.lengths), index.lengths)
        with attention_metadata(meta):
            h, residual = self._layers(h)
        if pool == 1:
            return residual_norm(self.layer_norm, h, residual)[0]
        h = h if residual is None else h + residual
        return self.layer_norm(sum(h[index.first + i] for i in range(pool)) / pool)

    def _layers(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over the residual stream: (the last MLP's output, the stream before its add)."""
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual)
        return h, residual


class WhisperAudioEncoder(nn.Module, CheckpointModel):
    """The encoder of any Whisper checkpoint (only ``model.encoder.*`` is read)."""

    architectures = ("WhisperForConditionalGeneration", "WhisperModel", "WhisperForAudioClassification")
    model_types = ("whisper",)
    checkpoint_prefixes = ("model.encoder.", "encoder.")
    weights_mapper = WeightsMapper(prefix={"model.encoder.": "encoder."}) | LAYER_RENAMES
    stacked_params = QKV

    def __init__(self, cfg: AudioTowerConfig, *, dtype: torch.dtype | None = None, fused_kernels: bool = True):
        super().__init__()
        self.dims = cfg.dims
        self.fused_kernels = fused_kernels  # on CUDA: residual add + LayerNorm as one Triton kernel
        self.encoder = WhisperEncoder(cfg.dims, layout="dense", dtype=dtype, fused=fused_kernels)

    @property
    def output_hidden_size(self) -> int:
        return self.dims.d_model

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features)
