"""Audio towers, one file per architecture (architecture only: no formats, no kernels)."""

from services.audio_encoder.models.qwen2_audio import Qwen2AudioTower
from services.audio_encoder.models.whisper import AudioEncoderDims, WhisperAudioEncoder, WhisperEncoder

__all__ = ["AudioEncoderDims", "Qwen2AudioTower", "WhisperAudioEncoder", "WhisperEncoder"]
