"""Image decoding and preprocessing that reproduce the checkpoint's Hugging Face image processor.

No torchvision: PIL for decoding and resampling, numpy for the arithmetic, in the
same order and precision as transformers' PIL processors (``Qwen2VLImageProcessorPil``,
``SiglipImageProcessorPil``), so ``pixel_values`` match them bit for bit:

1. decode (every format PIL decodes by itself: FORMATS), refusing images larger than ``max_image_pixels``
   *before* the pixels are decoded (decompression bombs), EXIF orientation applied;
2. to RGB as the processor does it: anything with alpha (RGBA, LA, palette with
   transparency) is composited onto white, greyscale / palette / CMYK converted;
3. resize with PIL (the config's ``resample``, bicubic for both families) to
   ``smart_resize`` (Qwen2-VL: multiples of patch*merge within a pixel budget)
   or the fixed ``size`` (SigLIP);
4. rescale in float64 then cast to float32, normalise in float32 (``(x - mean) / std``);
5. Qwen2-VL: patchify to ``(grid_h * grid_w, C * temporal_patch * patch * patch)``
   rows in merge-block order, the frame repeated ``temporal_patch_size`` times.

A video's sampled frames (video.py) take steps 3-4 each, with the video processor's pixel budget
(`video_processor_config`) and one target size for all, then ``Qwen2VLVideoProcessor.patchify``: consecutive
frames grouped ``temporal_patch_size`` at a time (the last group padded by repeating the last frame),
``grid_t`` = the groups. transformers' video processor resizes with torchvision; here each frame is resized
as its PIL image processor resizes an image (torchvision cannot be installed beside this stack).

Errors are `InvalidArgument` naming the item (``items[3]: ...``): they reach the
client as INVALID_ARGUMENT and never affect other items.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import asdict, dataclass
from typing import NamedTuple
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from modalmesh import pb
from modalmesh.errors import ConfigError, InvalidArgument
from modalmesh.image_grid import MAX_ASPECT_RATIO, pixel_bounds, smart_resize  # noqa: F401 - re-exported
from modalmesh.rpc.codec import from_proto
from services.vision_encoder.decode_memory import DEFAULT_MAX_DECODED_BYTES, MiB, decoded_bytes

Image.init()  # every plugin registered, so FORMATS is every format this PIL opens
# Every format PIL decodes by itself (GIF and other multi-frame files: the first frame, as PIL opens them), less
# EPS, which PIL renders by running Ghostscript on the bytes (an outside program fed untrusted input), and the
# stub formats PIL recognises but cannot decode without a handler an application registers.
UNSAFE_OR_STUB_FORMATS = frozenset({"EPS", "BUFR", "GRIB", "HDF5", "MPEG", "WMF"})
FORMATS = tuple(sorted(set(Image.OPEN) - UNSAFE_OR_STUB_FORMATS))
ORIENTATION_TAG = 0x0112  # EXIF's Orientation, which ImageOps.exif_transpose undoes
from services.vision_encoder.flags import DEFAULT_MAX_IMAGE_PIXELS  # noqa: E402 - the flag's default
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The parts of ``preprocessor_config.json`` that change pixel values, with the processor's defaults."""

    kind: str  # "qwen2_vl" (native resolution, patchified) or "fixed" (resize to height x width)
    do_resize: bool = True
    resample: int = Image.Resampling.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True
    # qwen2_vl
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # fixed
    height: int = 224
    width: int = 224

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict, kind: str, **defaults) -> ImageProcessorConfig:
        """From a preprocessor_config.json dict. `defaults` fill keys it lacks (e.g. from the model config)."""
        size = raw.get("size") or {}
        values = dict(defaults)
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(key) is not None:
                values[key] = bool(raw[key])
        for key in ("resample",):
            if raw.get(key) is not None:
                values[key] = int(raw[key])
        if raw.get("rescale_factor") is not None:
            values["rescale_factor"] = float(raw["rescale_factor"])
        for key in ("image_mean", "image_std"):
            value = raw.get(key)
            if value is not None:
                values[key] = tuple(float(v) for v in (value if isinstance(value, list | tuple) else [value] * 3))
        if kind == "qwen2_vl":
            for key in ("patch_size", "temporal_patch_size", "merge_size"):
                if raw.get(key) is not None:
                    values[key] = int(raw[key])
            # transformers 5 writes size {shortest_edge, longest_edge}; 4 wrote min/max_pixels (top level
            # or inside size). The top-level keys win, as in the processor's __init__.
            lo, hi = pixel_bounds(raw)
            if lo is not None:
                values["min_pixels"] = int(lo)
            if hi is not None:
                values["max_pixels"] = int(hi)
        elif kind == "fixed":
            if "height" in size and "width" in size:
                values["height"], values["width"] = int(size["height"]), int(size["width"])
            elif "shortest_edge" in size:  # square models sometimes spell it this way
                values["height"] = values["width"] = int(size["shortest_edge"])
        else:
            raise ConfigError(f"unknown image processor kind {kind!r}")
        config = cls(kind=kind, **values)
        config.check()
        return config

    @classmethod
    def from_dir(cls, model_dir, kind: str, **defaults) -> ImageProcessorConfig:
        return cls.from_dict(_read_json(Path(model_dir) / "preprocessor_config.json"), kind, **defaults)

    def check(self) -> None:
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ConfigError(f"image_mean/image_std must have 3 entries and std > 0: {self.image_mean}, "
                              f"{self.image_std}")
        if self.kind == "qwen2_vl" and not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"preprocessor min_pixels {self.min_pixels} / max_pixels {self.max_pixels}: "
                              "need 0 < min <= max")
        if self.kind == "fixed" and min(self.height, self.width) <= 0:
            raise ConfigError(f"preprocessor size {self.height}x{self.width} must be positive")

    def digest(self) -> bytes:
        """Identifies every parameter here (part of each embedding-cache key)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return raw


# Qwen2VLVideoProcessor's own pixel budget, where its config file names none.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 28 * 28 * 768


def video_processor_dict(model_dir) -> dict:
    """The video processor's config as transformers finds it: video_preprocessor_config.json, else the image
    processor's preprocessor_config.json (AutoVideoProcessor's fallback)."""
    own = Path(model_dir) / "video_preprocessor_config.json"
    return _read_json(own if own.is_file() else Path(model_dir) / "preprocessor_config.json")


def video_processor_config(model_dir, **defaults) -> ImageProcessorConfig:
    """Qwen2-VL's video processor: the image processor's parameters, read from its config file, with the
    video processor's defaults (its pixel budget) where the file names none."""
    return ImageProcessorConfig.from_dict(video_processor_dict(model_dir), "qwen2_vl",
                                          **{"min_pixels": VIDEO_MIN_PIXELS, "max_pixels": VIDEO_MAX_PIXELS,
                                             **defaults})


# ---- decoding -------------------------------------------------------------------------------


class ImageHeader(NamedTuple):
    width: int
    height: int
    mode: str
    reduce: int = 1  # a JPEG over the decoded-bytes limit is decoded at 1/reduce scale (PIL's draft)
    format: str = ""  # PIL's name for the encoded format ("JPEG", "PNG", ...); "" for raw pixels
    orientation: int = 1  # the EXIF orientation tag (1: upright; 2-8: what exif_transpose undoes)
    adobe: bool = False  # a JPEG with Adobe's APP14 marker (RGB or CMYK coding, not JFIF's YCbCr)

    @property
    def decoded_size(self) -> tuple[int, int]:
        return -(-self.width // self.reduce), -(-self.height // self.reduce)


def image_header(item: pb.EncodeItem, index: int, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                 formats: tuple[str, ...] = FORMATS) -> ImageHeader:
    """The item's image size and mode from its header alone, checked against the limits: pixels, aspect
    ratio and decoded bytes. Nothing is decoded. A JPEG whose full decode would pass the bytes limit is
    decoded smaller (1/2, 1/4 or 1/8: the JPEG decoder's own scaling) when that fits; anything else is
    refused."""
    where = f"items[{index}]"
    source = item.WhichOneof("source")
    if source == "pixels":
        shape = tuple(item.pixels.shape)
        if len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] != 3):
            raise InvalidArgument(f"{where}.pixels: shape {list(shape)} is not (H, W, 3) RGB or (H, W) greyscale")
        header = int(shape[1]), int(shape[0]), "RGB" if len(shape) == 3 else "L"
        facts = {}
    elif source == "data":
        if not item.data:
            raise InvalidArgument(f"{where}: empty image data")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(item.data), formats=list(formats)) as image:
                    header = *image.size, image.mode
                    facts = _jpeg_facts(image) if image.format == "JPEG" else {"format": image.format or ""}
        except Image.DecompressionBombError as e:
            raise InvalidArgument(f"{where}: image too large to decode, refused before decoding ({e})") from None
        except Image.UnidentifiedImageError:
            raise InvalidArgument(f"{where}: data is not a decodable {_format_names(formats)} image "
                                  f"({len(item.data)} bytes starting {item.data[:8]!r})") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise InvalidArgument(f"{where}: corrupt or truncated image data ({type(e).__name__}: {e})") from None
    else:
        return decode_image(item, index, max_image_pixels=max_image_pixels, formats=formats)  # raises
    _check_size(header[0], header[1], where, max_image_pixels)
    size = decoded_bytes(*header)
    if size <= max_decoded_bytes:
        return ImageHeader(*header, **facts)
    if facts.get("format") == "JPEG":
        for reduce in (2, 4, 8):
            smaller = ImageHeader(*header, reduce, **facts)
            if decoded_bytes(*smaller.decoded_size, header[2]) <= max_decoded_bytes:
                return smaller
    raise InvalidArgument(f"{where}: a {header[0]}x{header[1]} {header[2]} image decodes to {size / MiB:.0f} MiB; "
                          f"the server's limit is {max_decoded_bytes / MiB:.0f} MiB (--max-image-decoded-mb)")


def _format_names(formats: tuple[str, ...]) -> str:
    """A short name for the accepted formats in an error (all of PIL's are too many to list)."""
    return "image format PIL decodes (PNG, JPEG, WebP, GIF, BMP, TIFF, ...):" if formats == FORMATS else "/".join(formats)


def _jpeg_facts(image: Image.Image) -> dict:
    """What a JPEG decoder other than PIL's needs to know (device_decode.py). An EXIF block PIL cannot
    read gives orientation 0, "unknown": such an image stays on PIL's path, which decides what it means."""
    try:
        value = image.getexif().get(ORIENTATION_TAG, 1)
        orientation = int(value) if value in range(2, 9) else 1  # exif_transpose leaves other values alone
    except Exception:  # noqa: BLE001 - any failure to read the EXIF block means "unknown"
        orientation = 0
    return {"format": "JPEG", "orientation": orientation, "adobe": "adobe" in image.info}


def decode_image(item: pb.EncodeItem, index: int, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 formats: tuple[str, ...] = FORMATS, reduce: int = 1) -> Image.Image:
    """The item's image, upright, not yet converted to RGB; InvalidArgument for anything unusable.
    `reduce` > 1 decodes a JPEG at that fraction of its size (see image_header)."""
    where = f"items[{index}]"
    source = item.WhichOneof("source")
    if source == "data":
        return _decode_bytes(item.data, where, max_image_pixels, formats, reduce)
    if source == "pixels":
        return _from_pixels(item.pixels, where, max_image_pixels)
    if source is None:
        raise InvalidArgument(f"{where}: no image: set data (PNG/JPEG/WebP bytes) or pixels (uint8 H x W x 3)")
    raise InvalidArgument(f"{where}: {source} is not an image input; the vision encoder takes data or pixels")


def _check_size(width: int, height: int, where: str, max_image_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise InvalidArgument(f"{where}: image has zero size ({width}x{height})")
    if width * height > max_image_pixels:
        raise InvalidArgument(f"{where}: image is {width}x{height} = {width * height} pixels, too large: the "
                              f"server's limit is {max_image_pixels} (--max-image-pixels)")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InvalidArgument(f"{where}: aspect ratio {max(width, height) / min(width, height):.0f} of a "
                              f"{width}x{height} image exceeds {MAX_ASPECT_RATIO}")


def _decode_bytes(data: bytes, where: str, max_image_pixels: int, formats: tuple[str, ...],
                  reduce: int = 1) -> Image.Image:
    if not data:
        raise InvalidArgument(f"{where}: empty image data")
    try:
        with warnings.catch_warnings():
            # Our own limit (checked below, before any pixel is decoded) is the one that counts.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(formats))
            _check_size(*image.size, where, max_image_pixels)
            if reduce > 1 and image.format == "JPEG":
                width, height = image.size
                image.draft(image.mode, (-(-width // reduce), -(-height // reduce)))
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # a copy of every image otherwise, turned or not
            return image
    except InvalidArgument:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidArgument(f"{where}: image too large to decode, refused before decoding ({e})") from None
    except Image.UnidentifiedImageError:
        raise InvalidArgument(f"{where}: data is not a decodable {_format_names(formats)} image "
                              f"({len(data)} bytes starting {data[:8]!r})") from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as e:  # truncated / corrupt streams
        raise InvalidArgument(f"{where}: corrupt or truncated image data ({type(e).__name__}: {e})") from None


def _from_pixels(message: pb.Tensor, where: str, max_image_pixels: int) -> Image.Image:
    # Check the claimed shape before from_proto touches the bytes.
    shape = tuple(message.shape)
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] != 3):
        raise InvalidArgument(f"{where}.pixels: shape {list(shape)} is not (H, W, 3) RGB or (H, W) greyscale")
    _check_size(int(shape[1]), int(shape[0]), where, max_image_pixels)
    tensor = from_proto(message, name=f"{where}.pixels")
    if tensor.dtype != torch.uint8:
        raise InvalidArgument(f"{where}.pixels: dtype {tensor.dtype} is not uint8")
    array = np.ascontiguousarray(tensor.numpy())
    return Image.fromarray(array, mode="L" if array.ndim == 2 else "RGB")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB exactly as transformers' ``convert_to_rgb`` does it: alpha composited onto white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


# ---- resizing and normalisation ---------------------------------------------------------------


def rescale_normalize(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """(H, W, 3) float32, with the processor's arithmetic (float64 rescale, float32 normalise)."""
    array = np.asarray(image)
    if cfg.do_rescale:
        array = (array.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        array = array.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        array = (array - mean) / std
    return array


def patchify(array: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """(H, W, C) -> (grid_h * grid_w, C * T * P * P) rows, merge blocks contiguous (the processor's order)."""
    height, width, channels = array.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = array.transpose(2, 0, 1).reshape(
        channels, grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size, patch_size)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], temporal_patch_size,
                                                               *patches.shape[5:]))
    return np.ascontiguousarray(patches).reshape(grid_h * grid_w, channels * temporal_patch_size * patch_size ** 2)


def pixel_budget(cfg: ImageProcessorConfig, item: pb.EncodeItem, index: int, limit: int) -> tuple[int, int]:
    """The item's effective (min_pixels, max_pixels): its own when set (0 = the checkpoint's)."""
    where = f"items[{index}]"
    if item.min_pixels < 0 or item.max_pixels < 0:
        raise InvalidArgument(f"{where}: min_pixels/max_pixels must be >= 0 (0 = the checkpoint's default)")
    lo = item.min_pixels or cfg.min_pixels
    hi = item.max_pixels or cfg.max_pixels
    if hi > limit:
        raise InvalidArgument(f"{where}: max_pixels {hi} exceeds the server's limit of {limit}")
    if lo > hi:
        raise InvalidArgument(f"{where}: min_pixels {lo} is larger than max_pixels {hi}")
    if hi < cfg.factor ** 2:
        raise InvalidArgument(f"{where}: max_pixels {hi} is below one merged patch ({cfg.factor}x{cfg.factor})")
    return lo, hi


def qwen2_vl_pixels(image: Image.Image, cfg: ImageProcessorConfig, min_pixels: int, max_pixels: int,
                    where: str = "image") -> tuple[np.ndarray, tuple[int, int, int]]:
    """pixel_values rows and grid (t, h, w) of one RGB image, as Qwen2VLImageProcessorPil computes them."""
    width, height = image.size
    if cfg.do_resize:
        try:
            h_bar, w_bar = smart_resize(height, width, cfg.factor, min_pixels, max_pixels)
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}") from None
        image = image.resize((w_bar, h_bar), resample=cfg.resample)
    elif height % cfg.factor or width % cfg.factor:
        raise InvalidArgument(f"{where}: {width}x{height} is not a multiple of {cfg.factor} and do_resize is off")
    array = rescale_normalize(image, cfg)
    rows = patchify(array, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return rows, (1, array.shape[0] // cfg.patch_size, array.shape[1] // cfg.patch_size)


def video_size(height: int, width: int, cfg: ImageProcessorConfig, where: str = "video") -> tuple[int, int]:
    """The (height, width) every frame of a height x width video is resized to (the video processor's
    smart_resize, its budget)."""
    if not cfg.do_resize:
        if height % cfg.factor or width % cfg.factor:
            raise InvalidArgument(f"{where}: {width}x{height} frames are not a multiple of {cfg.factor} and "
                                  "do_resize is off")
        return height, width
    try:
        return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as e:
        raise InvalidArgument(f"{where}: {e}") from None


def video_frame(rgb: np.ndarray, size: tuple[int, int], cfg: ImageProcessorConfig) -> np.ndarray:
    """One (H, W, 3) uint8 frame resized to `size` as the PIL image processor resizes, rescaled, normalised:
    (h, w, 3) float32."""
    image = Image.fromarray(rgb)  # (H, W, 3) uint8: RGB
    if (image.height, image.width) != size:
        image = image.resize((size[1], size[0]), resample=cfg.resample)
    return rescale_normalize(image, cfg)


def video_patches(frames: list[np.ndarray], cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """pixel_values_videos rows and grid (t, h, w) of one video's processed frames, as
    Qwen2VLVideoProcessor.patchify lays them out: frames grouped temporal_patch_size at a time (the last
    frame repeated to fill the last group), rows in merge-block order, each C x T x P x P."""
    if not frames:
        raise ValueError("a video of no frames")
    tps, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    frames = list(frames) + [frames[-1]] * (-len(frames) % tps)
    height, width, channels = frames[0].shape
    grid_t, grid_h, grid_w = len(frames) // tps, height // p, width // p
    video = np.stack(frames)  # (T, H, W, C)
    patches = video.reshape(grid_t, tps, grid_h // m, m, p, grid_w // m, m, p, channels)
    # -> (grid_t, gh/m, gw/m, mh, mw, C, tps, ph, pw): the processor's permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    patches = patches.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    rows = np.ascontiguousarray(patches).reshape(grid_t * grid_h * grid_w, channels * tps * p * p)
    return rows, (grid_t, grid_h, grid_w)


def fixed_pixels(image: Image.Image, cfg: ImageProcessorConfig, where: str = "image") -> np.ndarray:
    """(3, height, width) float32, as SiglipImageProcessorPil computes it."""
    if cfg.do_resize:
        image = image.resize((cfg.width, cfg.height), resample=cfg.resample)
    elif image.size != (cfg.width, cfg.height):
        raise InvalidArgument(f"{where}: image is {image.size[0]}x{image.size[1]}, the model takes "
                              f"{cfg.width}x{cfg.height} and do_resize is off")
    return np.ascontiguousarray(rescale_normalize(image, cfg).transpose(2, 0, 1))


def content_digest(item: pb.EncodeItem) -> bytes:
    """sha256 of what the item carries (encoded bytes, or the pixel tensor with its shape and dtype)."""
    digest = hashlib.sha256()
    source = item.WhichOneof("source")
    digest.update(f"{source}\0".encode())
    if source == "data":
        digest.update(item.data)
    elif source == "video":
        digest.update(item.video)
    elif source == "pixels":
        digest.update(f"{item.pixels.dtype}:{list(item.pixels.shape)}\0".encode())
        digest.update(item.pixels.data)
    return digest.digest()
