"""Qwen2-VL's image grid: the size an image is resized to, and the rows it becomes, from its size alone.

The vision encoder resizes with it; the LLM counts an image's placeholder rows with it
before asking any encoder (a request whose images cannot fit the context is refused
before they are encoded). Transformers' ``smart_resize``, exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ASPECT_RATIO = 200  # smart_resize's own limit


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, area within [min, max], aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixel_bounds(raw: dict) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) of a preprocessor_config.json: transformers 5 writes size {shortest_edge,
    longest_edge}, 4 wrote min/max_pixels (top level or inside size); the top-level keys win."""
    size = raw.get("size") or {}
    size = size if isinstance(size, dict) else {}
    lo = next((v for v in (raw.get("min_pixels"), size.get("min_pixels"), size.get("shortest_edge")) if v is not None),
              None)
    hi = next((v for v in (raw.get("max_pixels"), size.get("max_pixels"), size.get("longest_edge")) if v is not None),
              None)
    return (int(lo) if lo is not None else None), (int(hi) if hi is not None else None)


@dataclass(frozen=True)
class ImageGrid:
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_preprocessor(cls, raw: dict, **defaults) -> ImageGrid:
        lo, hi = pixel_bounds(raw)
        values = dict(defaults)
        for key in ("patch_size", "merge_size"):
            if raw.get(key) is not None:
                values[key] = int(raw[key])
        if lo is not None:
            values["min_pixels"] = lo
        if hi is not None:
            values["max_pixels"] = hi
        return cls(**values)

    def rows(self, width: int, height: int, *, min_pixels: int = 0, max_pixels: int = 0) -> int:
        """The embedding rows (merged patches) of a width x height image; per-item budgets when set."""
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, min_pixels or self.min_pixels, max_pixels or self.max_pixels)
        return (h // factor) * (w // factor)
