import sys

from modalmesh import distributed
from modalmesh.service import run
from services.llm.server import LLMService

code = run(LLMService)
if distributed.joined_a_group():
    # Rank 0 of a tensor-parallel group: gloo / NCCL threads still alive at interpreter finalisation
    # can abort the process after a clean drain (see distributed.exit_rank).
    distributed.exit_rank(code)
sys.exit(code)
