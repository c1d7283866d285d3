"""IEEE float32 on CUDA for parity tests.

cuDNN takes float32 convolutions as TF32 by default (matmuls are already IEEE: float32_matmul_precision
defaults to "highest"), so a CUDA-against-CPU comparison would measure TF32's rounding in a stem or a VAE
conv, not the difference under test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def ieee_fp32_convolutions() -> Iterator[None]:
    assert torch.get_float32_matmul_precision() == "highest"
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):  # torch >= 2.9; do not mix with allow_tf32
        old, conv.fp32_precision = conv.fp32_precision, "ieee"
        try:
            yield
        finally:
            conv.fp32_precision = old
    else:
        old, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
        try:
            yield
        finally:
            torch.backends.cudnn.allow_tf32 = old
