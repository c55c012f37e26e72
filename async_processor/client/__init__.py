"""The producer side: a library to submit requests and read results, and the ``submit``,
``results`` and ``cancel`` commands."""

from async_processor.client.redis_sortedset import SortedSetClient, Submitted, UndecodableResult

__all__ = ["SortedSetClient", "Submitted", "UndecodableResult"]
