"""Audio towers, one file per architecture (architecture only: no formats, no kernels).

The service picks one from ``ARCHITECTURES`` by the checkpoint's architectures / model_type;
each declares its checkpoint rules as class data (modalmesh.models.CheckpointModel).

    whisper.py       Whisper's encoder (shared by Qwen2-Audio), AudioEncoderDims, AudioTowerConfig
    qwen2_audio.py   Qwen2-Audio's tower: the Whisper encoder run packed, pooled, and its projector
"""

from services.audio_encoder.models.qwen2_audio import Qwen2AudioTower
from services.audio_encoder.models.whisper import (
    AudioEncoderDims,
    AudioTowerConfig,
    WhisperAudioEncoder,
    WhisperEncoder,
)

ARCHITECTURES = (WhisperAudioEncoder, Qwen2AudioTower)

__all__ = ["ARCHITECTURES", "AudioEncoderDims", "AudioTowerConfig", "Qwen2AudioTower", "WhisperAudioEncoder",
           "WhisperEncoder"]
