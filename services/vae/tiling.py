"""Tiled decoding: overlapping latent tiles, decoded separately, overlaps cross-faded linearly.

The idea of diffusers' ``AutoencoderKL.tiled_decode``, implemented differently:

* Tiles all have one shape (the last tile of a row/column is aligned to the far
  edge instead of being cut short), so every tile of every image goes through
  the decoder in batches of ``tile_batch``.
* Each tile's pixels get a separable weight: 1 inside, a linear ramp across each
  overlap with a neighbour (ramps of the two neighbours sum to 1), no ramp at the
  image border. The output is sum(w * tile) / sum(w), accumulated in FP32 as
  tiles arrive, so memory stays one tile batch plus the output image.

    grid = TileGrid.plan(h, w, tile=64, overlap=16)
    pixels = tiled_decode(decoder, z, grid, scale=8, tile_batch=4)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def tile_starts(size: int, tile: int, overlap: int) -> tuple[int, ...]:
    """Start offsets of tiles of `tile` covering [0, size), consecutive ones overlapping by >= `overlap`."""
    if size <= tile:
        return (0,)
    stride = tile - overlap
    return (*range(0, size - tile, stride), size - tile)


@dataclass(frozen=True)
class TileGrid:
    height: int  # latent
    width: int
    tile_h: int
    tile_w: int
    ys: tuple[int, ...]
    xs: tuple[int, ...]

    @classmethod
    def plan(cls, height: int, width: int, *, tile: int, overlap: int) -> TileGrid:
        if tile < 1 or overlap < 0 or overlap >= tile:
            raise ValueError(f"tile {tile} / overlap {overlap}: need tile >= 1 and 0 <= overlap < tile")
        return cls(height, width, min(tile, height), min(tile, width),
                   tile_starts(height, tile, overlap), tile_starts(width, tile, overlap))

    @property
    def count(self) -> int:
        return len(self.ys) * len(self.xs)

    def tiles(self) -> list[tuple[int, int, int, int]]:
        """(row, col, y, x) of every tile, row-major."""
        return [(i, j, y, x) for i, y in enumerate(self.ys) for j, x in enumerate(self.xs)]


def ramp_weights(starts: tuple[int, ...], tile: int, scale: int, device=None) -> list[torch.Tensor]:
    """Per tile, its 1-D pixel weights: linear ramps over the overlaps with its neighbours."""
    length = tile * scale
    out = []
    for k, start in enumerate(starts):
        w = torch.ones(length, dtype=torch.float32, device=device)
        if k > 0:
            n = (starts[k - 1] + tile - start) * scale
            up = (torch.arange(n, dtype=torch.float32, device=device) + 0.5) / n
            w[:n] = torch.minimum(w[:n], up)
        if k < len(starts) - 1:
            n = (start + tile - starts[k + 1]) * scale
            down = (n - 0.5 - torch.arange(n, dtype=torch.float32, device=device)) / n
            w[length - n:] = torch.minimum(w[length - n:], down)
        out.append(w)
    return out


def tiled_decode(
    decode: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    grid: TileGrid,
    *,
    scale: int,
    tile_batch: int = 1,
) -> torch.Tensor:
    """Decode `z` (B, C, h, w) tile by tile with `decode` ((N, C, th, tw) -> (N, 3, th*scale, tw*scale));
    returns (B, 3, h*scale, w*scale) float32 on z's device."""
    b = z.shape[0]
    wy = ramp_weights(grid.ys, grid.tile_h, scale, z.device)
    wx = ramp_weights(grid.xs, grid.tile_w, scale, z.device)
    th, tw = grid.tile_h * scale, grid.tile_w * scale
    out = weight = None
    # Work items: (tile, image) crops, decoded `tile_batch` crops at a time.
    items = [(tile, img) for tile in grid.tiles() for img in range(b)]
    for first in range(0, len(items), max(1, tile_batch)):
        chunk = items[first:first + max(1, tile_batch)]
        crops = torch.stack([z[img, :, y:y + grid.tile_h, x:x + grid.tile_w] for (_, _, y, x), img in chunk])
        pixels = decode(crops).float()
        if out is None:
            out = torch.zeros(b, pixels.shape[1], grid.height * scale, grid.width * scale,
                              dtype=torch.float32, device=pixels.device)
            weight = torch.zeros(1, 1, grid.height * scale, grid.width * scale, dtype=torch.float32,
                                 device=pixels.device)
        for ((i, j, y, x), img), tile in zip(chunk, pixels):
            w = (wy[i][:, None] * wx[j][None, :]).to(pixels.device)
            ys, xs = slice(y * scale, y * scale + th), slice(x * scale, x * scale + tw)
            out[img, :, ys, xs] += tile * w
            if img == 0:
                weight[0, 0, ys, xs] += w
    return out / weight
