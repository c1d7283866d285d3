"""Audio encoder service: audio -> embedding rows for the LLM."""

from __future__ import annotations

from modalmesh import pb
from modalmesh.service import Service
from services.encoder_servicer import register_encoder


class AudioEncoderService(Service):
    name = "audio_encoder"
    grpc_service = pb.ENCODER_SERVICE
    description = "modalmesh audio encoder: EncoderService over an audio tower."
    max_message_mb = 128
    modality = pb.AUDIO

    def register(self, server) -> None:
        register_encoder(self, server)
