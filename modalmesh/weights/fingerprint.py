"""A fingerprint of a checkpoint: equal for every pod that loads part of it.

Digest of config.json and of every safetensors header (tensor names, dtypes,
shapes, offsets) plus file sizes: cheap (no tensor bytes are read), and it
changes whenever the weights' layout or any file's size changes. The LLM
compares an encoder's fingerprint with its own before splicing embeddings.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    root = Path(model_dir)
    digest = hashlib.sha256()
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and (p.name == "config.json" or p.name.endswith(_WEIGHT_SUFFIXES))
    )
    for path in files:
        rel = path.relative_to(root).as_posix()
        size = path.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        if path.name == "config.json":
            digest.update(path.read_bytes())
        elif path.suffix == ".safetensors" and size >= 8:
            with path.open("rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                digest.update(f.read(min(header_len, size - 8)))
    return "sha256:" + digest.hexdigest()[:32]
