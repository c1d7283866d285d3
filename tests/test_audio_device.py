"""The audio encoder's device path (`--preprocess-device device`: resampling + log-mel in `encode`) against
the CPU path (in `prepare`, exact to HF's WhisperFeatureExtractor, tested in test_audio_features/models).

On a CPU device the device path runs the same arithmetic, so features and embeddings are equal exactly.
On CUDA (skipped without it) the difference is float rounding: log-mel features within LOGMEL_TOL_CUDA,
fp32 embeddings within EMBED_TOL_CUDA of the CPU path's on the same GPU (the bounds docs/architecture.md states).
"""

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny
from modalmesh.testing.precision import ieee_fp32_convolutions
from services.audio_encoder import flags as audio_flags
from services.audio_encoder.audio import Resampler, downmix
from services.audio_encoder.device_features import DeviceFeatures
from services.audio_encoder.features import FeatureConfig, LogMel
from services.audio_encoder.model import build_encoder_model
from services.audio_encoder.server import AudioEncoderService

SR = 16000
LOGMEL_TOL_CUDA = 5e-4  # log-mel units ((log10 + 4) / 4); HF parity of the CPU path is 1e-4
EMBED_TOL_CUDA = 1e-3  # relative to the embeddings' largest magnitude (fp32 tower on both)


def synth(seconds: float, rate: int, *, seed: int = 0, channels: int = 1) -> np.ndarray:
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    chirp = 0.3 * np.sin(2 * np.pi * (80 * t + 700 * t**2 / 2))
    rows = [0.4 * np.sin(2 * np.pi * (220 + 90 * c + 40 * seed) * t) + chirp + 0.05 * rng.standard_normal(n)
            for c in range(channels)]
    return np.stack(rows).astype(np.float32) if channels > 1 else rows[0].astype(np.float32)


def pcm_item(samples: np.ndarray, rate: int) -> pb.EncodeItem:
    return pb.EncodeItem(pcm=to_proto(torch.from_numpy(np.ascontiguousarray(samples))), sample_rate=rate)


def wav_item(samples: np.ndarray, rate: int) -> pb.EncodeItem:
    buf = io.BytesIO()
    sf.write(buf, samples.T if samples.ndim == 2 else samples, rate, format="WAV", subtype="FLOAT")
    return pb.EncodeItem(data=buf.getvalue())


def mixed_batch() -> list[pb.EncodeItem]:
    """Rates, lengths, channels and sources mixed; two clips span more than one 30 s window."""
    return [
        pcm_item(synth(3.3, SR, seed=1), SR),                            # 16 kHz mono pcm
        wav_item(synth(31.7, 44100, seed=2, channels=2), 44100),         # 44.1 kHz stereo WAV, 2 windows
        pcm_item(synth(0.9, 44100, seed=3, channels=2), 44100),          # 44.1 kHz stereo pcm (C, N)
        wav_item(synth(61.0, SR, seed=4), SR),                           # 16 kHz WAV, 3 windows
        pcm_item(synth(1.2, 44101, seed=5), 44101),                      # odd rate: the interpolated path
    ]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("audio_device_ckpts")


@pytest.fixture(scope="module", params=["whisper", "qwen2_audio"])
def checkpoint(request, root):
    return tiny.ensure(request.param, root)


def build(path, where, device="cpu", **options):
    return build_encoder_model(path, device=device, options={"preprocess_device": where, "warmup": False, **options})


def test_device_path_on_cpu_gives_the_cpu_paths_embeddings_exactly(checkpoint):
    host, dev = build(checkpoint, "cpu"), build(checkpoint, "device")
    assert not host.on_device and dev.on_device and host.describe()["preprocess"] == "cpu"
    assert dev.describe()["preprocess"] == "device:cpu"
    items = mixed_batch()
    a = [host.prepare(item, i) for i, item in enumerate(items)]
    b = [dev.prepare(item, i) for i, item in enumerate(items)]
    assert "mel" in a[0].inputs and "wave" in b[0].inputs and "mel" not in b[0].inputs
    for p, q in zip(a, b):
        assert p.cost == q.cost and p.meta == q.meta
        assert all(torch.equal(p.inputs[k], q.inputs[k]) for k in ("frames", "positions", "rows"))
    assert [p.meta["windows"] for p in a] == [1, 2, 1, 3, 1]
    for x, y in zip(host.encode(a), dev.encode(b)):
        assert x.valid_length == y.valid_length and torch.equal(x.embedding, y.embedding)
    # Which path made the features is part of the cache key.
    assert host.prepare(items[0], 0).cache_key != b[0].cache_key
    given = dev.prepare(items[0], 0, dev.cache_key(items[0], 0))  # the service hands over the key it made
    assert given.cache_key == b[0].cache_key and all(torch.equal(v, b[0].inputs[k]) for k, v in given.inputs.items())


@pytest.mark.parametrize("rate, seconds, channels", [(SR, 47.3, 1), (44100, 31.7, 2), (44101, 2.1, 1)])
def test_device_features_equal_the_cpu_paths_log_mel(rate, seconds, channels):
    cfg = FeatureConfig(n_mels=80)
    wave = downmix(torch.from_numpy(synth(seconds, rate, seed=9, channels=channels)).reshape(channels, -1))
    expected = LogMel(cfg)(Resampler()(wave, rate, SR)).mel
    other = torch.from_numpy(synth(5.0, 22050, seed=1))
    got = DeviceFeatures(cfg, Resampler(), "cpu")([wave, other], [rate, 22050])
    assert got.shape[0] == expected.shape[0] + 1 and torch.equal(got[:expected.shape[0]], expected)


def test_errors_name_the_item_in_prepare_before_any_device_work(checkpoint):
    model = build(checkpoint, "device")
    if model.packed:  # Qwen2-Audio pools: 100 samples give no row (Whisper's one frame gives one)
        with pytest.raises(InvalidArgument, match=r"items\[3\]: audio of 100 samples .* too short"):
            model.prepare(pcm_item(synth(100 / SR, SR), SR), 3)
    # 22057 samples at 44.1 kHz resample to ceil(22057 * 160 / 441) = 8003 samples: the rows are
    # counted from that arithmetic length, the same as from the CPU path's resampled clip.
    odd = pcm_item(synth(22057 / 44100, 44100), 44100)
    assert model.prepare(odd, 0).meta == build(checkpoint, "cpu").prepare(odd, 0).meta
    model.resampler = Resampler(max_work=10**6)  # the cost check runs in prepare, from the decoded length
    with pytest.raises(InvalidArgument, match=r"items\[2\]: resampling 44100 samples from 44100 to 16000 Hz"):
        model.prepare(pcm_item(synth(1.0, 44100), 44100), 2)


@pytest.mark.parametrize("length, orig", [(1, 44100), (276, 44100), (44101, 44101), (999, 8000), (12345, 48000)])
def test_output_length_is_the_resamplers(length, orig):
    x = torch.zeros(length)
    assert Resampler.output_length(length, orig, SR) == Resampler()(x, orig, SR).shape[-1]


def test_the_flag_reaches_the_model_options():
    args = audio_flags.parser().parse_args(["--model", "m", "--preprocess-device", "device"])
    assert AudioEncoderService.model_options(args)["preprocess_device"] == "device"
    assert audio_flags.parser().parse_args(["--model", "m"]).preprocess_device == "auto"
    with pytest.raises(SystemExit):
        audio_flags.parser().parse_args(["--model", "m", "--preprocess-device", "gpu"])


def test_auto_is_the_cpu_path_on_a_cpu_device(checkpoint):
    assert not build(checkpoint, "auto").on_device


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rate, seconds, channels", [(SR, 47.3, 1), (44100, 31.7, 2), (48000, 3.0, 1), (44101, 2.1, 1)])
def test_cuda_log_mel_is_within_the_stated_tolerance_of_the_cpu_path(rate, seconds, channels):
    cfg = FeatureConfig(n_mels=128)
    wave = downmix(torch.from_numpy(synth(seconds, rate, seed=9, channels=channels)).reshape(channels, -1))
    expected = LogMel(cfg)(Resampler()(wave, rate, SR)).mel
    got = DeviceFeatures(cfg, Resampler(), "cuda")([wave.cuda()], [rate])
    assert got.device.type == "cuda" and got.shape == expected.shape
    assert (got.cpu() - expected).abs().max().item() <= LOGMEL_TOL_CUDA


@pytest.fixture
def ieee_convolutions():
    with ieee_fp32_convolutions():
        yield


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_path_embeddings_match_the_cpu_path_and_staging_stays_warm(checkpoint, ieee_convolutions):
    host = build(checkpoint, "cpu", device="cuda")  # same tower, same GPU: only the features' path differs
    dev = build(checkpoint, "auto", device="cuda")
    assert not host.on_device and dev.on_device and dev.describe()["preprocess"] == "device:cuda"
    dev.module.load_state_dict(host.module.state_dict())  # the same (dummy) weights in both
    items = mixed_batch()
    expected = host.encode([host.prepare(item, i) for i, item in enumerate(items)])
    prepared = [dev.prepare(item, i) for i, item in enumerate(items)]
    for _ in range(2):  # warm-up: each of the staging's two buffers grows to this batch once
        got = dev.encode(prepared)
    grown = dev.staging.grown
    for _ in range(3):
        got = dev.encode(prepared)
    assert dev.staging.grown == grown
    for e, g in zip(expected, got):
        assert g.embedding.device.type == "cuda" and g.valid_length == e.valid_length
        assert g.embedding.shape == e.embedding.shape
        scale = e.embedding.abs().max().item()
        assert (g.embedding - e.embedding).abs().max().item() <= EMBED_TOL_CUDA * scale
