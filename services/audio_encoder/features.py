"""Whisper log-mel features in torch, equal to transformers' `WhisperFeatureExtractor`.

    cfg = FeatureConfig.from_dir(model_dir, n_mels=128)   # preprocessor_config.json of the checkpoint
    feats = LogMel(cfg)(mono16k)                           # WindowFeatures
    feats.mel          # (windows, n_mels, 3000) float32, one row per 30 s window
    feats.frames       # valid (non-padding) mel frames of each window

Per window, exactly what the reference does for one clip: pad the 16 kHz
samples with `padding_value` to `chunk_length` seconds, centred STFT (periodic
Hann window of `n_fft`, reflect padding, hop `hop_length`), power spectrum
with the last frame dropped, Slaney-normalised Slaney-scale mel filters
(0..8 kHz), ``log10(max(., 1e-10))``, floor at the window's maximum - 8, then
``(x + 4) / 4``. Audio longer than one window is cut into consecutive windows;
the last is padded. The valid frame count of a window with n samples is
``ceil(n / hop)`` (the reference's feature attention mask summed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from modalmesh.errors import ConfigError


@dataclass(frozen=True)
class FeatureConfig:
    n_mels: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30
    padding_value: float = 0.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        return self.n_samples // self.hop_length

    def signature(self) -> str:
        return (f"logmel(n_mels={self.n_mels},sr={self.sampling_rate},hop={self.hop_length},n_fft={self.n_fft},"
                f"chunk={self.chunk_length},pad={self.padding_value!r})")

    @classmethod
    def from_dir(cls, model_dir: str | Path | None, n_mels: int) -> FeatureConfig:
        """From the checkpoint's ``preprocessor_config.json`` (WhisperFeatureExtractor), else the defaults.

        `n_mels` is the model's ``num_mel_bins``; a feature extractor that disagrees is a ConfigError.
        """
        path = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
        if path is None or not path.is_file():
            return cls(n_mels=n_mels)
        try:
            raw = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        kind = raw.get("feature_extractor_type", "WhisperFeatureExtractor")
        if kind != "WhisperFeatureExtractor":
            raise ConfigError(f"{path}: feature extractor {kind!r} is not supported (WhisperFeatureExtractor is)")
        cfg = cls(
            n_mels=int(raw.get("feature_size", n_mels)),
            sampling_rate=int(raw.get("sampling_rate", 16000)),
            hop_length=int(raw.get("hop_length", 160)),
            n_fft=int(raw.get("n_fft", 400)),
            chunk_length=int(raw.get("chunk_length", 30)),
            padding_value=float(raw.get("padding_value", 0.0)),
        )
        if cfg.n_mels != n_mels:
            raise ConfigError(f"{path}: feature_size {cfg.n_mels} but the model takes {n_mels} mel bins")
        if float(raw.get("dither") or 0.0) != 0.0:
            # Random noise would make features (and the embedding cache) non-deterministic.
            raise ConfigError(f"{path}: dither={raw['dither']} is not supported (serving is deterministic)")
        if raw.get("do_normalize"):
            raise ConfigError(f"{path}: do_normalize is not supported by Whisper-style encoders")
        return cfg


# ---- mel filter bank (Slaney scale and area normalisation, as librosa / transformers) ----------

_MIN_LOG_HZ, _MIN_LOG_MEL, _LOGSTEP = 1000.0, 15.0, 27.0 / math.log(6.4)


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    linear = 3.0 * f / 200.0
    return torch.where(f >= _MIN_LOG_HZ, _MIN_LOG_MEL + torch.log(f / _MIN_LOG_HZ) * _LOGSTEP, linear)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    linear = 200.0 * m / 3.0
    return torch.where(m >= _MIN_LOG_MEL, _MIN_LOG_HZ * torch.exp((m - _MIN_LOG_MEL) / _LOGSTEP), linear)


def mel_filter_bank(n_freqs: int, n_mels: int, sampling_rate: int, f_min: float, f_max: float) -> torch.Tensor:
    """(n_freqs, n_mels) float64 triangular filters, Slaney mel scale and Slaney area normalisation."""
    lo, hi = (_hz_to_mel(torch.tensor(f, dtype=torch.float64)) for f in (f_min, f_max))
    filter_hz = _mel_to_hz(torch.linspace(float(lo), float(hi), n_mels + 2, dtype=torch.float64))
    fft_hz = torch.linspace(0, sampling_rate // 2, n_freqs, dtype=torch.float64)
    slopes = filter_hz[None, :] - fft_hz[:, None]  # (n_freqs, n_mels + 2)
    diff = filter_hz.diff()
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    return filters * (2.0 / (filter_hz[2:] - filter_hz[:-2]))[None, :]


@dataclass
class WindowFeatures:
    mel: torch.Tensor  # (windows, n_mels, nb_max_frames) float32
    frames: list[int]  # valid mel frames per window
    samples: int  # 16 kHz samples of the whole clip


class LogMel:
    """Thread-safe (read-only state): prepare() calls it from a pool."""

    def __init__(self, cfg: FeatureConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        n_freqs = 1 + cfg.n_fft // 2
        # Computed in float64 and used in float32, as the reference does.
        filters = mel_filter_bank(n_freqs, cfg.n_mels, cfg.sampling_rate, cfg.min_frequency, cfg.max_frequency)
        self.filters_t = filters.T.contiguous().to(self.device, torch.float32)  # (n_mels, n_freqs)
        self.window = torch.hann_window(cfg.n_fft, device=self.device)

    def num_windows(self, samples: int) -> int:
        return max(1, -(-samples // self.cfg.n_samples))

    def valid_frames(self, samples: int) -> list[int]:
        """Valid mel frames of each window for a clip of `samples` samples (feature mask summed)."""
        cfg = self.cfg
        frames = []
        for w in range(self.num_windows(samples)):
            n = min(cfg.n_samples, samples - w * cfg.n_samples)
            frames.append(min(cfg.nb_max_frames, -(-n // cfg.hop_length)))
        return frames

    def __call__(self, audio: torch.Tensor) -> WindowFeatures:
        """`audio`: (N,) mono at `cfg.sampling_rate`."""
        samples = int(audio.shape[-1])
        return WindowFeatures(self.log_mel(self.windows(audio)), self.valid_frames(samples), samples)

    def windows(self, audio: torch.Tensor) -> torch.Tensor:
        """(N,) -> (windows, n_samples) on this device, the last window padded with `padding_value`.

        Split from `log_mel` so the device path can stack several clips' windows into one STFT:
        every step of `log_mel` is per window (the floor is each window's own maximum)."""
        cfg = self.cfg
        samples = int(audio.shape[-1])
        windows = self.num_windows(samples)
        wave = audio.to(self.device, torch.float32)
        pad = windows * cfg.n_samples - samples
        if pad:
            wave = torch.nn.functional.pad(wave, (0, pad), value=cfg.padding_value)
        return wave.view(windows, cfg.n_samples)

    def log_mel(self, wave: torch.Tensor) -> torch.Tensor:
        """(W, n_samples) windows -> (W, n_mels, nb_max_frames) float32 log-mel features."""
        cfg = self.cfg
        stft = torch.stft(wave, cfg.n_fft, cfg.hop_length, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()  # (W, n_freqs, frames)
        mel = self.filters_t @ power  # (W, n_mels, frames)
        log = torch.clamp(mel, min=1e-10).log10()
        peak = log.amax(dim=(1, 2), keepdim=True)
        return (torch.maximum(log, peak - 8.0) + 4.0) / 4.0
