import sys

from modalmesh.service import run
from services.audio_encoder.server import AudioEncoderService

sys.exit(run(AudioEncoderService))
