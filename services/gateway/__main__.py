"""`python -m services.gateway --llm TARGET [--vae TARGET] --port 8000`: the OpenAI-compatible HTTP front."""
import sys

from modalmesh.flags import help_requested

if help_requested():  # the flags alone: the server's imports (torch, through the process shell) wait
    from services.gateway.config import build_parser

    build_parser().parse_args()  # prints the help and exits

from services.gateway.server import main  # noqa: E402

sys.exit(main())
