"""The flags both encoders share, declared without the model stack (`--help` imports no torch).

EncoderService.add_arguments is `add_arguments`; each encoder's own flags.py adds its tower's.
"""

from __future__ import annotations

import argparse

MAX_MESSAGE_MB = 128
MAX_BATCH_ITEMS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="batch budget in patches (vision) or mel frames (audio)")
    parser.add_argument("--max-batch-items", type=int, default=MAX_BATCH_ITEMS)
    parser.add_argument("--batch-window-ms", type=float, default=2.0,
                        help="how long a batch waits for concurrent requests to join")
    parser.add_argument("--batches-in-flight", type=int, default=2,
                        help="batches queued on the device at once: after launching a batch, the worker waits "
                             "until no more than this many are unfinished")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's CPU threads per parallel op in this process (default: torch's own)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="Python's GIL switch interval for this process (default: Python's, 5 ms)")
    parser.add_argument("--max-queue", type=int, default=1024, help="queued items beyond this: RESOURCE_EXHAUSTED")
    parser.add_argument("--max-items-per-request", type=int, default=64)
    parser.add_argument("--cache-mb", type=int, default=256, help="embedding cache size (0 disables)")
    parser.add_argument("--preprocess-threads", type=int, default=4)
    parser.add_argument("--shared-memory-transfer", choices=("auto", "off"), default="auto",
                        help="auto: answer clients that prove they share this host's /dev/shm through shared "
                             "memory instead of message bytes; off: always bytes")
    parser.add_argument("--shared-memory-mb", type=int, default=1024,
                        help="most /dev/shm the answers may hold at once (beyond it they go as bytes)")
    parser.add_argument("--shared-memory-ttl", type=float, default=30.0,
                        help="seconds a shared-memory answer waits for its reader before its slab is retired")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run fixed-shape towers (SigLIP, Whisper) eagerly instead of replaying CUDA graphs "
                             "per batch size")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the warm-up forward before turning SERVING")
