"""async-processor: pulls LLM inference requests from queues and dispatches them to llm-d.

The names a user needs, imported at first use (``import async_processor`` loads none of
them): the client library (``SortedSetClient``), the request and result messages, and the
exception roots. The daemon's stages are ``pipeline/``; the plug-in families are
``transports/``, ``gates/``, ``merge/``, ``transforms/`` and ``httpclients/``.
"""

from typing import TYPE_CHECKING

from async_processor.registry import lazy_exports

if TYPE_CHECKING:
    from async_processor.client.redis_sortedset import SortedSetClient
    from async_processor.errors import AsyncProcessorError, ConfigError, TransportError
    from async_processor.messages import ErrorCode, Request, Result

__version__ = "0.1.0"

__all__ = [
    "AsyncProcessorError",
    "ConfigError",
    "ErrorCode",
    "Request",
    "Result",
    "SortedSetClient",
    "TransportError",
    "__version__",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "SortedSetClient": "async_processor.client.redis_sortedset",
        "Request": "async_processor.messages",
        "Result": "async_processor.messages",
        "ErrorCode": "async_processor.messages",
        "AsyncProcessorError": "async_processor.errors",
        "ConfigError": "async_processor.errors",
        "TransportError": "async_processor.errors",
    },
)
