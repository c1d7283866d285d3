"""Fused Triton kernels for the decoder layers' small elementwise steps (CUDA only).

At batch 1 a decode step is mostly tiny kernels: RMSNorm is eight of them, the
rotary embedding and the KV write another dozen per layer. Each module here
does one such step in one kernel, with the reference numerics of the unfused
PyTorch path it replaces (the same roundings to the activation dtype):

    norm.py      residual add + RMSNorm (and RMSNorm alone)
    activation.py  SiLU(gate) * up over a fused gate|up projection
    rotary.py    RoPE of q and k + the write of k and v into the paged KV pool
    gemv.py      a weight product of one row (batch-1 decode), where cuBLAS leaves bandwidth unused;
                 routed by the linear layers' `gemv` flag (`enable_gemv`, the LLM's --no-gemv-kernels)
    paged_prefill.py  causal attention of prompt chunks over a cached prefix in the paged KV pool, blocks of
                 a chunk's tokens reading each key block once (the `triton_paged` backend's eager mixed steps)

A layer calls a kernel only when it was built with ``fused=True`` (the LLM's
``--fused-kernels``), its tensors are on a CUDA device and Triton imports
(`usable`); everything else runs the PyTorch path, which stays the reference.
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors, for debugging.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on `x`'s device."""
    if not triton_importable():
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def block(n: int) -> int:
    """The power-of-two block that covers `n` elements."""
    return 1 << max(n - 1, 0).bit_length()
