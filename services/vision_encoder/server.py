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
from services.vision_encoder.models.siglip import OUTPUTS
from services.vision_encoder.decode_memory import DEFAULT_DECODE_MEMORY, DEFAULT_MAX_DECODED_BYTES, MiB
from services.vision_encoder.preprocess import DEFAULT_MAX_IMAGE_PIXELS


class VisionEncoderService(EncoderService):
    name = "vision_encoder"
    description = "modalmesh vision encoder: EncoderService over a vision tower."
    modality = pb.IMAGE

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                            help="largest decoded image accepted (width*height, checked before decoding)")
        parser.add_argument("--max-image-decoded-mb", type=float, default=DEFAULT_MAX_DECODED_BYTES / MiB,
                            help="largest decoded image accepted, in MiB (RGBA and 16-bit images take more per pixel)")
        parser.add_argument("--decode-memory-mb", type=float, default=DEFAULT_DECODE_MEMORY / MiB,
                            help="memory that concurrent image decodes may take together (a decode waits its turn)")
        parser.add_argument("--max-request-pixels", type=int, default=0,
                            help="largest per-item max_pixels budget a request may ask for "
                                 "(0: the checkpoint's max_pixels)")
        parser.add_argument("--siglip-output", default="patch", choices=OUTPUTS,
                            help="SigLIP rows: patch embeddings (after post_layernorm), the pooled embedding, "
                                 "or both (patch rows, then the pooled row)")

    @classmethod
    def model_options(cls, args: argparse.Namespace) -> dict:
        return {"max_image_pixels": args.max_image_pixels,
                "max_image_decoded_bytes": int(args.max_image_decoded_mb * MiB),
                "decode_memory_bytes": int(args.decode_memory_mb * MiB),
                "max_request_pixels": args.max_request_pixels,
                "siglip_output": args.siglip_output}

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
