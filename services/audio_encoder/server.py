"""Audio encoder service: audio -> embedding rows for the LLM."""

from __future__ import annotations

from modalmesh import pb
from services.encoder.service import EncoderService


class AudioEncoderService(EncoderService):
    name = "audio_encoder"
    description = "modalmesh audio encoder: EncoderService over an audio tower."
    modality = pb.AUDIO
