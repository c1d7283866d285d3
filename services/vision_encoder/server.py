"""Vision encoder service: images -> embedding rows for the LLM."""

from __future__ import annotations

from modalmesh import pb
from modalmesh.service import Service
from services.encoder_servicer import register_encoder


class VisionEncoderService(Service):
    name = "vision_encoder"
    grpc_service = pb.ENCODER_SERVICE
    description = "modalmesh vision encoder: EncoderService over a vision tower."
    max_message_mb = 128
    modality = pb.IMAGE

    def register(self, server) -> None:
        register_encoder(self, server)
