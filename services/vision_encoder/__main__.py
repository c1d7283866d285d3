import sys

from modalmesh.flags import help_requested

if help_requested():  # the flags alone: no model stack (torch) to import for --help
    from services.vision_encoder.flags import parser

    parser().parse_args()  # prints the help and exits

from modalmesh.service import run  # noqa: E402
from services.vision_encoder.server import VisionEncoderService  # noqa: E402

sys.exit(run(VisionEncoderService))
