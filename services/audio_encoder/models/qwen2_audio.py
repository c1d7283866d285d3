"""Qwen2-Audio audio tower (Whisper-style encoder + average pooling) and its projector to the LLM width.

    model = Qwen2AudioTower(AudioTowerConfig(architectures, model_type, dims, text_hidden_size))
    rows = model(mel, lengths)      # (B, n_mels, F), positions per window -> (sum(lengths // 2), text_hidden)

The reference (transformers' Qwen2AudioModel) runs the tower on full 30 s
windows with the keys past each window's valid length masked
(``audio_feat_lengths = (mel_frames - 1) // 2 + 1``), average-pools by 2,
applies the final LayerNorm and the projector, and splices the first
``(audio_feat_lengths - 2) // 2 + 1`` rows. Masked keys mean padded positions
never reach a valid one, and the spliced rows pool only valid positions, so
running just the valid positions (packed) gives the same rows with less work.
Reads only ``audio_tower.*`` / ``multi_modal_projector.*`` from the full
checkpoint, in the hub layout or transformers-5's in-memory one (``model.`` prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from modalmesh.layers import ReplicatedLinear
from modalmesh.models import CheckpointModel
from modalmesh.weights import WeightsMapper
from services.audio_encoder.models.whisper import (
    LAYER_RENAMES,
    QKV,
    AudioTowerConfig,
    PackedIndex,
    WhisperEncoder,
)


def output_rows(mel_frames: torch.Tensor | int):
    """Rows spliced into the LLM for `mel_frames` valid frames (Qwen2-Audio's processor and model)."""
    positions = (mel_frames - 1) // 2 + 1
    return (positions - 2) // 2 + 1


class Qwen2AudioProjector(nn.Module):
    def __init__(self, d_audio: int, d_text: int):
        super().__init__()
        self.linear = ReplicatedLinear(d_audio, d_text, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioTower(nn.Module, CheckpointModel):
    architectures = ("Qwen2AudioForConditionalGeneration",)
    model_types = ("qwen2_audio",)
    checkpoint_prefixes = ("audio_tower.", "multi_modal_projector.",
                           "model.audio_tower.", "model.multi_modal_projector.")
    weights_mapper = WeightsMapper(prefix={"model.audio_tower.": "audio_tower.",
                                           "model.multi_modal_projector.": "multi_modal_projector."}) | LAYER_RENAMES
    stacked_params = QKV
    pool = 2

    def __init__(self, cfg: AudioTowerConfig, *, dtype: torch.dtype | None = None, fused_kernels: bool = True):
        super().__init__()
        self.dims = cfg.dims
        self.fused_kernels = fused_kernels  # on CUDA: residual add + LayerNorm as one Triton kernel
        self.audio_tower = WhisperEncoder(cfg.dims, layout="varlen", dtype=dtype, fused=fused_kernels)
        self.multi_modal_projector = Qwen2AudioProjector(cfg.dims.d_model, cfg.text_hidden_size)

    @property
    def output_hidden_size(self) -> int:
        return self.multi_modal_projector.linear.output_size

    def forward(self, input_features: torch.Tensor, lengths: Sequence[int] | None = None,
                index: PackedIndex | None = None) -> torch.Tensor:
        """`lengths` (positions per window), or their `PackedIndex` (built with pool=2) already on the device."""
        return self.multi_modal_projector(self.audio_tower(input_features, lengths, pool=self.pool, index=index))
