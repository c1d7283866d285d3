"""services/audio_encoder/wav.py against libsndfile (soundfile), the reader it stands in for.

What the numpy reader takes must give soundfile's float32 samples bit for bit; what it does
not take (None) goes to soundfile, so the service's answers and errors are the same either way.
"""

from __future__ import annotations

import io
import re
import struct

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modalmesh.errors import InvalidArgument
from services.audio_encoder import audio
from services.audio_encoder.audio import decode_audio
from services.audio_encoder import wav as wav_module
from services.audio_encoder.wav import parse_wav


def soundfile_only(data: bytes, *, what: str, max_seconds: float):
    """decode_audio as it was: every sample read by libsndfile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(audio, "parse_wav", lambda data: None)
        return decode_audio(data, what=what, max_seconds=max_seconds)


def wav_bytes(samples: np.ndarray, rate: int, subtype: str, fmt: str = "WAV") -> bytes:
    """samples: (N, C) in the dtype soundfile writes as is (int16 / int32 / float)."""
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def reference(data: bytes) -> np.ndarray:
    samples, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples.T


def full_range(subtype: str, frames: int, channels: int, seed: int = 0) -> np.ndarray:
    """Samples that reach every code's extremes: integers written as int32 (libsndfile keeps the top bits),
    floats with values beyond [-1, 1] and float64 detail that float32 must round."""
    rng = np.random.default_rng(seed)
    if subtype in ("FLOAT", "DOUBLE"):
        x = rng.standard_normal((frames, channels)) * 0.7
        x[:4] = [[1.0], [-1.0], [3.5], [1e-30]]
        return x.astype(np.float64)
    x = rng.integers(-(2**31), 2**31, size=(frames, channels), dtype=np.int64)
    x[:3] = [[2**31 - 1], [-(2**31)], [0]]
    return x.astype(np.int32)


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE"])
@pytest.mark.parametrize("channels", [1, 2, 3])  # three channels: libsndfile writes WAVE_FORMAT_EXTENSIBLE
def test_samples_are_soundfiles_bit_for_bit(subtype, channels):
    data = wav_bytes(full_range(subtype, 999, channels), 22050, subtype)
    wav = parse_wav(data)
    assert wav is not None, "a plain WAV must take the numpy path"
    assert (wav.rate, wav.channels, wav.frames) == (22050, channels, 999)
    ours, theirs = wav.samples(), reference(data)
    assert ours.dtype == np.float32 and ours.flags.c_contiguous
    np.testing.assert_array_equal(ours, theirs)


def test_the_load_generators_clips_take_the_numpy_path(monkeypatch):
    """bench/encode_load.py's Whisper clips (16 kHz PCM_16 mono): decode_audio gives soundfile's result
    without soundfile reading a sample."""
    x = np.sin(np.arange(16000 * 3) / 7).astype(np.float32) * 0.3
    data = wav_bytes(x, 16000, "PCM_16")
    with monkeypatch.context() as patch:
        patch.setattr(sf, "read", None)  # called, it would raise: decode_audio must not call it
        wave, rate = decode_audio(data, what="items[0]", max_seconds=30)
    ref, ref_rate = soundfile_only(data, what="items[0]", max_seconds=30)
    assert rate == ref_rate == 16000 and torch.equal(wave, ref)


def chunk(name: bytes, body: bytes) -> bytes:
    return struct.pack("<4sI", name, len(body)) + body + (b"\0" if len(body) % 2 else b"")


def riff(*chunks: bytes) -> bytes:
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def fmt_chunk(tag=1, channels=1, rate=8000, bits=16, block=None, byte_rate=None) -> bytes:
    block = channels * bits // 8 if block is None else block
    byte_rate = rate * block if byte_rate is None else byte_rate
    return chunk(b"fmt ", struct.pack("<HHIIHH", tag, channels, rate, byte_rate, block, bits))


def test_chunks_before_the_data_are_skipped_with_their_padding():
    pcm = np.arange(-50, 50, dtype="<i2").tobytes()
    software = b"INFO" + chunk(b"ISFT", b"Lavf61.7.100\0")  # what ffmpeg writes before the data
    data = riff(chunk(b"JUNK", b"odd"), fmt_chunk(), chunk(b"LIST", software), chunk(b"data", pcm),
                chunk(b"LIST", b"after"))
    wav = parse_wav(data)
    assert wav is not None and wav.frames == 100
    np.testing.assert_array_equal(wav.samples(), reference(data))
    wave, rate = decode_audio(data, what="items[0]", max_seconds=60)
    assert rate == 8000 and np.array_equal(wave.numpy(), reference(data))


def test_libsndfile_still_judges_the_header():
    """A LIST chunk libsndfile cannot parse makes it refuse the file; the numpy reader would have read it,
    but the service refuses it as before."""
    data = riff(fmt_chunk(), chunk(b"LIST", b"INFOxxxxx"), chunk(b"data", b"\0" * 8))
    assert parse_wav(data) is not None
    with pytest.raises(InvalidArgument, match=re.escape("items[0]: cannot decode audio bytes")):
        decode_audio(data, what="items[0]", max_seconds=60)


@pytest.mark.parametrize("name, make", [
    ("FLAC", lambda: wav_bytes(full_range("PCM_32", 100, 1).astype(np.int16), 8000, "PCM_16", fmt="FLAC")),
    ("OGG", lambda: wav_bytes(np.zeros(4000), 8000, "VORBIS", fmt="OGG")),
    ("RF64", lambda: wav_bytes(np.zeros(100), 8000, "PCM_16", fmt="RF64")),
    ("u-law", lambda: wav_bytes(np.zeros(100), 8000, "ULAW")),
    ("IMA ADPCM", lambda: wav_bytes(np.zeros(1000), 8000, "IMA_ADPCM")),
    ("cut short", lambda: wav_bytes(np.zeros(100), 8000, "PCM_16")[:-10]),
    ("RIFF size too large", lambda: riff(fmt_chunk(), chunk(b"data", b"\0" * 20)) + b"\0\0"),
    ("a partial frame", lambda: riff(fmt_chunk(channels=2), chunk(b"data", b"\0" * 6))),
    ("no fmt before data", lambda: riff(chunk(b"data", b"\0" * 4), fmt_chunk())),
    ("two fmt chunks", lambda: riff(fmt_chunk(), fmt_chunk(bits=8), chunk(b"data", b"\0" * 4))),
    ("a block alignment that disagrees", lambda: riff(fmt_chunk(block=4), chunk(b"data", b"\0" * 8))),
    ("12-bit samples", lambda: riff(fmt_chunk(bits=12), chunk(b"data", b"\0" * 8))),
    ("no channels", lambda: riff(fmt_chunk(channels=0, block=2), chunk(b"data", b"\0" * 8))),
    ("a byte rate that disagrees", lambda: riff(fmt_chunk(byte_rate=7), chunk(b"data", b"\0" * 8))),
    ("not RIFF", lambda: b"RIFX" + wav_bytes(np.zeros(10), 8000, "PCM_16")[4:]),
])
def test_what_it_does_not_take_goes_to_soundfile(name, make):
    data = make()
    assert parse_wav(data) is None, name
    try:
        ref = soundfile_only(data, what="items[0]", max_seconds=60)
    except InvalidArgument as exc:
        with pytest.raises(InvalidArgument) as err:
            decode_audio(data, what="items[0]", max_seconds=60)
        assert str(err.value) == str(exc)
    else:
        wave, rate = decode_audio(data, what="items[0]", max_seconds=60)
        assert rate == ref[1] and torch.equal(wave, ref[0])


def test_a_cut_wav_is_still_refused_as_truncated():
    data = wav_bytes(np.zeros(1000, dtype=np.int16), 8000, "PCM_16")[:-100]
    with pytest.raises(InvalidArgument, match=re.escape("items[3]: the audio file is truncated")):
        decode_audio(data, what="items[3]", max_seconds=60)


def test_a_long_clip_is_refused_from_the_header_before_any_sample_is_converted(monkeypatch):
    data = wav_bytes(np.zeros((8000 * 3, 2), dtype=np.int16), 8000, "PCM_16")
    converted = []
    monkeypatch.setattr(wav_module.Wav, "samples", lambda self: converted.append(1))
    with pytest.raises(InvalidArgument) as ours:
        decode_audio(data, what="items[1]", max_seconds=2.5)
    with pytest.raises(InvalidArgument) as theirs:
        soundfile_only(data, what="items[1]", max_seconds=2.5)
    assert str(ours.value) == str(theirs.value) == "items[1]: audio is 3.0 s long; this server accepts at most 2.5 s"
    assert not converted


@pytest.mark.parametrize("value, message", [(float("nan"), "NaN or infinite"), (float("-inf"), "NaN or infinite")])
def test_float_wavs_are_still_scanned_for_nan(value, message):
    x = np.zeros(100, dtype=np.float32)
    x[50] = value
    data = wav_bytes(x, 8000, "FLOAT")
    assert parse_wav(data) is not None
    with pytest.raises(InvalidArgument, match=message):
        decode_audio(data, what="items[0]", max_seconds=60)


def test_a_rate_out_of_range_is_refused_as_before():
    data = riff(fmt_chunk(rate=500), chunk(b"data", b"\0" * 8))
    assert parse_wav(data) is not None
    with pytest.raises(InvalidArgument, match="sample rate 500 Hz is outside"):
        decode_audio(data, what="items[0]", max_seconds=60)


_SEEDS = [wav_bytes(full_range(s, 40, c), 11025, s) for s, c in
          [("PCM_16", 1), ("PCM_24", 2), ("PCM_U8", 1), ("FLOAT", 3), ("DOUBLE", 1), ("PCM_32", 2)]]


def outcome(decode, data: bytes):
    try:
        wave, rate = decode(data, what="items[0]", max_seconds=60)
    except InvalidArgument:
        return "refused"
    return rate, wave.numpy().tobytes(), tuple(wave.shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(_SEEDS), edits=st.lists(st.tuples(st.integers(0, 79), st.integers(0, 255)), max_size=4),
       cut=st.integers(0, 40))
def test_header_damage_never_makes_the_two_readers_disagree(seed, edits, cut):
    """Random bytes written over the first 80 bytes (RIFF, fmt, data headers) and a random cut: whatever
    the numpy reader takes gives soundfile's samples and rate; refusals stay refusals."""
    data = bytearray(seed)
    for at, value in edits:
        data[at] = value
    data = bytes(data[:len(data) - cut])
    if parse_wav(data) is None:
        return  # soundfile's path alone: nothing to compare
    assert outcome(decode_audio, data) == outcome(soundfile_only, data)
