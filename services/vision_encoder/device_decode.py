"""JPEG decoding on the encoder's GPU (nvJPEG, through nvImageCodec), with PIL for everything else.

    decoder = jpeg_decoder("auto", device, preprocess="device")   # NvJpegDecoder, or None: PIL decodes all
    if decoder and decoder.takes(header, data): ...                # prepare (CPU thread): the header alone
    images = decoder.decode([data, ...])                           # encode (worker): (H, W, 3) uint8 on the device
    upright = orient(image, header.orientation)                    # EXIF orientation, as exif_transpose does it

Why: on the device preprocessing path the CPU threads still decoded every image with
PIL and copied its pixels three times on the host (tobytes, numpy, pinned staging).
Under load (issue 18, SigLIP, 512x384 JPEGs) PIL's decode was the preparing threads'
largest item in py-spy while the GPU sat half idle. Here `prepare` only parses the
header and hashes; the compressed bytes stay as they came, the worker decodes the
batch's JPEGs in one nvImageCodec call on its own stream, and device_preprocess.py
resizes the decoded pixels where they already are.

Which images the device decodes (`takes`): a JPEG that PIL reads as RGB or L, without
Adobe's APP14 marker (RGB- or CMYK-coded streams), with a readable EXIF orientation,
decoded at full size (not PIL's draft), at most `MAX_PIXELS`, with one 8-bit Huffman
frame header whose size is PIL's (`frame`), and ending in an EOI marker: a truncated
file, which PIL refuses, must not turn into a half-grey picture.
Everything else (PNG, WebP, CMYK, very large JPEGs) is decoded by PIL in `prepare`
as before. A JPEG nvImageCodec fails on is decoded again by PIL in the worker; if PIL
fails too, that item's caller alone gets the INVALID_ARGUMENT.

How close to PIL (libjpeg-turbo's ISLOW IDCT and "fancy" chroma upsampling): nvJPEG
is asked for fancy upsampling too (`OPTIONS`); its IDCT is its own. The difference is
measured on a GPU in tests/test_device_decode_cuda.py and stated in docs/architecture.md.
Which decoder made the pixels is part of the cache key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from modalmesh.errors import ConfigError

log = logging.getLogger(__name__)

CHOICES = ("auto", "pil", "nvimgcodec")
MAX_PIXELS = 4096 * 4096  # larger JPEGs are decoded by PIL: a batch of them would take GBs of device memory
CHUNK_BYTES = 256 << 20  # decoded bytes one decode call may produce; a batch past it is decoded in parts
# libjpeg-turbo (PIL) upsamples chroma with a triangle filter; nvJPEG duplicates samples unless asked.
OPTIONS = ":fancy_upsampling=1"
EOI = b"\xff\xd9"
# nvImageCodec's backends allowed for JPEG, all with output in device memory: the hardware decoder (A100,
# H100/H200), nvJPEG's CUDA decoder, and nvJPEG's hybrid (Huffman on the CPU, in nvImageCodec's threads).
BACKENDS = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")


def _probe_jpeg() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 100, 50)).save(buffer, format="JPEG")
    return buffer.getvalue()


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """An (H, W, C) image turned upright by its EXIF orientation, exactly as ImageOps.exif_transpose
    turns PIL's (a copy where it flips; orientation 1, or anything outside 2-8, returns `image` itself)."""
    if orientation == 2:
        return image.flip(1)  # FLIP_LEFT_RIGHT
    if orientation == 3:
        return image.flip(0, 1)  # ROTATE_180
    if orientation == 4:
        return image.flip(0)  # FLIP_TOP_BOTTOM
    if orientation == 5:
        return image.transpose(0, 1)  # TRANSPOSE
    if orientation == 6:
        return image.transpose(0, 1).flip(1)  # ROTATE_270: a quarter turn clockwise
    if orientation == 7:
        return image.transpose(0, 1).flip(0, 1)  # TRANSVERSE
    if orientation == 8:
        return image.transpose(0, 1).flip(0)  # ROTATE_90: a quarter turn anticlockwise
    return image


def upright_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    """(width, height) after `orient`: orientations 5-8 swap them."""
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def takes(header, data: bytes) -> bool:
    """Whether the device decoder should decode this image (`header`: preprocess.image_header's)."""
    return (header.format == "JPEG" and header.mode in ("RGB", "L") and not header.adobe
            and header.reduce == 1 and header.orientation != 0 and header.width * header.height <= MAX_PIXELS
            and data.rstrip(b"\0").endswith(EOI) and frame(data) == (header.width, header.height))


# Start-of-frame markers nvJPEG decodes: baseline, extended and progressive Huffman coding. The others
# (lossless, arithmetic, hierarchical) it refuses, and PIL would then decode them one by one in the worker.
HUFFMAN_FRAMES = (0xC0, 0xC1, 0xC2)
_FRAMES = tuple(m for m in range(0xC0, 0xD0) if m not in (0xC4, 0xC8, 0xCC))  # 0xC4 DHT, 0xC8 JPG, 0xCC DAC


def frame(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG's one 8-bit Huffman frame, read from its markers up to the first scan; None
    for any other frame, a second frame header (PIL's header and nvJPEG's could then disagree on the size
    that every limit was checked against) or a stream this walk cannot follow."""
    found, i = None, 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA:  # start of scan: the headers are over
            return found
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if length < 2:
            return None
        if marker in _FRAMES:
            if found is not None or marker not in HUFFMAN_FRAMES or i + 9 > len(data) or data[i + 4] != 8:
                return None
            found = (int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big"))
        i += 2 + length
    return None


class NvJpegDecoder:
    """Batched JPEG decoding with nvImageCodec on one CUDA device, on a stream of its own; the caller's
    current stream waits for the results."""

    name = "nvimgcodec"

    def __init__(self, device: torch.device | str, backends: Sequence[str] = BACKENDS):
        from nvidia import nvimgcodec  # the optional extra: pip install 'modalmesh[nvimgcodec]'

        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._codec = nvimgcodec
        self.backends = tuple(backends)
        self._decoder = nvimgcodec.Decoder(
            device_id=index, options=OPTIONS,
            backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, b)) for b in self.backends])
        # EXIF orientation is applied by `orient`, one rule for both decoders.
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB)
        # nvImageCodec's output buffers, handed back for reuse: a fresh one per image would be an
        # allocation and a free on the device for every image of every batch.
        self._buffers: list = []
        self._copied: torch.cuda.Event | None = None  # recorded after the last batch's copies out of them
        # Decoding runs on a stream of its own. On the caller's stream it waited for the forward queued
        # there before it, and the worker's calls into nvImageCodec (decode, then __dlpack__) blocked until
        # then: 62 % of the worker's time in a py-spy profile under load, the GPU 60 % busy.
        self._stream = torch.cuda.Stream(self.device)
        # nvImageCodec starts without nvJPEG (it only logs), and then every decode fails: find out now.
        if self.decode([_probe_jpeg()])[0] is None:
            raise RuntimeError(f"nvImageCodec decoded no JPEG with backends {self.backends} (is nvJPEG installed? "
                               f"pip install nvidia-nvjpeg)")

    def decode(self, jpegs: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each JPEG as an (H, W, 3) uint8 tensor of the caller's own, ready for work queued on the caller's
        current stream after this call; None where nvImageCodec could not decode it."""
        if not jpegs:
            return []
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            out = self._decode(jpegs, caller)
        caller.wait_event(self._copied)  # the caller's next work waits for the copies, on the GPU only
        return out

    def _decode(self, jpegs: Sequence[bytes], caller: torch.cuda.Stream) -> list[torch.Tensor | None]:
        stream = self._stream
        streams, where = [], []
        for i, data in enumerate(jpegs):
            try:
                streams.append(self._codec.CodeStream(data))  # parses the header: a bad one raises
                where.append(i)
            except Exception as e:  # noqa: BLE001 - that item is decoded by PIL instead (or refused by it)
                log.debug("nvImageCodec cannot read JPEG %d of the batch: %s", i, e)
        images: list = [None] * len(jpegs)
        if streams:
            reuse = self._buffers[:len(streams)] if len(self._buffers) >= len(streams) else None
            if reuse is not None and self._copied is not None:
                # The last batch's copies out of these buffers must be done before they are written again;
                # nvImageCodec is given the stream, but that it orders its writes after the stream's work is
                # not documented. The wait is for the last batch's preprocessing, not its forward.
                self._copied.synchronize()
            try:
                decoded = self._decoder.decode(streams, images=reuse, params=self._params,
                                               cuda_stream=stream.cuda_stream)
            except Exception as e:  # noqa: BLE001 - the whole call failed: PIL decodes the batch's JPEGs
                log.warning("nvImageCodec failed on a batch of %d JPEGs (%s); PIL decodes them", len(streams), e)
                decoded = [None] * len(streams)
            pool = [image for image in decoded if image is not None]
            pool += [b for b in self._buffers[len(streams):] if all(b is not p for p in pool)]
            self._buffers, kept = [], 0
            for buffer in pool:  # a buffer keeps its largest size: keep at most CHUNK_BYTES of them
                kept += buffer.capacity
                if kept > CHUNK_BYTES:
                    break
                self._buffers.append(buffer)
            for i, image in zip(where, decoded):
                images[i] = image
        out: list[torch.Tensor | None] = []
        for image in images:
            if image is None:
                out.append(None)
                continue
            try:
                if image.buffer_kind != self._codec.ImageBufferKind.STRIDED_DEVICE:
                    image = image.cuda()  # a CPU backend took it (not in BACKENDS, but nvImageCodec decides)
                pixels = torch.from_dlpack(image)  # synchronised with the decode stream (the current one)
                if pixels.ndim != 3 or pixels.shape[2] != 3:
                    out.append(None)
                    continue
                pixels = pixels.clone()
            except Exception as e:  # noqa: BLE001 - e.g. out of device memory: PIL decodes this one
                log.warning("could not take a decoded JPEG off nvImageCodec (%s); PIL decodes it", e)
                out.append(None)
                continue
            pixels.record_stream(caller)  # made here, used and freed on the caller's stream
            out.append(pixels)
        self._copied = torch.cuda.Event()
        self._copied.record(stream)
        return out


def jpeg_decoder(choice: str, device: torch.device | str, preprocess: str):
    """The decoder for `--image-decode` (None: PIL decodes every image in `prepare`). "auto" takes
    nvImageCodec when the pixels are preprocessed on a CUDA device and it loads; "nvimgcodec" insists."""
    if choice not in CHOICES:
        raise ConfigError(f"image_decode must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "pil":
        return None
    device = torch.device(device)
    why_not = None
    if device.type != "cuda":
        why_not = f"nvJPEG runs on CUDA and the encoder runs on {device}"
    elif preprocess != "device":
        why_not = (f"it decodes onto the device that preprocesses, and images are preprocessed on the CPU "
                   f"(--preprocess-device {preprocess})")
    else:
        try:
            return NvJpegDecoder(device)
        except ImportError as e:
            why_not = f"nvImageCodec is not installed (pip install 'modalmesh[nvimgcodec]'): {e}"
        except Exception as e:  # noqa: BLE001 - the library loads but cannot start here (no nvJPEG, old driver)
            why_not = f"nvImageCodec cannot start on {device}: {type(e).__name__}: {e}"
    if choice == "nvimgcodec":
        raise ConfigError(f"--image-decode nvimgcodec: {why_not}")
    log.info("images are decoded by PIL: %s", why_not)
    return None
