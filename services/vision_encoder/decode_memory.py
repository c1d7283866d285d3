"""Memory for decoding images: refused by decoded bytes, bounded across concurrent decodes, given back.

A 261 KB PNG can claim 8192 x 8192 RGBA: 268 MB once decoded, about 1.3 GB at the
peak of its conversion to RGB (transformers' order: composite onto white, then
resize). So an image is refused by what it decodes to (`DEFAULT_MAX_DECODED_BYTES`,
``--max-image-decoded-mb``), not by its pixel count alone, and every decode first
takes its estimated peak from one budget shared by the service's preparing
threads (``--decode-memory-mb``): concurrent large images wait for each other
instead of adding up. After a large decode the C heap is trimmed, so the memory
goes back to the system rather than staying held by the allocator.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from contextlib import contextmanager

from modalmesh.errors import InvalidArgument, ResourceExhausted

MiB = 1 << 20
DEFAULT_MAX_DECODED_BYTES = 8192 * 8192 * 3  # an 8192-square RGB image
DEFAULT_DECODE_MEMORY = 2048 * MiB
# Bytes per pixel of a decoded PIL image, by mode (anything else is taken as 4).
MODE_BYTES = {"1": 1, "L": 1, "P": 1, "RGB": 3, "RGBA": 4, "RGBX": 4, "CMYK": 4, "YCbCr": 3, "LA": 2, "PA": 2,
              "La": 2, "RGBa": 4, "I;16": 2, "I;16B": 2, "I;16L": 2, "I": 4, "F": 4, "LAB": 3, "HSV": 3}
TRIM_ABOVE = 64 * MiB


def decoded_bytes(width: int, height: int, mode: str) -> int:
    return width * height * MODE_BYTES.get(mode, 4)


def peak_bytes(width: int, height: int, mode: str) -> int:
    """Estimated peak of decode + conversion to RGB: with alpha, the decoded image, its RGBA copy, a white
    RGBA background and the composite (4 x 4 bytes a pixel) plus the RGB result; else decode + RGB."""
    if mode == "RGB":
        return decoded_bytes(width, height, mode) * 2
    return width * height * (4 * 4 + 3)


class DecodeBudget:
    """Bytes that the decodes in flight may hold together; `hold` waits (bounded) for its share."""

    def __init__(self, capacity: int, wait_s: float = 30.0):
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int, where: str, wait_s: float | None = None, what: str = "image"):
        """`wait_s`: how long to wait for room (None: the budget's own; 0: take it now or refuse)."""
        if nbytes > self.capacity:
            raise InvalidArgument(f"{where}: decoding this {what} would take about {nbytes / MiB:.0f} MiB; the "
                                  f"server decodes at most {self.capacity / MiB:.0f} MiB at once (--decode-memory-mb)")
        with self._cond:
            if not self._cond.wait_for(lambda: self.held + nbytes <= self.capacity,
                                       timeout=self.wait_s if wait_s is None else wait_s):
                raise ResourceExhausted(f"{where}: the server is busy decoding other large images or videos; "
                                        "try again")
            self.held += nbytes
        try:
            yield
        finally:
            with self._cond:
                self.held -= nbytes
                self._cond.notify_all()
            if nbytes > TRIM_ABOVE:
                trim_heap()


def trim_heap() -> None:
    """Give freed C-heap memory back to the system (glibc keeps large freed blocks otherwise)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
