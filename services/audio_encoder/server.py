"""Audio encoder service: audio -> embedding rows for the LLM.

    python -m services.audio_encoder --model /models/Qwen2-Audio-7B-Instruct [--max-audio-seconds 600]
    python -m services.audio_encoder --model /models/whisper-large-v3 [--whisper-rows valid|full]

The shared EncoderService does validation, caching, batching and the protos;
this class builds the tower (services/audio_encoder/model.py).
"""

from __future__ import annotations

import argparse

from modalmesh import pb
from services.audio_encoder import flags as audio_flags
from services.audio_encoder.model import AudioEncoderModel, build_encoder_model
from services.encoder.service import EncoderService


class AudioEncoderService(EncoderService):
    name = audio_flags.NAME
    description = audio_flags.DESCRIPTION
    modality = pb.AUDIO

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        audio_flags.add_arguments(parser)

    @classmethod
    def model_options(cls, args: argparse.Namespace) -> dict:
        return {"max_audio_seconds": args.max_audio_seconds, "whisper_rows": args.whisper_rows,
                "preprocess_device": args.preprocess_device, "warmup": args.warmup,
                "cuda_graphs": not args.enforce_eager, "max_batch_tokens": args.max_batch_tokens,
                "fused_kernels": not args.no_fused_kernels}

    def build_model(self) -> AudioEncoderModel:
        return build_encoder_model(
            self.model_dir, device=self.device, dtype=self.dtype, dummy=self.config.dummy_weights,
            options=dict(self.config.model_options), metrics=self.metrics,
        )

    def info(self) -> pb.ServiceInfo:
        info = super().info()
        if isinstance(self.model, AudioEncoderModel):
            info.extra.update(self.model.describe())
        return info
