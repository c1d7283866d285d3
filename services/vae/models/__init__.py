"""VAE architectures (one file each, architecture and checkpoint rules as class data).

The service picks one from ``ARCHITECTURES`` by the config's ``_class_name`` (modalmesh/models.py).

    autoencoder_kl.py   AutoencoderKL's decoder (SD 1.x/2.x, SDXL, SD3, FLUX) and its legacy-name rules
"""

from services.vae.models.autoencoder_kl import AutoencoderKLDecoder

ARCHITECTURES = (AutoencoderKLDecoder,)

__all__ = ["ARCHITECTURES", "AutoencoderKLDecoder"]
