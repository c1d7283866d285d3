"""Audio in: decode WAV / FLAC / OGG bytes or take raw PCM, downmix to mono, resample.

    wave, rate = decode_audio(data, what="items[0]", max_seconds=600)     # (C, N) float32, Hz
    wave, rate = pcm_audio(tensor, sample_rate, what="items[1]", max_seconds=600)
    mono = downmix(wave)                                                    # (N,)
    mono16k = resample(mono, rate, 16000)

Every problem with the input is an `InvalidArgument` whose message starts with
`what` (the item), so a client learns which item of a request was bad.

The resampler is a band-limited windowed-sinc interpolator (Kaiser window, the
parameters of resampy's / librosa's ``kaiser_best``), written in torch: the
signal is low-passed at ``rolloff * min(fs_in, fs_out) / 2`` and evaluated at
the output instants. When the reduced rate ratio ``fs_in/g : fs_out/g`` is
small (every common rate: 8, 11.025, 22.05, 24, 32, 44.1, 48, 96 kHz) the
filter is one polyphase table applied with a strided conv1d; for odd ratios
(44101 Hz, 96001 Hz) the taps are read from a fine table of the filter, in
chunks, so time and memory stay bounded whatever rate a client sends, and the
cost is checked before any work (`Resampler.work`, `max_work`).
"""

from __future__ import annotations

import functools
import io
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from modalmesh.errors import InvalidArgument
from services.audio_encoder.wav import parse_wav

MAX_CHANNELS = 64
MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 384_000  # the highest rate of common converters; beyond it only cost grows
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ---- decoding ---------------------------------------------------------------------------------


def decode_audio(data: bytes, *, what: str, max_seconds: float) -> tuple[torch.Tensor, int]:
    """Encoded file bytes (WAV, FLAC, OGG/Vorbis, anything libsndfile reads) -> ((C, N) float32, rate).

    libsndfile reads the header first and judges the file (errors, truncation, length): a file
    longer than `max_seconds` is refused before its samples are decoded (a few KB of FLAC can
    claim hours of silence). A plain PCM / float WAV whose layout wav.py reads the same way
    then has its samples converted with numpy (the same values, without libsndfile's block
    reads through Python callbacks); anything else is read by libsndfile.
    """
    import soundfile as sf

    if not data:
        raise InvalidArgument(f"{what}: empty audio data")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # LibsndfileError, RuntimeError, TypeError: all mean "not audio we can read"
        raise InvalidArgument(f"{what}: cannot decode audio bytes ({_short(e)}); send WAV, FLAC or OGG, "
                              "or raw samples as pcm") from None
    rate = int(info.samplerate)
    _check_rate(rate, what)
    truncated = _truncation(info.extra_info)
    if truncated:  # libsndfile reads what is there and says so only here: a shorter clip, silently
        raise InvalidArgument(f"{what}: the audio file is truncated ({truncated})")
    if info.frames > 0 and info.frames / rate > max_seconds:
        raise InvalidArgument(f"{what}: audio is {info.frames / rate:.1f} s long; this server accepts at most "
                              f"{max_seconds:g} s")
    wav = parse_wav(data)
    if wav is not None and wav.agrees(info.format, info.subtype, info.channels, rate, info.frames):
        wave = torch.from_numpy(wav.samples())
        _check_samples(wave, what, finite=not wav.is_float)
        return wave, rate
    limit = int(math.floor(max_seconds * rate)) + 1  # bounded read even when the header lies
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True, frames=limit)
    except Exception as e:
        raise InvalidArgument(f"{what}: cannot decode audio bytes ({_short(e)})") from None
    if samples.shape[0] / rate > max_seconds:
        raise InvalidArgument(f"{what}: audio is longer than the {max_seconds:g} s this server accepts")
    wave = torch.from_numpy(np.ascontiguousarray(samples.T))  # (C, N)
    _check_samples(wave, what)
    return wave, int(rate)


def pcm_audio(pcm: torch.Tensor, sample_rate: int, *, what: str, max_seconds: float) -> tuple[torch.Tensor, int]:
    """Raw samples in [-1, 1], (N,) mono or (C, N) channels-first -> ((C, N) float32, rate)."""
    if pcm.dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"{what}: pcm must be floating point samples in [-1, 1], got {pcm.dtype}")
    if sample_rate <= 0:
        raise InvalidArgument(f"{what}: pcm needs its sample_rate (Hz), got {sample_rate}")
    _check_rate(sample_rate, what)
    if pcm.dim() == 1:
        pcm = pcm.unsqueeze(0)
    elif pcm.dim() != 2:
        raise InvalidArgument(f"{what}: pcm must be (N,) or (C, N), got shape {list(pcm.shape)}")
    if pcm.shape[0] > MAX_CHANNELS:
        raise InvalidArgument(f"{what}: pcm shape {list(pcm.shape)} has {pcm.shape[0]} channels; expected (C, N) "
                              f"with C <= {MAX_CHANNELS} (channels first)")
    if pcm.shape[1] / sample_rate > max_seconds:
        raise InvalidArgument(f"{what}: audio is {pcm.shape[1] / sample_rate:.1f} s long; this server accepts at "
                              f"most {max_seconds:g} s")
    wave = pcm.to(torch.float32)
    _check_samples(wave, what)
    return wave, int(sample_rate)


def downmix(wave: torch.Tensor) -> torch.Tensor:
    """(C, N) -> (N,): the mean of the channels (what librosa / HF pipelines do)."""
    return wave[0] if wave.shape[0] == 1 else wave.mean(dim=0)


def _check_rate(rate: int, what: str) -> None:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidArgument(f"{what}: sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")


def _check_samples(wave: torch.Tensor, what: str, *, finite: bool = False) -> None:
    """`finite`: the samples cannot hold NaN or infinities (decoded from integers): no scan for them."""
    if wave.shape[-1] == 0 or wave.shape[0] == 0:
        raise InvalidArgument(f"{what}: audio holds no samples")
    if not finite and not bool(torch.isfinite(wave).all()):
        raise InvalidArgument(f"{what}: audio contains NaN or infinite samples")


def _truncation(extra_info: str) -> str | None:
    """libsndfile's note that a chunk is shorter than its header says ("data : 32000 (should be 22000)")."""
    notes = {line.split(":")[0].strip().lower(): " ".join(line.split())
             for line in extra_info.splitlines() if "should be" in line}
    return next((notes[chunk] for chunk in ("data", "ssnd", "riff", "form") if chunk in notes), None)


def _short(e: Exception) -> str:
    # No object reprs: "<_io.BytesIO object at 0x7f...>" would tell a client where our heap is.
    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(e))
    return " ".join(text.split())[:200] or type(e).__name__


# ---- resampling -------------------------------------------------------------------------------


class ResampleTooCostly(ValueError):
    """The resampling would cost more than the resampler's budget (checked before anything is allocated)."""


@dataclass(frozen=True)
class Resampler:
    """Kaiser-windowed sinc interpolation; defaults are resampy's ``kaiser_best``.

    Three paths, the cheapest that fits: a strided conv1d over one polyphase table (small reduced
    ratios: every common rate), a gather over a table of the n phases (larger n), and for any other
    ratio a gather whose taps are read from a fine table of the filter itself, linearly interpolated
    (resampy's scheme: its size depends on the filter, never on the rates). Every path costs about
    2 * width multiply-adds per output sample; a call whose total exceeds `max_work` is refused first.
    """

    zero_crossings: int = 64  # sinc lobes kept on each side of the centre
    rolloff: float = 0.9475937167399596  # cutoff as a fraction of the lower Nyquist frequency
    beta: float = 14.769656459379492  # Kaiser window shape
    max_table: int = 1 << 23  # largest filter table (entries) a path may build
    chunk_elems: int = 1 << 22  # gathered input samples per chunk on the gather paths (memory bound)
    precision: int = 1 << 12  # most phases per input sample in the interpolated path's table
    max_fine_table: int = 1 << 21  # entries of that table (float64), whatever the rates
    max_work: int = 4 * 10**9  # multiply-adds one call may cost (a few seconds of one core)

    def signature(self) -> str:
        return f"kaiser-sinc(z={self.zero_crossings},rolloff={self.rolloff!r},beta={self.beta!r})"

    @staticmethod
    def output_length(length: int, orig: int, new: int) -> int:
        """Samples out for `length` samples in: ceil(length * new / orig), known before any work
        (prepare counts rows from it while the resampling itself runs later, on the device)."""
        if orig == new:
            return length
        g = math.gcd(orig, new)
        return -(-length * (new // g) // (orig // g))

    def work(self, length: int, orig: int, new: int, channels: int = 1) -> int:
        """Multiply-adds of resampling `channels` rows of `length` samples from `orig` to `new` Hz."""
        if orig == new:
            return 0
        g = math.gcd(orig, new)
        o, n = orig // g, new // g
        width = math.ceil(self.zero_crossings / (self.rolloff * min(o, n) / o))
        return channels * -(-length * n // o) * 2 * width

    def check(self, length: int, orig: int, new: int, channels: int = 1) -> None:
        """Raise ResampleTooCostly when `work` exceeds `max_work`: callable where the samples are
        decoded (prepare), before the resampling itself runs elsewhere (the device path)."""
        work = self.work(length, orig, new, channels)
        if work > self.max_work:
            raise ResampleTooCostly(f"resampling {length} samples from {orig} to {new} Hz would take {work:.3g} "
                                    f"multiply-adds; the limit is {self.max_work:.3g}")

    def __call__(self, x: torch.Tensor, orig: int, new: int, *, path: str | None = None) -> torch.Tensor:
        """Resample the last dim of `x` from `orig` to `new` Hz; output length ceil(N * new / orig).

        `path` forces "conv", "table" or "interp" (tests); by default the cheapest that fits.
        Raises ResampleTooCostly, before any work, when the call would cost more than `max_work`.
        """
        if orig == new:
            return x
        g = math.gcd(orig, new)
        o, n = orig // g, new // g
        length = x.shape[-1]
        out_len = self.output_length(length, orig, new)
        r = self.rolloff * min(o, n) / o  # cutoff relative to the input Nyquist frequency
        width = math.ceil(self.zero_crossings / r)  # filter half-length, in input samples
        flat = x.reshape(-1, length)
        self.check(length, orig, new, flat.shape[0])
        if path is None:
            # conv1d spends 2*width + o multiply-adds per output (fast ones), the tables 2*width.
            conv_ok = n * (2 * width + o) <= self.max_table and o <= 8 * 2 * width
            path = "conv" if conv_ok else "table" if n * 2 * width <= self.max_table else "interp"
        if path == "conv":
            y = self._conv(flat, o, n, r, width, out_len)
        elif path in ("table", "interp"):
            y = self._gather(flat, o, n, r, width, out_len, table=path == "table")
        else:
            raise ValueError(f"path {path!r}: expected conv, table or interp")
        return y.reshape(*x.shape[:-1], out_len)

    def _taps(self, offset: torch.Tensor, r: float) -> torch.Tensor:
        """Filter weight at `offset` input samples from the output instant (float64)."""
        t = r * offset
        z = float(self.zero_crossings)
        arg = (1.0 - (t / z).clamp(-1, 1) ** 2).sqrt()
        window = torch.special.i0(self.beta * arg) / torch.special.i0(torch.tensor(self.beta, dtype=torch.float64))
        return torch.where(t.abs() <= z, r * torch.sinc(t) * window, torch.zeros_like(t))

    def _table(self, kind: str, o: int, n: int, device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """`_host_table` on `device` in `dtype`, kept there: an upload per call would be a pageable copy
        that waits for the device's queue (and the same few rates recur)."""
        if device is None or device.type == "cpu":
            table = self._host_table(kind, o, n)
            return table if dtype is None else table.to(dtype)
        return self._device_table(kind, o, n, device, dtype)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - a few rates recur; the instance is frozen and global
    def _device_table(self, kind: str, o: int, n: int, device: torch.device, dtype: torch.dtype | None):
        table = self._host_table(kind, o, n)
        return table.to(device, dtype or table.dtype)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a few rates recur; the instance is frozen and global
    def _host_table(self, kind: str, o: int, n: int) -> torch.Tensor:
        """Filter tables: "conv" (n, 2*width + o) taps aligned on blocks of o inputs, "phase" (n, 2*width)
        taps around floor(output instant) for each of the n phases (float32), or "fine" (P + 1, 2*width)
        taps for P evenly spaced phases and the end point (float64; its size depends on the filter only)."""
        r = self.rolloff * min(o, n) / o
        width = math.ceil(self.zero_crossings / r)
        if kind == "fine":
            k = torch.arange(-width + 1, width + 1, dtype=torch.float64)
            phases = self._phases(width)
            return self._taps(torch.arange(phases + 1, dtype=torch.float64)[:, None] / phases - k[None, :], r)
        if kind == "conv":
            k = torch.arange(-width, width + o, dtype=torch.float64)
            offsets = torch.arange(n, dtype=torch.float64)[:, None] * o / n - k[None, :]
        else:
            k = torch.arange(-width + 1, width + 1, dtype=torch.float64)
            offsets = torch.arange(n, dtype=torch.float64)[:, None] / n - k[None, :]
        return self._taps(offsets, r).to(torch.float32)

    def _phases(self, width: int) -> int:
        return max(64, min(self.precision, self.max_fine_table // (2 * width)))

    def _conv(self, x: torch.Tensor, o: int, n: int, r: float, width: int, out_len: int) -> torch.Tensor:
        # Output j = q*n + p sits at input time q*o + p*o/n. Block q reads inputs q*o - width ..
        # q*o + o + width - 1, so one (n, 2*width + o) table applied with stride o gives every phase.
        table = self._table("conv", o, n, x.device, x.dtype).unsqueeze(1)  # (n, 1, K)
        padded = torch.nn.functional.pad(x.unsqueeze(1), (width, width + o))
        y = torch.nn.functional.conv1d(padded, table, stride=o)  # (B, n, blocks)
        return y.transpose(1, 2).reshape(x.shape[0], -1)[:, :out_len]

    def _gather(self, x: torch.Tensor, o: int, n: int, r: float, width: int, out_len: int, *,
                table: bool) -> torch.Tensor:
        # Output j sits at input time base + frac, base = j*o // n, frac = (j*o mod n) / n: it reads
        # inputs base - width + 1 .. base + width. Weights depend only on the phase j*o mod n: one
        # (n, 2*width) table when it fits, else interpolated between the two nearest rows of the fine table.
        weights_of_phase = self._table("phase", o, n, x.device, x.dtype) if table else None
        fine = None if table else self._table("fine", o, n, x.device, x.dtype)
        phases = self._phases(width)
        padded = torch.nn.functional.pad(x, (width, width + 1))
        windows = [row.unfold(0, 2 * width, 1) for row in padded]  # (positions, 2*width) views
        out = x.new_empty(x.shape[0], out_len)
        chunk = max(1, self.chunk_elems // (2 * width))
        for start in range(0, out_len, chunk):
            # Indices made where the samples are: no host-to-device copy (and wait) per chunk.
            j = torch.arange(start, min(out_len, start + chunk), dtype=torch.int64, device=x.device)
            base, phase = j * o // n, j * o % n
            if weights_of_phase is not None:
                weights = weights_of_phase.index_select(0, phase)
            else:
                at = phase.to(torch.float64) * phases / n
                lo = at.floor().long().clamp(max=phases - 1)
                frac = (at - lo).to(dtype=x.dtype)[:, None]
                weights = torch.lerp(fine.index_select(0, lo), fine.index_select(0, lo + 1), frac)
            # Window starting at padded index base + 1 holds inputs base - width + 1 .. base + width.
            starts = base + 1
            for b, win in enumerate(windows):
                rows = win.index_select(0, starts)  # (chunk, 2*width)
                out[b, start:start + len(j)] = (rows.unsqueeze(1) @ weights.unsqueeze(2)).view(-1)
        return out


DEFAULT_RESAMPLER = Resampler()


def resample(x: torch.Tensor, orig: int, new: int, resampler: Resampler = DEFAULT_RESAMPLER) -> torch.Tensor:
    return resampler(x, orig, new)
