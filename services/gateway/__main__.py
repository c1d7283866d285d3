"""`python -m services.gateway --llm TARGET [--vae TARGET] --port 8000`: the OpenAI-compatible HTTP front."""
import sys

from services.gateway.server import main

sys.exit(main())
