"""Vision encoder service: images -> embedding rows for the LLM."""

from __future__ import annotations

from modalmesh import pb
from services.encoder.service import EncoderService


class VisionEncoderService(EncoderService):
    name = "vision_encoder"
    description = "modalmesh vision encoder: EncoderService over a vision tower."
    modality = pb.IMAGE
