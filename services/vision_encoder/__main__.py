import sys

from modalmesh.service import run
from services.vision_encoder.server import VisionEncoderService

sys.exit(run(VisionEncoderService))
