"""VAEService: thin gRPC servicer over the VAE decoder.

Decode: validate (shape, channels, dtype, finiteness, size limits, tiling options)
-> unscale as the diffusers pipelines do -> bounded queue -> a worker batches
requests of equal latent shape and tiling (up to --max-batch images) and runs the
decoder in a thread -> pixels split per request -> PNG / uint8 / float32.
A full queue is RESOURCE_EXHAUSTED; bad input is INVALID_ARGUMENT; the service
stays up either way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from modalmesh import pb
from modalmesh.errors import ConfigError, FailedPrecondition, InvalidArgument, ResourceExhausted
from modalmesh.rpc.codec import TORCH_DTYPES, dtype_name, from_proto, to_proto
from modalmesh.rpc.server import MiB
from modalmesh.service import Service
from services.vae.config import VAEConfig, find_vae_dir
from services.vae.engine import AUTO, OFF, ON, TilingDefaults, TilingRequest, VAEEngine, encode_png, to_uint8, to_unit
from services.vae.tiling import TileGrid
from services.vae.weights import build_decoder, load_decoder

log = logging.getLogger(__name__)

_MODES = {pb.TilingOptions.AUTO: AUTO, pb.TilingOptions.ON: ON, pb.TilingOptions.OFF: OFF}
_OUTPUTS = {pb.PNG: "PNG", pb.TENSOR_UINT8: "TENSOR_UINT8", pb.TENSOR_FLOAT: "TENSOR_FLOAT"}
_FLOAT_WIRE = {pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16}
MAX_TILES_PER_IMAGE = 1024


@dataclass
class DecodeJob:
    z: torch.Tensor  # (B, C, h, w) float32 on CPU, as AutoencoderKL.decode takes it
    tiling: TilingRequest
    output: int  # pb.OutputFormat
    future: asyncio.Future = field(default=None, repr=False)

    @property
    def key(self) -> tuple:
        return (*self.z.shape[1:], self.tiling)

    @property
    def images(self) -> int:
        return self.z.shape[0]


@dataclass
class JobResult:
    pixels: torch.Tensor  # CPU: (B, H, W, 3) uint8 for PNG/TENSOR_UINT8, (B, 3, H, W) float32 for TENSOR_FLOAT
    tiles: int


class DecodeBatcher:
    """Bounded FIFO of decode jobs; one worker batches jobs of equal key and runs `run` in a thread.

    `run(jobs) -> results` is called with 1..n jobs sharing a key and at most `max_batch` images
    (a single job larger than that runs alone; the engine splits it).
    """

    def __init__(self, run: Callable[[list[DecodeJob]], list[JobResult]], *, max_queue: int, max_batch: int,
                 metrics=None):
        self.run = run
        self.max_queue = max(1, max_queue)
        self.max_batch = max(1, max_batch)
        self.metrics = metrics
        self._pending: deque[DecodeJob] = deque()
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._loop(), name="vae-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        while self._pending:
            job = self._pending.popleft()
            if not job.future.done():
                job.future.set_exception(FailedPrecondition("the service is shutting down"))

    async def submit(self, job: DecodeJob) -> JobResult:
        if self._worker is None or self._worker.done():
            raise FailedPrecondition("the decode worker is not running (service starting or stopping)")
        if len(self._pending) >= self.max_queue:
            raise ResourceExhausted(f"decode queue is full ({self.max_queue} requests waiting); retry later")
        job.future = asyncio.get_running_loop().create_future()
        self._pending.append(job)
        self._depth()
        self._wakeup.set()
        return await job.future  # a cancelled RPC cancels the future; the worker then skips the job

    def _depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))

    def _take(self) -> list[DecodeJob]:
        batch: list[DecodeJob] = []
        kept: deque[DecodeJob] = deque()
        images = 0
        while self._pending:
            job = self._pending.popleft()
            if job.future.done():  # cancelled while waiting
                continue
            if not batch:
                batch.append(job)
                images = job.images
            elif job.key == batch[0].key and images + job.images <= self.max_batch:
                batch.append(job)
                images += job.images
            else:
                kept.append(job)
        self._pending = kept
        return batch

    async def _loop(self) -> None:
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            batch = self._take()
            self._depth()
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self.run, batch)
            except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            for job, result in zip(batch, results):
                if not job.future.done():
                    job.future.set_result(result)


class VAEServicer(pb.vae_pb2_grpc.VAEServiceServicer):
    def __init__(self, service: VAEDecoderService):
        self.service = service

    async def Decode(self, request, context):
        return await self.service.decode(request)

    async def Info(self, request, context):
        return self.service.info()


class VAEDecoderService(Service):
    name = "vae"
    grpc_service = pb.VAE_SERVICE
    description = "modalmesh VAE service: latents -> PNG or pixel tensors."
    max_message_mb = 256  # responses carry full-resolution images
    auto_dtype = torch.float32  # FP32 is the VAE's default serving dtype

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("VAE decoding")
        g.add_argument("--max-batch", type=int, default=8, help="images per decoder call (equal latent shapes)")
        g.add_argument("--max-queue", type=int, default=64, help="requests waiting; beyond: RESOURCE_EXHAUSTED")
        g.add_argument("--max-images", type=int, default=16, help="images per request")
        g.add_argument("--max-latent-side", type=int, default=1024, help="largest latent height/width accepted")
        g.add_argument("--tile-size", type=int, default=0,
                       help="latent pixels per tile side (0: config sample_size / scale factor, as diffusers)")
        g.add_argument("--tile-overlap", type=int, default=-1, help="latent overlap of tiles (-1: tile size / 4)")
        g.add_argument("--tile-threshold", type=int, default=0,
                       help="AUTO tiling when a latent side exceeds this (0: the tile size)")
        g.add_argument("--tile-batch", type=int, default=4, help="tiles per decoder call when tiling")
        g.add_argument("--max-decode-seconds", type=float, default=300.0,
                       help="a decoder call stops past this (DEADLINE_EXCEEDED), keeping the queue moving; 0: none")
        g.add_argument("--max-untiled-mb", type=int, default=0,
                       help="AUTO tiling when an untiled decode would need more (0: free device memory on CUDA)")
        g.add_argument("--channels-last", action="store_true", help="NHWC activations (CUDA convolutions)")
        g.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN time conv algorithms per shape")
        g.add_argument("--png-compress-level", type=int, default=1, choices=range(10), metavar="0-9")

    def __init__(self, args: argparse.Namespace, metrics):
        super().__init__(args, metrics)
        self.cfg: VAEConfig | None = None
        self.vae_dir = None
        self.model = None
        self.engine: VAEEngine | None = None
        self.batcher: DecodeBatcher | None = None
        for flag in ("max_batch", "max_queue", "max_images", "max_latent_side", "tile_batch"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
        if self.model_dir is None:
            log.warning("no --model: serving no VAE (Decode answers FAILED_PRECONDITION)")
            return
        self.vae_dir = find_vae_dir(self.model_dir)
        self.cfg = VAEConfig.from_dir(self.vae_dir)
        self.tiling = TilingDefaults.for_config(self.cfg, args.tile_size, args.tile_overlap, args.tile_threshold,
                                                args.tile_batch)
        if self.tiling.overlap >= self.tiling.tile:
            raise ConfigError(f"--tile-overlap {self.tiling.overlap} must be smaller than the tile "
                              f"({self.tiling.tile})")
        if self.cfg.force_upcast and self.dtype == torch.float16:
            log.warning("this VAE's config asks for force_upcast: float16 decoding may overflow "
                        "(use bfloat16 or float32)")
        # Built on meta now so that an attention override that cannot serve this model fails start-up.
        self.model = build_decoder(self.cfg, dtype=self.dtype, seqlen_hint=self.tiling.threshold ** 2)

    def register(self, server) -> None:
        server.add_service(self.grpc_service, pb.vae_pb2_grpc.add_VAEServiceServicer_to_server, VAEServicer(self))

    async def load(self) -> None:
        await super().load()
        if self.model is None:
            return
        if self.device.type == "cuda" and self.args.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        await asyncio.to_thread(load_decoder, self.model, self.vae_dir, device=self.device, dtype=self.dtype,
                                dummy=self.args.dummy_weights, metrics=self.metrics)
        self.engine = VAEEngine(self.cfg, self.model, device=self.device, dtype=self.dtype, tiling=self.tiling,
                                max_batch=self.args.max_batch, channels_last=self.args.channels_last,
                                untiled_budget_bytes=self.args.max_untiled_mb * MiB)
        await asyncio.to_thread(self.engine.warm_up)
        self.batcher = DecodeBatcher(self._run_batch, max_queue=self.args.max_queue, max_batch=self.args.max_batch,
                                     metrics=self.metrics)
        self.batcher.start()
        log.info("VAE ready: %d latent channels, x%d, %s on %s, attention %s, tiles %d/%d (threshold %d)",
                 self.cfg.latent_channels, self.cfg.scale_factor, str(self.dtype).removeprefix("torch."),
                 self.device, self.engine.attention_backend, self.tiling.tile, self.tiling.overlap,
                 self.tiling.threshold)

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()

    def info(self) -> pb.ServiceInfo:
        info = super().info()
        if self.cfg is None:
            info.extra["model"] = "none"
            return info
        cfg = self.cfg
        info.architecture = "AutoencoderKL"
        info.hidden_size = cfg.block_out_channels[-1]
        info.output_hidden_size = cfg.out_channels
        info.extra.update({
            "latent_channels": str(cfg.latent_channels),
            "scale_factor": str(cfg.scale_factor),
            "scaling_factor": repr(cfg.scaling_factor),
            "shift_factor": repr(cfg.shift_factor) if cfg.shift_factor is not None else "",
            "latents_mean_std": str(cfg.latents_mean is not None and cfg.latents_std is not None).lower(),
            "post_quant_conv": str(cfg.use_post_quant_conv).lower(),
            "tile_latent_size": str(self.tiling.tile),
            "tile_overlap_latent": str(self.tiling.overlap),
            "tile_threshold_latent": str(self.tiling.threshold),
            "max_batch": str(self.args.max_batch),
            "max_images": str(self.args.max_images),
            "max_latent_side": str(self.args.max_latent_side),
            "max_queue": str(self.args.max_queue),
        })
        return info

    # ---- Decode -----------------------------------------------------------------------------
    async def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if self.batcher is None:
            raise FailedPrecondition("no VAE is loaded: start the service with --model DIR")
        job = await asyncio.to_thread(self.validate, request)
        result = await self.batcher.submit(job)
        return await asyncio.to_thread(self._respond, result, request.output)

    def validate(self, request: pb.DecodeRequest) -> DecodeJob:
        """The request as a DecodeJob, or InvalidArgument saying what is wrong with it."""
        cfg, args = self.cfg, self.args
        if request.output not in _OUTPUTS:
            raise InvalidArgument(f"output: unknown format {request.output} (PNG, TENSOR_UINT8, TENSOR_FLOAT)")
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
        if b > args.max_images:
            raise InvalidArgument(f"latents: {b} images in one request; the limit is {args.max_images} (--max-images)")
        if max(h, w) > args.max_latent_side:
            raise InvalidArgument(f"latents: {h}x{w} exceeds the largest latent side {args.max_latent_side} "
                                  f"({args.max_latent_side * cfg.scale_factor} pixels; --max-latent-side)")
        height, width = h * cfg.scale_factor, w * cfg.scale_factor
        per_pixel = {pb.PNG: 3.03, pb.TENSOR_UINT8: 3, pb.TENSOR_FLOAT: 12}[request.output]
        reply_bytes = b * (per_pixel * height * width + 1024)
        if reply_bytes > args.max_message_mb * MiB:
            raise InvalidArgument(
                f"the reply ({b} x {height}x{width} {_OUTPUTS[request.output]}, ~{math.ceil(reply_bytes / MiB)} MiB) "
                f"would exceed --max-message-mb {args.max_message_mb}; send fewer or smaller latents")
        tiling = self._tiling(request.tiling, h, w)
        if tiling.mode == OFF and self.engine is not None and not self.engine.fits(b, h, w):
            need, budget = self.engine.untiled_bytes(b, h, w), self.engine.budget_bytes()
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
        return DecodeJob(z=z, tiling=tiling, output=request.output)

    def _tiling(self, opts: pb.TilingOptions, h: int, w: int) -> TilingRequest:
        tile, overlap = int(opts.tile_latent_size), int(opts.overlap_latent)
        if tile < 0 or overlap < 0:
            raise InvalidArgument(f"tiling: tile_latent_size {tile} / overlap_latent {overlap} must be >= 0")
        if tile and tile < 4:
            raise InvalidArgument(f"tiling: tile_latent_size {tile} is below the minimum of 4")
        req = TilingRequest(mode=_MODES[opts.mode], tile=tile, overlap=overlap if overlap else -1)
        grid_tile = tile or self.tiling.tile
        if overlap and overlap >= grid_tile:
            raise InvalidArgument(f"tiling: overlap_latent {overlap} must be smaller than the tile ({grid_tile})")
        if req.mode != OFF:
            grid = self.engine.grid(h, w, req) if self.engine else TileGrid.plan(h, w, tile=grid_tile, overlap=0)
            if grid.count > MAX_TILES_PER_IMAGE:
                raise InvalidArgument(f"tiling: {grid.count} tiles per image (limit {MAX_TILES_PER_IMAGE}); "
                                      "use a larger tile_latent_size")
        return req

    def _run_batch(self, jobs: list[DecodeJob]) -> list[JobResult]:
        """Worker thread: one decoder call (or one tiled decode) for jobs of one key."""
        z = jobs[0].z if len(jobs) == 1 else torch.cat([j.z for j in jobs])
        # A cancelled RPC cancels its job's future: once every job of the batch is gone, stop decoding.
        result = self.engine.decode(z, jobs[0].tiling,
                                    should_stop=lambda: all(j.future is not None and j.future.cancelled()
                                                            for j in jobs),
                                    budget_s=self.args.max_decode_seconds)
        images = z.shape[0]
        height, width = result.pixels.shape[-2:]
        self.metrics.batch_size.observe(images)
        self.metrics.decoded_images_total.inc(images)
        self.metrics.decoded_pixels_total.inc(images * height * width)
        if result.tiles > 1:
            self.metrics.vae_tiles_total.inc(result.tiles * images)
        out, start = [], 0
        for job in jobs:
            part = result.pixels[start:start + job.images]
            start += job.images
            pixels = to_unit(part) if job.output == pb.TENSOR_FLOAT else to_uint8(part)
            out.append(JobResult(pixels.cpu(), result.tiles))
        return out

    def _respond(self, result: JobResult, output: int) -> pb.DecodeResponse:
        if output == pb.PNG:
            level = self.args.png_compress_level
            return pb.DecodeResponse(png=[encode_png(img, level) for img in result.pixels], tiles=result.tiles)
        return pb.DecodeResponse(pixels=to_proto(result.pixels), tiles=result.tiles)

