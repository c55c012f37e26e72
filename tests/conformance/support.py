"""Helpers of the conformance suite: the row marker, deadlines, polling."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from tests.conformance.go_side import GoProducer, GoResultReader


def upstream(*rows: str) -> pytest.MarkDecorator:
    """The parts of shared/reference/upstream-v0.10.md a test covers (``§4``, ``§14.3``):
    ``test_rows.py`` checks that every required row has a test and that
    docs/migrating-from-go.md lists them."""
    return pytest.mark.upstream(*rows)


def deadline_in(seconds: int) -> int:
    return int(time.time()) + seconds


async def wait_until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll ``check()`` (sync or async) until it returns something true, and return it
    (load-proof: a generous timeout, no sleep-and-assert)."""
    with anyio.fail_after(timeout):
        while True:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await anyio.sleep(0.05)


@dataclass
class GoSide:
    """A Go producer and a Go result reader on one queue and its result list."""

    queue: str
    results: str
    producer: GoProducer
    reader: GoResultReader
