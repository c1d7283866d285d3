"""The vision encoder's flags, declared without the model stack (`--help` imports no torch).

VisionEncoderService.add_arguments is `add_arguments`: the shared encoder flags, then the tower's.
"""

from __future__ import annotations

import argparse

from modalmesh.flags import service_parser
from services.encoder import flags as encoder_flags
from services.vision_encoder.decode_memory import DEFAULT_DECODE_MEMORY, DEFAULT_MAX_DECODED_BYTES, MiB

NAME = "vision_encoder"
DESCRIPTION = "modalmesh vision encoder: EncoderService over a vision tower."
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # decoded size limit (before resizing); PIL warns at 89 M
SIGLIP_OUTPUTS = ("patch", "pooled", "both")  # SigLIP's rows: patch embeddings, the pooled one, or both
PREPROCESS_DEVICES = ("auto", "cpu", "device")
IMAGE_DECODERS = ("auto", "pil", "nvimgcodec")  # device_decode.CHOICES (kept here: no torch for --help)
# Room for SigLIP-so400m's best batch on an H200 (32 images of 729 patches, bench/vision.py) and for
# 32 Qwen2-VL images of 448² (1024 patches each); the shared default (16384) stopped SigLIP at 22.
MAX_BATCH_TOKENS = 32768  # where resize / normalise / patchify run (device_preprocess.py)
# Video (video.py): frames sampled a second as vLLM and qwen-vl-utils sample Qwen2-VL video (transformers'
# Qwen2VLVideoProcessor leaves sampling off unless asked), at most this many (its max_frames is 768: a
# video of 768 frames at its pixel budget is over 70,000 tokens), from at most this long a video.
DEFAULT_VIDEO_FPS = 2.0
DEFAULT_MAX_VIDEO_FRAMES = 64
DEFAULT_MAX_VIDEO_SECONDS = 600.0
MAX_SOURCE_FPS = 240.0  # frames a second a video may hold: decoding work is bounded by its seconds x this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    encoder_flags.add_arguments(parser)
    parser.set_defaults(max_batch_tokens=MAX_BATCH_TOKENS)
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="largest decoded image accepted (width*height, checked before decoding)")
    parser.add_argument("--max-image-decoded-mb", type=float, default=DEFAULT_MAX_DECODED_BYTES / MiB,
                        help="largest decoded image accepted, in MiB (RGBA and 16-bit images take more per pixel)")
    parser.add_argument("--decode-memory-mb", type=float, default=DEFAULT_DECODE_MEMORY / MiB,
                        help="memory that concurrent image decodes may take together (a decode waits its turn)")
    parser.add_argument("--max-request-pixels", type=int, default=0,
                        help="largest per-item max_pixels budget a request may ask for "
                             "(0: the checkpoint's max_pixels)")
    parser.add_argument("--siglip-output", default="patch", choices=SIGLIP_OUTPUTS,
                        help="SigLIP rows: patch embeddings (after post_layernorm), the pooled embedding, "
                             "or both (patch rows, then the pooled row)")
    parser.add_argument("--preprocess-device", default="auto", choices=PREPROCESS_DEVICES,
                        help="where images are resized, normalised and patchified: cpu (exactly as HF's PIL "
                             "processors), device (uint8 uploaded, torch on the encoder's device; within a "
                             "stated tolerance of cpu), auto (device when the encoder runs on CUDA)")
    parser.add_argument("--video-fps", type=float, default=DEFAULT_VIDEO_FPS,
                        help="video (Qwen2-VL / Qwen2.5-VL): frames sampled per second of video, by the rule of "
                             "transformers' Qwen2VLVideoProcessor.sample_frames (needs the extra modalmesh[video])")
    parser.add_argument("--max-video-frames", type=int, default=DEFAULT_MAX_VIDEO_FRAMES,
                        help="video: most frames sampled from one video (rounded down to a multiple of the "
                             "temporal patch, 2); a longer video is sampled more sparsely")
    parser.add_argument("--max-video-seconds", type=float, default=DEFAULT_MAX_VIDEO_SECONDS,
                        help="video: longest video accepted, by its header, refused before any frame is decoded")
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="PyTorch's residual add + norm, rotary, SiLU*up and GELU on CUDA too (no Triton "
                             "kernels, no GEMM epilogue)")
    parser.add_argument("--image-decode", default="auto", choices=IMAGE_DECODERS,
                        help="who decodes JPEGs on the device preprocessing path: nvimgcodec (nvJPEG on the "
                             "encoder's GPU, the optional extra modalmesh[nvimgcodec]; within a stated tolerance "
                             "of PIL), pil (the CPU threads), auto (nvimgcodec when it loads); other formats are "
                             "always decoded by PIL")


def parser() -> argparse.ArgumentParser:
    built = service_parser(NAME, DESCRIPTION, max_message_mb=encoder_flags.MAX_MESSAGE_MB)
    add_arguments(built)
    return built
