"""The VAE service's flags, declared without the model stack: `python -m services.vae --help` imports no torch.

VAEDecoderService.add_arguments is `add_arguments`; `VAEServiceConfig.from_args` reads what they parse.
"""

from __future__ import annotations

import argparse

from modalmesh.flags import service_parser

NAME = "vae"
DESCRIPTION = "modalmesh VAE service: latents -> PNG or pixel tensors."
MAX_MESSAGE_MB = 256  # responses carry full-resolution images


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("VAE decoding")
    g.add_argument("--max-batch", type=int, default=8, help="images per decoder call (equal latent shapes)")
    g.add_argument("--max-queue", type=int, default=64, help="requests waiting; beyond: RESOURCE_EXHAUSTED")
    g.add_argument("--max-images", type=int, default=16, help="images per request")
    g.add_argument("--max-latent-side", type=int, default=1024, help="largest latent height/width accepted")
    g.add_argument("--tile-size", type=int, default=0,
                   help="latent pixels per tile side (0: config sample_size / scale factor, as diffusers)")
    g.add_argument("--tile-overlap", type=int, default=-1, help="latent overlap of tiles (-1: tile size / 4)")
    g.add_argument("--tile-threshold", type=int, default=0,
                   help="AUTO tiling when a latent side exceeds this (0: the tile size)")
    g.add_argument("--tile-batch", type=int, default=4, help="tiles per decoder call when tiling")
    g.add_argument("--max-decode-seconds", type=float, default=300.0,
                   help="a decoder call stops past this (DEADLINE_EXCEEDED), keeping the queue moving; 0: none")
    g.add_argument("--max-untiled-mb", type=int, default=0,
                   help="AUTO tiling when an untiled decode would need more (0: free device memory on CUDA)")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC activations (default: on CUDA with the fused kernels, whose GroupNorm keeps NHWC; "
                        "cuDNN converts NCHW to NHWC around each convolution)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, decodes of the tile's shape (each tile, and images of the tile's size) replayed "
                        "from CUDA graphs, one per batch of 1..--tile-batch (fewer where memory is short), "
                        "captured before SERVING")
    g.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN time conv algorithms per shape")
    g.add_argument("--no-fused-kernels", action="store_true",
                   help="PyTorch's GroupNorm and SiLU on CUDA too (no Triton kernels)")
    g.add_argument("--png-compress-level", type=int, default=1, choices=range(10), metavar="0-9")


def parser() -> argparse.ArgumentParser:
    built = service_parser(NAME, DESCRIPTION, max_message_mb=MAX_MESSAGE_MB)
    add_arguments(built)
    return built
