import sys

from modalmesh.flags import help_requested

if help_requested():  # the flags alone: no model stack (torch) to import for --help
    from services.llm.flags import parser

    parser().parse_args()  # prints the help and exits

from modalmesh import distributed  # noqa: E402
from modalmesh.service import run  # noqa: E402
from services.llm.server import LLMService  # noqa: E402

code = run(LLMService)
if distributed.joined_a_group():
    # Rank 0 of a tensor-parallel group: gloo / NCCL threads still alive at interpreter finalisation
    # can abort the process after a clean drain (see distributed.exit_rank).
    distributed.exit_rank(code)
sys.exit(code)
