"""The OpenAI-compatible inference simulator (``async-processor sim``): stands alone, it
imports nothing of the daemon."""
