"""`python -m services.vae --model DIR`: the VAE decoder service."""
import sys

from modalmesh.service import run
from services.vae.server import VAEDecoderService

sys.exit(run(VAEDecoderService))
