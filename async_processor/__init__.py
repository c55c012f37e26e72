"""async-processor: pulls LLM inference requests from queues and dispatches them to llm-d."""

__version__ = "0.1.0"
