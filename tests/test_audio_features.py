"""Audio in (decode, downmix, validation), the Kaiser-sinc resampler, and log-mel vs WhisperFeatureExtractor."""

import io
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import WhisperFeatureExtractor

from modalmesh.errors import ConfigError, InvalidArgument
from services.audio_encoder.audio import Resampler, decode_audio, downmix, pcm_audio, resample
from services.audio_encoder.features import FeatureConfig, LogMel, mel_filter_bank

SR = 16000


def synth(seconds: float, rate: int = SR, *, seed: int = 0, kind: str = "mix") -> np.ndarray:
    """Deterministic test audio in [-1, 1]: a tone, a chirp and noise."""
    n = int(round(seconds * rate))
    t = np.arange(n, dtype=np.float64) / rate
    rng = np.random.default_rng(seed)
    tone = 0.4 * np.sin(2 * np.pi * 440.0 * t)
    f0, f1 = 100.0, min(7000.0, rate / 2 - 500)
    chirp = 0.3 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * max(seconds, 1e-3))))
    noise = 0.05 * rng.standard_normal(n)
    parts = {"tone": tone, "chirp": chirp, "noise": 4 * noise, "mix": tone + chirp + noise}
    return parts[kind].astype(np.float32)


def encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples.T if samples.ndim == 2 else samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# -- log-mel ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equal_transformers(n_mels):
    ours = mel_filter_bank(201, n_mels, SR, 0.0, 8000.0).numpy()
    assert np.abs(ours - WhisperFeatureExtractor(feature_size=n_mels).mel_filters).max() < 1e-12


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds, fmt, subtype, kind", [
    (0.37, "WAV", "PCM_16", "tone"),      # < 1 s
    (3.7013, "FLAC", "PCM_24", "chirp"),  # not a multiple of the hop
    (30.0, "WAV", "FLOAT", "noise"),      # exactly one window
    (47.3, "FLAC", "PCM_16", "mix"),      # two windows, the last padded
])
def test_log_mel_equals_whisper_feature_extractor(n_mels, seconds, fmt, subtype, kind):
    data = encoded(synth(seconds, kind=kind), SR, fmt, subtype)
    wave, rate = decode_audio(data, what="items[0]", max_seconds=60)
    reference_samples, _ = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == SR and torch.equal(wave[0], torch.from_numpy(reference_samples))

    feats = LogMel(FeatureConfig(n_mels=n_mels))(downmix(wave))
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    windows = math.ceil(len(reference_samples) / fe.n_samples)
    assert feats.mel.shape == (windows, n_mels, 3000)
    for w in range(windows):
        chunk = reference_samples[w * fe.n_samples:(w + 1) * fe.n_samples]
        ref = fe(chunk, sampling_rate=SR, return_tensors="pt", return_attention_mask=True)
        assert (feats.mel[w] - ref.input_features[0]).abs().max() <= 1e-4
        assert feats.frames[w] == int(ref.attention_mask.sum())  # what Qwen2-Audio counts tokens from


@pytest.mark.parametrize("samples", [1, 159, 160, 161, 16000, 479_999, 480_000, 480_001, 1_000_000])
def test_valid_frames_are_the_feature_attention_mask(samples):
    fe = WhisperFeatureExtractor(feature_size=80)
    logmel = LogMel(FeatureConfig())
    frames = logmel.valid_frames(samples)
    expected = []
    for start in range(0, samples, fe.n_samples):
        n = min(fe.n_samples, samples - start)
        mask = fe(np.zeros(n, np.float32), sampling_rate=SR, return_attention_mask=True).attention_mask
        expected.append(int(mask.sum()))
    assert frames == expected


def test_feature_config_from_checkpoint(tmp_path):
    WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path)
    assert FeatureConfig.from_dir(tmp_path, 128) == FeatureConfig(n_mels=128)
    with pytest.raises(ConfigError, match="feature_size 128 but the model takes 80"):
        FeatureConfig.from_dir(tmp_path, 80)
    WhisperFeatureExtractor(feature_size=80, dither=1e-4).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="dither"):
        FeatureConfig.from_dir(tmp_path, 80)
    assert FeatureConfig.from_dir(tmp_path / "absent", 80) == FeatureConfig(n_mels=80)


# -- resampler ----------------------------------------------------------------------------------
def _tone(freq, rate, seconds, dtype=torch.float64):
    return torch.sin(2 * math.pi * freq * torch.arange(int(seconds * rate), dtype=dtype) / rate)


def test_sixteen_khz_is_passed_through():
    x = torch.from_numpy(synth(1.3))
    assert resample(x, SR, SR) is x


@pytest.mark.parametrize("orig", [8000, 11025, 22050, 44100, 48000, 96000, 12345])
def test_resampled_tone_has_the_right_frequency_and_length(orig):
    x = _tone(1000.0, orig, 1.0)
    y = resample(x, orig, SR)
    assert y.shape[-1] == math.ceil(x.shape[-1] * SR / orig)
    interior = slice(800, -800)  # away from the zero-padded edges
    expected = _tone(1000.0, SR, 1.0)[: y.shape[-1]]
    assert (y - expected)[interior].abs().max() < 1e-4
    spectrum = torch.fft.rfft(y[interior] * torch.hann_window(y[interior].shape[-1], dtype=y.dtype))
    peak_hz = spectrum.abs().argmax().item() * SR / y[interior].shape[-1]
    assert abs(peak_hz - 1000.0) < 2.0


@pytest.mark.parametrize("orig, freq", [(44100, 12000.0), (48000, 9000.0), (44100, 19000.0)])
def test_energy_above_the_new_nyquist_is_suppressed(orig, freq):
    x = _tone(freq, orig, 1.0)  # would alias to 16000 - freq without a low-pass
    y = resample(x, orig, SR)[800:-800]
    assert y.pow(2).mean().sqrt() < 1e-4 * x.pow(2).mean().sqrt()  # below -80 dB
    passband = resample(_tone(7000.0, orig, 1.0), orig, SR)[800:-800]
    assert abs(passband.pow(2).mean().sqrt().item() - math.sqrt(0.5)) < 1e-3  # 7 kHz still passes


def test_resampler_paths_agree_and_odd_rates_stay_bounded():
    x = torch.from_numpy(np.stack([synth(0.2, 12345, seed=1), synth(0.2, 12345, seed=2)])).double()
    conv, table, interp = (Resampler()(x, 12345, SR, path=p) for p in ("conv", "table", "interp"))
    assert (conv - table).abs().max() < 1e-6 and (conv - interp).abs().max() < 1e-6
    odd_in = torch.from_numpy(synth(0.25, 44101))  # gcd 1: no (16000, 44477) conv table, a phase table
    odd = Resampler()(odd_in, 44101, SR)
    assert odd.shape == (math.ceil(odd_in.shape[0] * SR / 44101),)
    assert torch.isfinite(odd).all()
    stereo = Resampler()(x.float(), 12345, SR)
    assert stereo.shape[0] == 2 and torch.allclose(stereo[1], Resampler()(x[1].float(), 12345, SR))


# -- decoding and validation --------------------------------------------------------------------
@pytest.mark.parametrize("fmt, subtype, tol", [("WAV", "PCM_16", 0), ("FLAC", "PCM_24", 0), ("OGG", "VORBIS", 0.05)])
def test_decodes_wav_flac_ogg_stereo_and_downmixes(fmt, subtype, tol):
    left, right = synth(0.8, 22050, kind="tone"), synth(0.8, 22050, kind="chirp")
    data = encoded(np.stack([left, right]), 22050, fmt, subtype)
    wave, rate = decode_audio(data, what="items[0]", max_seconds=10)
    assert rate == 22050 and wave.shape[0] == 2 and wave.dtype == torch.float32
    assert abs(wave.shape[1] - len(left)) <= (0 if tol == 0 else 2048)
    n = min(wave.shape[1], len(left))
    assert (downmix(wave)[:n] - torch.from_numpy((left + right)[:n] / 2)).abs().max() <= tol + 1e-4


@pytest.mark.parametrize("make, message", [
    (lambda: decode_audio(b"", what="items[2]", max_seconds=5), "items[2]: empty audio data"),
    (lambda: decode_audio(b"RIFF....not audio at all", what="items[2]", max_seconds=5),
     "items[2]: cannot decode audio bytes"),
    (lambda: decode_audio(encoded(synth(2.0), SR, "FLAC"), what="items[2]", max_seconds=1.5),
     "items[2]: audio is 2.0 s long; this server accepts at most 1.5 s"),
    (lambda: pcm_audio(torch.tensor([0.1, float("nan")]), SR, what="items[2]", max_seconds=5),
     "items[2]: audio contains NaN or infinite samples"),
    (lambda: pcm_audio(torch.tensor([0.1, float("inf")]), SR, what="items[2]", max_seconds=5), "NaN or infinite"),
    (lambda: pcm_audio(torch.zeros(0), SR, what="items[2]", max_seconds=5), "items[2]: audio holds no samples"),
    (lambda: pcm_audio(torch.zeros(3, 0), SR, what="items[2]", max_seconds=5), "items[2]: audio holds no samples"),
    (lambda: pcm_audio(torch.zeros(10, dtype=torch.int16), SR, what="items[2]", max_seconds=5),
     "items[2]: pcm must be floating point"),
    (lambda: pcm_audio(torch.zeros(10), 0, what="items[2]", max_seconds=5), "items[2]: pcm needs its sample_rate"),
    (lambda: pcm_audio(torch.zeros(10), 100, what="items[2]", max_seconds=5), "sample rate 100 Hz is outside"),
    (lambda: pcm_audio(torch.zeros(16000, 2), SR, what="items[2]", max_seconds=5), "channels first"),
    (lambda: pcm_audio(torch.zeros(2, 3, 4), SR, what="items[2]", max_seconds=5), "must be (N,) or (C, N)"),
    (lambda: pcm_audio(torch.zeros(SR * 3), SR, what="items[2]", max_seconds=2.5), "at most 2.5 s"),
])
def test_bad_audio_is_invalid_argument_naming_the_item(make, message):
    with pytest.raises(InvalidArgument) as err:
        make()
    assert message in str(err.value)


def test_pcm_channels_first_and_dtypes():
    stereo = torch.from_numpy(np.stack([synth(0.1), synth(0.1, seed=3)]))
    wave, rate = pcm_audio(stereo.to(torch.bfloat16), 44100, what="items[0]", max_seconds=1)
    assert wave.dtype == torch.float32 and wave.shape == stereo.shape and rate == 44100
    mono, _ = pcm_audio(stereo[0].double(), SR, what="items[0]", max_seconds=1)
    assert mono.shape == (1, stereo.shape[1]) and torch.equal(downmix(mono), stereo[0])
