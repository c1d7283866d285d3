"""The OpenAI-compatible HTTP front of the stack (`python -m services.gateway`)."""
