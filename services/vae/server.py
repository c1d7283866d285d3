"""VAEDecoderService: the VAE decoder behind modalmesh.v1.VAEService; the servicer forwards to it.

Decode: the request becomes a typed DecodeJob (inputs.py: every check, unscaling as the
diffusers pipelines do) -> a bounded queue whose worker batches jobs of equal latent
shape and tiling (batcher.py, up to --max-batch images) and runs the decoder in a
thread (engine.py) -> pixels split per request -> PNG / uint8 / float32 here. A full
queue is RESOURCE_EXHAUSTED; bad input is INVALID_ARGUMENT; the service stays up
either way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import torch

from modalmesh import pb
from modalmesh.errors import ConfigError
from modalmesh.rpc.codec import to_proto
from modalmesh.rpc.servicer import ForwardingServicer
from modalmesh.service import Service
from services.vae import flags as vae_flags
from services.vae.batcher import DecodeBatcher, JobResult, decode_jobs
from services.vae.config import VAEConfig, VAEServiceConfig, find_vae_dir
from services.vae.engine import TilingDefaults, VAEEngine, encode_png
from services.vae.inputs import DecodeJob, OutputFormat, decode_job
from services.vae.weights import build_decoder, load_decoder

log = logging.getLogger(__name__)


class VAEDecoderService(Service):
    name = vae_flags.NAME
    grpc_service = pb.VAE_SERVICE
    description = vae_flags.DESCRIPTION
    max_message_mb = vae_flags.MAX_MESSAGE_MB
    auto_dtype = torch.float32  # FP32 is the VAE's default serving dtype

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        vae_flags.add_arguments(parser)

    def __init__(self, args: argparse.Namespace, metrics):
        super().__init__(args, metrics)
        # The one place the VAE reads its flags: everything below takes this value.
        self.settings = settings = VAEServiceConfig.from_args(args)
        self.cfg: VAEConfig | None = None
        self.vae_dir = None
        self.model = None
        self.engine: VAEEngine | None = None
        self.batcher: DecodeBatcher | None = None
        if self.model_dir is None:
            log.warning("no --model: serving no VAE (Decode answers FAILED_PRECONDITION)")
            return
        self.vae_dir = find_vae_dir(self.model_dir)
        self.cfg = VAEConfig.from_dir(self.vae_dir)
        self.tiling = TilingDefaults.for_config(self.cfg, settings.tile_size, settings.tile_overlap,
                                                settings.tile_threshold, settings.tile_batch)
        if self.tiling.overlap >= self.tiling.tile:
            raise ConfigError(f"--tile-overlap {self.tiling.overlap} must be smaller than the tile "
                              f"({self.tiling.tile})")
        if self.cfg.force_upcast and self.dtype == torch.float16:
            log.warning("this VAE's config asks for force_upcast: float16 decoding may overflow "
                        "(use bfloat16 or float32)")
        # Built on meta now so that an attention override that cannot serve this model fails start-up.
        self.model = build_decoder(self.cfg, dtype=self.dtype, seqlen_hint=self.tiling.threshold ** 2,
                                   fused_kernels=settings.fused_kernels)

    def register(self, server) -> None:
        server.add_service(self.grpc_service, pb.vae_pb2_grpc.add_VAEServiceServicer_to_server,
                           ForwardingServicer(self, Decode=self.decode))

    async def load(self) -> None:
        await super().load()
        if self.model is None:
            return
        settings = self.settings
        if self.device.type == "cuda" and settings.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        await asyncio.to_thread(load_decoder, self.model, self.vae_dir, device=self.device, dtype=self.dtype,
                                dummy=settings.dummy_weights, metrics=self.metrics)
        self.engine = VAEEngine(self.cfg, self.model, device=self.device, dtype=self.dtype, tiling=self.tiling,
                                max_batch=settings.max_batch, channels_last=settings.use_channels_last(self.device),
                                untiled_budget_bytes=settings.untiled_budget_bytes, cuda_graphs=settings.cuda_graphs,
                                metrics=self.metrics)
        await asyncio.to_thread(self.engine.warm_up)
        self.batcher = DecodeBatcher(self._decode_jobs, max_queue=settings.max_queue, max_batch=settings.max_batch,
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
            "max_batch": str(self.settings.max_batch),
            "cuda_graph_batches": str(self.engine.graphs.sizes[-1] if self.engine and self.engine.graphs else 0),
            "max_images": str(self.settings.limits.max_images),
            "max_latent_side": str(self.settings.limits.max_latent_side),
            "max_queue": str(self.settings.max_queue),
        })
        return info

    # ---- Decode -----------------------------------------------------------------------------
    async def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if self.batcher is None:
            raise self.not_ready("this VAE service")
        job = await asyncio.to_thread(self.validate, request)
        result = await self.batcher.submit(job)
        return await asyncio.to_thread(self._respond, result, job.output)

    def validate(self, request: pb.DecodeRequest) -> DecodeJob:
        """The request as a DecodeJob, or InvalidArgument saying what is wrong with it (inputs.py)."""
        return decode_job(request, cfg=self.cfg, limits=self.settings.limits, tiling=self.tiling, engine=self.engine)

    def _decode_jobs(self, jobs: list[DecodeJob], abandoned) -> list[JobResult]:
        return decode_jobs(self.engine, jobs, abandoned, budget_s=self.settings.max_decode_seconds,
                           metrics=self.metrics)

    def _respond(self, result: JobResult, output: OutputFormat) -> pb.DecodeResponse:
        if output == OutputFormat.PNG:
            level = self.settings.png_compress_level
            return pb.DecodeResponse(png=[encode_png(img, level) for img in result.pixels], tiles=result.tiles)
        return pb.DecodeResponse(pixels=to_proto(result.pixels), tiles=result.tiles)

