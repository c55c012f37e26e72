"""The producer side: a library to submit requests and read results, and the ``submit``,
``results`` and ``cancel`` commands (``commands``)."""

from typing import TYPE_CHECKING

from async_processor.registry import lazy_exports

if TYPE_CHECKING:
    from async_processor.client.redis_sortedset import (
        SortedSetClient,
        Submitted,
        UndecodableResult,
    )

__all__ = ["SortedSetClient", "Submitted", "UndecodableResult"]

__getattr__ = lazy_exports(
    __name__,
    dict.fromkeys(__all__, "async_processor.client.redis_sortedset"),
)
