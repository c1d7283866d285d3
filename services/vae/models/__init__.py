"""VAE architectures (one file each, architecture only)."""

from services.vae.models.autoencoder_kl import AutoencoderKLDecoder

__all__ = ["AutoencoderKLDecoder"]
