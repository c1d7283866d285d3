"""Build and load the VAE decoder through the shared model protocol (modalmesh/models.py).

    model = build_decoder(cfg, dtype=torch.float32, seqlen_hint=64 * 64)   # on meta: no memory yet
    report = load_decoder(model, vae_dir, device="cuda", dtype=torch.float32)

The service builds at start-up (an attention override that cannot serve the model fails
there) and loads later, so the two halves are separate. What is read and how names map
is the decoder class's data (services/vae/models/autoencoder_kl.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from modalmesh.models import build_model, load_model_weights, pick
from modalmesh.weights import LoadReport, load_weights
from services.vae.config import VAEConfig
from services.vae.models import ARCHITECTURES, AutoencoderKLDecoder


def build_decoder(cfg: VAEConfig, *, dtype: torch.dtype, seqlen_hint: int | None = None,
                  fused_kernels: bool = True) -> AutoencoderKLDecoder:
    """The decoder on the meta device with its loader rules attached (no memory yet); `fused_kernels`: its
    GroupNorm(+SiLU) as Triton kernels on CUDA."""
    return build_model(pick(cfg, ARCHITECTURES, what="VAE"), cfg, dtype=dtype, seqlen_hint=seqlen_hint,
                       fused_kernels=fused_kernels)


def load_decoder(model: AutoencoderKLDecoder, vae_dir: str | Path, *, device, dtype: torch.dtype,
                 dummy: bool = False, metrics=None) -> LoadReport:
    return load_model_weights(model, vae_dir, device=device, dtype=dtype, dummy=dummy, metrics=metrics)


def load_decoder_state(model: AutoencoderKLDecoder, state, *, device, dtype: torch.dtype,
                       metrics=False) -> LoadReport:
    """Load from an in-memory AutoencoderKL state dict (benchmarks, GPU parity tests); encoder entries ignored."""
    items = ((k, v) for k, v in (state.items() if hasattr(state, "items") else state)
             if k.startswith(model.checkpoint_prefixes))
    return load_weights(model, items, model.weights_mapper, device=device, dtype=dtype, metrics=metrics)
