"""Vision encoder service: images -> embedding rows for the LLM.

    python -m services.vision_encoder --model /models/Qwen2-VL-7B-Instruct [--max-batch-tokens 16384]

Serves the vision tower of a full multimodal checkpoint (only its tensors are read)
or a standalone SigLIP vision model, behind the shared EncoderService (batching
across requests, embedding cache, metrics). See model.py for what the rows are.
"""

from __future__ import annotations

import argparse

from modalmesh import pb
from services.encoder.service import EncoderService
from services.vision_encoder.model import VisionEncoderModel, build_encoder_model
from services.vision_encoder import flags as vision_flags
from services.vision_encoder.decode_memory import MiB


class VisionEncoderService(EncoderService):
    name = vision_flags.NAME
    description = vision_flags.DESCRIPTION
    modality = pb.IMAGE

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        vision_flags.add_arguments(parser)

    @classmethod
    def model_options(cls, args: argparse.Namespace) -> dict:
        return {"max_image_pixels": args.max_image_pixels,
                "max_image_decoded_bytes": int(args.max_image_decoded_mb * MiB),
                "decode_memory_bytes": int(args.decode_memory_mb * MiB),
                "max_request_pixels": args.max_request_pixels,
                "siglip_output": args.siglip_output,
                "preprocess_device": args.preprocess_device,
                "image_decode": args.image_decode,
                "video_fps": args.video_fps, "max_video_frames": args.max_video_frames,
                "max_video_seconds": args.max_video_seconds,
                "cuda_graphs": not args.enforce_eager, "fused_kernels": not args.no_fused_kernels,
                "max_batch_items": args.max_batch_items, "max_batch_tokens": args.max_batch_tokens}

    def build_model(self) -> VisionEncoderModel:
        model = build_encoder_model(
            self.model_dir, device=self.device, dtype=self.dtype, dummy=self.config.dummy_weights,
            options=dict(self.config.model_options), metrics=self.metrics,
        )
        if self.config.warmup:
            model.warmup()
        return model

    def info(self) -> pb.ServiceInfo:
        info = super().info()
        if isinstance(self.model, VisionEncoderModel):
            info.extra.update(self.model.describe())
        return info
