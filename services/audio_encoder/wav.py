"""Plain PCM / IEEE-float WAV read straight from the bytes, with numpy: the common case, without libsndfile.

    wav = parse_wav(data)      # Wav, or None: anything else goes to soundfile
    wav.agrees(info.format, info.subtype, info.channels, info.samplerate, info.frames)   # soundfile's sf.info
    wav.samples()              # (C, N) float32, the values soundfile's read(dtype="float32") gives

libsndfile reads a Python buffer through virtual-I/O callbacks, taking the GIL for every read
and copying every block: on the H200 host four threads preparing Whisper's 30 s clips were the
encoder service's only saturated resource, most of it there. A WAV is a header and an array, so
numpy takes it in one vectorised conversion (a 30 s 16 kHz clip: 0.09 ms against soundfile's
5.6 ms on a development machine). libsndfile still reads the header and judges the file (its
errors, its truncation notes, its length): the samples are taken here only when this reader
finds the layout libsndfile reports (`agrees`).

This reader takes only what it understands completely and returns None for the rest (RF64,
compressed formats, extensible formats other than PCM / float, odd block alignments, a RIFF or
data size that disagrees with the bytes, ...). Then soundfile decodes the file as before, and
its errors and its notes (truncation) stay the service's. What it does take gives exactly
libsndfile's float values: integers scaled by 1 / 2^(bits-1) (8-bit is unsigned, offset 128),
floats as they are (float64 rounded to float32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
# The GUID tail of WAVE_FORMAT_EXTENSIBLE's SubFormat: the first two bytes are the plain format tag.
_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
_INTS = {1: np.dtype("u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4")}  # 3 bytes: assembled below
_FLOATS = {4: np.dtype("<f4"), 8: np.dtype("<f8")}
_MAX_CHANNELS = 1024  # libsndfile's SF_MAX_CHANNELS: it refuses more, so this reader must too


@dataclass(frozen=True)
class Wav:
    body: memoryview  # the data chunk: whole frames
    channels: int
    width: int  # bytes per sample
    is_float: bool  # IEEE float samples may hold NaN or infinities; integer ones cannot
    rate: int

    @property
    def frames(self) -> int:
        return len(self.body) // (self.channels * self.width)

    @property
    def subtype(self) -> str:
        """libsndfile's name for the sample format."""
        return ("FLOAT", "DOUBLE")[self.width // 8] if self.is_float else ("PCM_U8", "PCM_16", "PCM_24",
                                                                            "PCM_32")[self.width - 1]

    def agrees(self, format: str, subtype: str, channels: int, rate: int, frames: int) -> bool:
        """True when libsndfile's view of the file (`soundfile.info`) is this reader's."""
        return (format in ("WAV", "WAVEX") and subtype == self.subtype and channels == self.channels
                and rate == self.rate and frames == self.frames)

    def samples(self) -> np.ndarray:
        """(C, N) float32, as libsndfile's float read gives them."""
        raw = np.frombuffer(self.body, dtype=np.uint8)
        width = self.width
        if self.is_float:
            values = raw.view(_FLOATS[width]).astype(np.float32)
        elif width == 1:
            values = raw.astype(np.float32)
            values -= 128.0
            values *= np.float32(1 / 128)
        elif width == 3:
            # Little-endian 24-bit, placed in the top three bytes of an int32 (as libsndfile does), then
            # scaled by 2^-31: every value is exact in float32.
            wide = np.zeros((len(raw) // 3, 4), dtype=np.uint8)
            wide[:, 1:] = raw.reshape(-1, 3)
            values = wide.view("<i4").reshape(-1).astype(np.float32)
            values *= np.float32(2.0**-31)
        else:
            values = raw.view(_INTS[width]).astype(np.float32)  # int32 rounds to nearest, as libsndfile's cast
            values *= np.float32(2.0 ** (1 - 8 * width))
        return np.ascontiguousarray(values.reshape(self.frames, self.channels).T)


def parse_wav(data: bytes | memoryview) -> Wav | None:
    """The layout of a canonical WAV file (its data chunk, not yet converted), or None when it is anything
    this reader does not fully take."""
    view = memoryview(data)
    if len(view) < 12 or view[0:4] != b"RIFF" or view[8:12] != b"WAVE":
        return None
    (riff_size,) = struct.unpack_from("<I", view, 4)
    if riff_size + 8 != len(view):  # libsndfile notes a mismatch ("should be"): its path decides
        return None
    fmt = None
    pos = 12
    while pos + 8 <= len(view):
        chunk, size = struct.unpack_from("<4sI", view, pos)
        body = pos + 8
        if chunk == b"fmt ":
            if fmt is not None or body + size > len(view):
                return None
            fmt = _format(view[body:body + size])
            if fmt is None:
                return None
        elif chunk == b"data":
            if fmt is None or body + size > len(view):  # data before its format, or cut short
                return None
            channels, width, is_float, rate = fmt
            if size % (channels * width):  # a partial last frame: libsndfile's path decides what it means
                return None
            return Wav(view[body:body + size], channels, width, is_float, rate)
        elif body + size > len(view):
            return None
        pos = body + size + (size & 1)  # chunks are padded to an even length
    return None


def _format(body: memoryview) -> tuple[int, int, bool, int] | None:
    """(channels, bytes per sample, is_float, rate) of a fmt chunk this reader takes, else None."""
    if len(body) < 16:
        return None
    tag, channels, rate, byte_rate, block_align, bits = struct.unpack_from("<HHIIHH", body, 0)
    if tag == _EXTENSIBLE:
        if len(body) < 40:
            return None
        cb_size, valid_bits, _mask = struct.unpack_from("<HHI", body, 16)
        sub_format = bytes(body[24:40])
        if cb_size < 22 or valid_bits != bits or sub_format[2:] != _GUID_TAIL:
            return None
        (tag,) = struct.unpack_from("<H", sub_format, 0)
    width = bits // 8
    if bits % 8 or not 0 < channels <= _MAX_CHANNELS or rate == 0:
        return None
    if block_align != channels * width or byte_rate != rate * block_align:
        return None
    if tag == _PCM and width in (1, 2, 3, 4):
        return channels, width, False, rate
    if tag == _FLOAT and width in _FLOATS:
        return channels, width, True, rate
    return None

