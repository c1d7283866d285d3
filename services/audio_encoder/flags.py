"""The audio encoder's flags, declared without the model stack (`--help` imports no torch).

AudioEncoderService.add_arguments is `add_arguments`: the shared encoder flags, then the tower's.
"""

from __future__ import annotations

import argparse

from modalmesh.flags import service_parser
from services.encoder import flags as encoder_flags

NAME = "audio_encoder"
DESCRIPTION = "modalmesh audio encoder: EncoderService over an audio tower (Whisper, Qwen2-Audio)."
DEFAULT_MAX_AUDIO_SECONDS = 600.0
WHISPER_ROWS = ("valid", "full")
PREPROCESS_DEVICES = ("auto", "cpu", "device")
# 16 windows of 30 s (3000 mel frames each): Whisper-large's best batch on an H200 (bench/audio.py).
MAX_BATCH_TOKENS = 48000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    encoder_flags.add_arguments(parser)
    parser.set_defaults(max_batch_tokens=MAX_BATCH_TOKENS)
    parser.add_argument("--max-audio-seconds", type=float, default=DEFAULT_MAX_AUDIO_SECONDS,
                        help="longest clip accepted (longer: INVALID_ARGUMENT)")
    parser.add_argument("--whisper-rows", default="valid", choices=WHISPER_ROWS,
                        help="Whisper: rows covering the valid audio of each 30 s window, or all 1500")
    parser.add_argument("--preprocess-device", default="auto", choices=PREPROCESS_DEVICES,
                        help="where resampling and log-mel run: the CPU pool (exact to HF's feature extractor), "
                             "the encoder's device, or auto (the device on CUDA, else the CPU)")
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="PyTorch's residual add + LayerNorm on CUDA too (no Triton kernel)")


def parser() -> argparse.ArgumentParser:
    built = service_parser(NAME, DESCRIPTION, max_message_mb=encoder_flags.MAX_MESSAGE_MB)
    add_arguments(built)
    return built
