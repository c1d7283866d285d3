"""Preprocessing on the encoder's device: uint8 pixels go up, resize / rescale / normalise / patchify run there.

    path = preprocess_path("auto", device, cfg)          # "device" on CUDA, "cpu" elsewhere
    pre = DevicePreprocessor(cfg, device, staging)
    rows = pre.qwen2_vl_rows(images, sizes)              # images: uint8 (H, W, 3), on the host or the device
    pixels = pre.fixed_pixels(images)                    # SigLIP: (N, 3, height, width)

Why: on one CPU thread the float64 rescale and normalise of preprocess.py cost more
than decoding, and the float32 rows a 448² image becomes (patchified, the frame
repeated) are 8x the bytes of its pixels. Here `prepare` (CPU threads) only decodes
and converts to RGB exactly as preprocess.py does; `encode` uploads every image of
the batch as uint8 in one copy (HostStaging) and does the arithmetic on the device.

How close to the exact PIL path (preprocess.py, bit-equal to HF's *Pil processors):
- the resize is two 1-D antialiased passes (``F.interpolate(..., antialias=True)``, the
  kernel PIL uses: bicubic a = -0.5, support scaled when shrinking), each rounded and
  clamped to uint8 as PIL does between and after its passes, in the order PIL runs
  them (`horizontal_first`). What is left is PIL's 22-bit fixed-point arithmetic
  against torch's float32: at most a level or so in a few pixels, unless PIL picks
  the other pass order and a pass clips (sharp edges);
- rescale and normalise are a 256-entry table per channel made with preprocess.py's
  own arithmetic, so an unresized image gives exactly the CPU path's values;
- patchify is preprocess.py's, row order included.
The tolerances measured are in tests/test_vision_device_preprocess.py and docs/architecture.md.
"""

from __future__ import annotations

import numpy as np
import PIL
import torch
import torch.nn.functional as F
from PIL import Image

from modalmesh.errors import ConfigError, InvalidArgument
from modalmesh.image_grid import smart_resize
from modalmesh.staging import HostStaging
from services.vision_encoder.preprocess import ImageProcessorConfig, rescale_normalize

PATHS = ("cpu", "device")
MODES = {int(Image.Resampling.BICUBIC): "bicubic", int(Image.Resampling.BILINEAR): "bilinear"}  # torch's = PIL's


def preprocess_path(choice: str, device: torch.device, cfg: ImageProcessorConfig) -> str:
    """Which path makes the pixels: `choice` is the flag ("auto": the device path on CUDA, else the CPU one)."""
    if choice not in ("auto", *PATHS):
        raise ConfigError(f"preprocess_device must be auto, cpu or device, not {choice!r}")
    supported = not cfg.do_resize or int(cfg.resample) in MODES
    if choice == "device" and not supported:
        raise ConfigError(f"--preprocess-device device: resample={cfg.resample} has no torch equivalent "
                          f"(bicubic or bilinear); use cpu")
    if choice == "auto":
        return "device" if torch.device(device).type == "cuda" and supported else "cpu"
    return choice


def rgb_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 (H, W, 3) CPU tensor (a copy: numpy's view of a PIL image is read-only)."""
    return torch.from_numpy(np.array(image, dtype=np.uint8, copy=True))


def qwen2_vl_size(height: int, width: int, cfg: ImageProcessorConfig, min_pixels: int, max_pixels: int,
                  where: str) -> tuple[int, int]:
    """The size preprocess.qwen2_vl_pixels resizes to (same checks, same errors)."""
    if cfg.do_resize:
        try:
            return smart_resize(height, width, cfg.factor, min_pixels, max_pixels)
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}") from None
    if height % cfg.factor or width % cfg.factor:
        raise InvalidArgument(f"{where}: {width}x{height} is not a multiple of {cfg.factor} and do_resize is off")
    return height, width


def fixed_size(height: int, width: int, cfg: ImageProcessorConfig, where: str) -> tuple[int, int]:
    """The size preprocess.fixed_pixels resizes to (same checks, same errors)."""
    if not cfg.do_resize and (width, height) != (cfg.width, cfg.height):
        raise InvalidArgument(f"{where}: image is {width}x{height}, the model takes "
                              f"{cfg.width}x{cfg.height} and do_resize is off")
    return cfg.height, cfg.width


PILLOW_MAJOR = int(PIL.__version__.split(".")[0])


def horizontal_first(height: int, width: int, out_height: int, out_width: int) -> bool:
    """The order of PIL's two passes, which matters where a pass clips (PIL stores uint8 between them).
    Pillow 12 and older always run the horizontal pass first (libImaging/Resample.c; the H200 host's
    Pillow 12.3 showed it: the other order differed by 27 grey levels there). Pillow 13 runs the
    vertical pass first when the height shrinks and the width does not, and sometimes when both shrink,
    by a rule not reproduced here: those images differ more at sharp edges, within the stated tolerance."""
    if PILLOW_MAJOR < 13:
        return True
    return not (out_height < height and out_width >= width)


def resize_like_pil(pixels: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """(N, C, H, W) float holding uint8 values -> (N, C, *size), each pass rounded to uint8 like PIL's."""
    height, width = pixels.shape[-2:]
    out_height, out_width = size
    steps = [(height, out_width), (out_height, out_width)]
    if not horizontal_first(height, width, out_height, out_width):
        steps = [(out_height, width), (out_height, out_width)]
    for step in steps:
        if step != tuple(pixels.shape[-2:]):
            pixels = F.interpolate(pixels, size=step, mode=mode, antialias=True, align_corners=False)
            pixels = pixels.add_(0.5).floor_().clamp_(0, 255)  # PIL rounds half up, then clips
    return pixels


def patchify_rows(pixels: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """(C, H, W) -> (grid_h * grid_w, C * T * P * P): preprocess.patchify on a tensor, same row order."""
    channels, height, width = pixels.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = pixels.reshape(channels, grid_h // merge_size, merge_size, patch_size,
                             grid_w // merge_size, merge_size, patch_size).permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], temporal_patch_size, *patches.shape[5:])
    return patches.reshape(grid_h * grid_w, channels * temporal_patch_size * patch_size ** 2)


class DevicePreprocessor:
    """One batch of decoded uint8 images -> the tower's float32 input, on `device`."""

    def __init__(self, cfg: ImageProcessorConfig, device: torch.device | str, staging: HostStaging | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.staging = staging or HostStaging(self.device)
        self.mode = MODES.get(int(cfg.resample), "bicubic")
        levels = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 3, axis=2)  # (1, 256, 3)
        table = rescale_normalize(Image.fromarray(levels, "RGB"), cfg)[0].T  # (3, 256), preprocess's arithmetic
        self.table = torch.from_numpy(np.ascontiguousarray(table)).to(self.device)

    def pixels(self, images: list[torch.Tensor], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each image resized to its size, rescaled and normalised: (3, h, w) float32 on the device, in order.
        The images on the host go up in one copy (those decoded on the device are there already); images of
        one shape and target size are resized together."""
        uploaded = list(images)
        host = [i for i, image in enumerate(images) if image.device.type == "cpu"]
        for i, image in zip(host, self.staging.upload([images[i] for i in host])):
            uploaded[i] = image
        groups: dict[tuple, list[int]] = {}
        for i, (image, size) in enumerate(zip(uploaded, sizes)):
            groups.setdefault((tuple(image.shape), tuple(size)), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(images)
        for (shape, size), members in groups.items():
            batch = torch.stack([uploaded[i] for i in members]).permute(0, 3, 1, 2)  # (n, 3, H, W) uint8
            if tuple(shape[:2]) != size:
                batch = resize_like_pil(batch.float(), size, self.mode)
            for i, image in zip(members, self._normalise(batch)):
                out[i] = image
        return out

    def _normalise(self, batch: torch.Tensor) -> torch.Tensor:
        n, channels, height, width = batch.shape
        index = batch.reshape(n, channels, -1).long()
        return torch.gather(self.table.expand(n, -1, -1), 2, index).reshape(n, channels, height, width)

    def qwen2_vl_rows(self, images: list[torch.Tensor], sizes: list[tuple[int, int]]) -> torch.Tensor:
        """The batch's pixel_values rows, concatenated in order (as preprocess.qwen2_vl_pixels makes each)."""
        return self.rows(self.pixels(images, sizes))

    def rows(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """`pixels`' (3, h, w) images patchified and concatenated in order: Qwen2-VL's pixel_values rows."""
        cfg = self.cfg
        return torch.cat([patchify_rows(p, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) for p in pixels])

    def fixed_pixels(self, images: list[torch.Tensor]) -> torch.Tensor:
        """(N, 3, height, width), as preprocess.fixed_pixels makes each."""
        return torch.stack(self.pixels(images, [(self.cfg.height, self.cfg.width)] * len(images)))
