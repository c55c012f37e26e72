"""Broker failures counted by operation: ``llm_d_async_async_broker_errors_total``.

Stage: the error path of every broker call (``redis.conn.redis_errors``, Pub/Sub's
``Readiness.rpc``), which has no metrics object of its own. Input: the failed operation's
name. Output: +1 on the running daemon's counter, found through a context variable that
``pipeline.processor`` sets for its tasks; outside a daemon (operator tools) nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from prometheus_client import Counter

_BROKER_ERRORS: ContextVar[Counter | None] = ContextVar("broker_errors", default=None)


@contextmanager
def counting_broker_errors(family: Counter) -> Iterator[None]:
    """Within this block (and the tasks it starts), ``broker_error`` counts on ``family``."""
    token = _BROKER_ERRORS.set(family)
    try:
        yield
    finally:
        _BROKER_ERRORS.reset(token)


def broker_error(operation: str) -> None:
    """One broker call failed; counted when a daemon is running (not in operator tools)."""
    family = _BROKER_ERRORS.get()
    if family is not None:
        family.labels(operation.replace(" ", "_").replace("-", "_")).inc()
