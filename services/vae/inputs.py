"""A DecodeRequest -> a typed DecodeJob, with every check a request can fail (INVALID_ARGUMENT).

    job = decode_job(request, cfg=vae_config, limits=settings.limits, tiling=tiling_defaults, engine=engine)
    job.z          # (B, C, h, w) float32 on CPU, unscaled as the diffusers pipelines do
    job.tiling     # engine.TilingRequest
    job.output     # OutputFormat

The wire types stop here: nothing past this module sees a protobuf message or enum
(the servicer turns results back into a DecodeResponse). Checks, in order: output
format, tiling mode, latents present, float dtype, (B, C, h, w) with this VAE's
channels, limits (images, latent side, reply size), tiling options and tile count, the
memory an untiled decode would need, finiteness.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import TORCH_DTYPES, dtype_name, from_proto
from services.vae.config import DecodeLimits, VAEConfig
from services.vae.engine import AUTO, OFF, ON, TilingDefaults, TilingRequest, VAEEngine
from services.vae.tiling import TileGrid

MiB = 1 << 20
MAX_TILES_PER_IMAGE = 1024


class OutputFormat(enum.Enum):
    """What the client gets back; the value is the proto enum's name (for messages)."""

    PNG = "PNG"
    UINT8 = "TENSOR_UINT8"  # (B, H, W, 3) uint8
    FLOAT = "TENSOR_FLOAT"  # (B, 3, H, W) float32 in [0, 1]

    @property
    def bytes_per_pixel(self) -> float:
        """Reply bytes per output pixel, for the reply-size check (PNG: its worst case at level 1)."""
        return {OutputFormat.PNG: 3.03, OutputFormat.UINT8: 3, OutputFormat.FLOAT: 12}[self]


_OUTPUTS = {pb.PNG: OutputFormat.PNG, pb.TENSOR_UINT8: OutputFormat.UINT8, pb.TENSOR_FLOAT: OutputFormat.FLOAT}
_MODES = {pb.TilingOptions.AUTO: AUTO, pb.TilingOptions.ON: ON, pb.TilingOptions.OFF: OFF}
_FLOAT_WIRE = {pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16}


@dataclass
class DecodeJob:
    """One request's decode, as the batcher and the engine take it."""

    z: torch.Tensor  # (B, C, h, w) float32 on CPU, as AutoencoderKL.decode takes it
    tiling: TilingRequest
    output: OutputFormat

    @property
    def key(self) -> tuple:
        """Jobs with equal keys decode in one call."""
        return (*self.z.shape[1:], self.tiling)

    @property
    def images(self) -> int:
        return self.z.shape[0]


def decode_job(request: pb.DecodeRequest, *, cfg: VAEConfig, limits: DecodeLimits, tiling: TilingDefaults,
               engine: VAEEngine | None) -> DecodeJob:
    """The request as a DecodeJob, or InvalidArgument saying what is wrong with it."""
    if request.output not in _OUTPUTS:
        raise InvalidArgument(f"output: unknown format {request.output} (PNG, TENSOR_UINT8, TENSOR_FLOAT)")
    output = _OUTPUTS[request.output]
    if request.tiling.mode not in _MODES:
        raise InvalidArgument(f"tiling.mode: unknown mode {request.tiling.mode} (AUTO, ON, OFF)")
    if not request.HasField("latents"):
        raise InvalidArgument("latents: missing (a (B, C, h, w) float tensor)")
    wire = request.latents.dtype
    if wire in TORCH_DTYPES and wire not in _FLOAT_WIRE:  # unknown/unspecified: the codec says so below
        raise InvalidArgument(f"latents: dtype {dtype_name(wire)} is not a float type "
                              "(FLOAT32, FLOAT16 or BFLOAT16)")
    shape = list(request.latents.shape)
    if len(shape) != 4:
        raise InvalidArgument(f"latents: shape {shape} is not (B, C, h, w)")
    b, c, h, w = shape
    if c != cfg.latent_channels:
        raise InvalidArgument(f"latents: {c} channels, but this VAE takes {cfg.latent_channels}")
    if min(b, h, w) < 1:
        raise InvalidArgument(f"latents: shape {shape} is empty")
    if b > limits.max_images:
        raise InvalidArgument(f"latents: {b} images in one request; the limit is {limits.max_images} (--max-images)")
    if max(h, w) > limits.max_latent_side:
        raise InvalidArgument(f"latents: {h}x{w} exceeds the largest latent side {limits.max_latent_side} "
                              f"({limits.max_latent_side * cfg.scale_factor} pixels; --max-latent-side)")
    height, width = h * cfg.scale_factor, w * cfg.scale_factor
    reply_bytes = b * (output.bytes_per_pixel * height * width + 1024)
    if reply_bytes > limits.max_reply_bytes:
        raise InvalidArgument(
            f"the reply ({b} x {height}x{width} {output.value}, ~{math.ceil(reply_bytes / MiB)} MiB) "
            f"would exceed --max-message-mb {limits.max_reply_bytes // MiB}; send fewer or smaller latents")
    job_tiling = tiling_request(request.tiling, h, w, defaults=tiling, engine=engine)
    if job_tiling.mode == OFF and engine is not None and not engine.fits(b, h, w):
        need, budget = engine.untiled_bytes(b, h, w), engine.budget_bytes()
        raise InvalidArgument(f"tiling OFF: decoding {b} latent(s) of {h}x{w} untiled needs about "
                              f"{need / MiB:.0f} MiB, more than the {budget / MiB:.0f} MiB this server has for "
                              "it; leave tiling AUTO or ON")
    z = from_proto(request.latents, name="latents")
    z = z.to(torch.float32)  # FLOAT32 stays a view of the message's bytes: nothing below writes in place
    if not bool(torch.isfinite(z).all()):
        bad = int((~torch.isfinite(z)).sum())
        raise InvalidArgument(f"latents: {bad} value(s) are NaN or infinite")
    if not request.skip_scaling:
        z = cfg.unscale(z)
    return DecodeJob(z=z, tiling=job_tiling, output=output)


def tiling_request(opts: pb.TilingOptions, h: int, w: int, *, defaults: TilingDefaults,
                   engine: VAEEngine | None) -> TilingRequest:
    """The request's tiling options, checked against an (h, w) latent."""
    tile, overlap = int(opts.tile_latent_size), int(opts.overlap_latent)
    if tile < 0 or overlap < 0:
        raise InvalidArgument(f"tiling: tile_latent_size {tile} / overlap_latent {overlap} must be >= 0")
    if tile and tile < 4:
        raise InvalidArgument(f"tiling: tile_latent_size {tile} is below the minimum of 4")
    req = TilingRequest(mode=_MODES[opts.mode], tile=tile, overlap=overlap if overlap else -1)
    grid_tile = tile or defaults.tile
    if overlap and overlap >= grid_tile:
        raise InvalidArgument(f"tiling: overlap_latent {overlap} must be smaller than the tile ({grid_tile})")
    if req.mode != OFF:
        grid = engine.grid(h, w, req) if engine else TileGrid.plan(h, w, tile=grid_tile, overlap=0)
        if grid.count > MAX_TILES_PER_IMAGE:
            raise InvalidArgument(f"tiling: {grid.count} tiles per image (limit {MAX_TILES_PER_IMAGE}); "
                                  "use a larger tile_latent_size")
    return req
