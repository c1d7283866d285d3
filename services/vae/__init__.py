"""VAE decoder service: diffusers AutoencoderKL decoders behind modalmesh.v1.VAEService (docs/vae.md)."""
