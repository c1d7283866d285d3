"""Resampling and log-mel of a whole batch on the encoder's device (`--preprocess-device device`).

    feats = DeviceFeatures(FeatureConfig(...), DEFAULT_RESAMPLER, "cuda")
    mel = feats([wave_a, wave_b], [44100, 16000])     # uploaded mono waves -> (windows, n_mels, frames)

Why: on one CPU thread the log-mel of a 30 s clip takes ~11 ms and resampling
44.1 kHz more; on the GPU both are a few kernels. `prepare` (CPU pool) still
decodes, downmixes and checks everything, so every row count and every error
naming an item is known before the batch reaches the device; this runs only
the arithmetic, with the same code as the CPU path (`Resampler`, `LogMel`),
so on a CPU device its features equal the CPU path's exactly. On CUDA they
differ by float rounding (cuFFT, conv1d): tolerance in tests/test_audio_device.py
and docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.audio_encoder.audio import Resampler
from services.audio_encoder.features import FeatureConfig, LogMel


class DeviceFeatures:
    """Built once per model: the mel filters, the Hann window and the resampler's tables stay on the device."""

    def __init__(self, cfg: FeatureConfig, resampler: Resampler, device: torch.device | str):
        self.logmel = LogMel(cfg, device)
        self.resampler = resampler
        self.rate = cfg.sampling_rate
        # cuDNN takes float32 convolutions as TF32 by default (10-bit mantissa: a noise floor about
        # 66 dB down, inside Whisper's 80 dB log-mel range, so quiet bins would change). float64 keeps
        # the resampling exact at < 1 GFLOP per 30 s clip, and sets no process-wide flag. The taps
        # stay the float32 table's values, as on the CPU path.
        self.resample_dtype = torch.float64 if self.logmel.device.type == "cuda" else torch.float32

    def __call__(self, waves: Sequence[torch.Tensor], rates: Sequence[int]) -> torch.Tensor:
        """Mono waves (on the device, at their own rates) -> every clip's windows, in order, as one
        (sum of windows, n_mels, nb_max_frames) float32 tensor; one STFT for the batch (per-window maths)."""
        windows = [self.logmel.windows(self._resample(w, int(r))) for w, r in zip(waves, rates)]
        return self.logmel.log_mel(windows[0] if len(windows) == 1 else torch.cat(windows))

    def _resample(self, wave: torch.Tensor, rate: int) -> torch.Tensor:
        if rate == self.rate:
            return wave
        return self.resampler(wave.to(self.resample_dtype), rate, self.rate)
