import sys

from modalmesh.service import run
from services.vae.server import VAEDecoderService

sys.exit(run(VAEDecoderService))
