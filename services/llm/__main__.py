import sys

from modalmesh.service import run
from services.llm.server import LLMService

sys.exit(run(LLMService))
