"""Fixtures of the conformance suite: a Go-shaped producer and result reader on one
queue of the shared redis-server (the simulator fixtures come from tests/fixtures)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from tests.conformance.go_side import GoProducer, GoResultReader
from tests.conformance.support import GoSide


@pytest.fixture
def r(redis_client: Redis) -> Redis:
    return redis_client


@pytest.fixture
async def go(r: Redis, unique: str) -> AsyncIterator[GoSide]:
    """A Go producer (inline payloads) and a Go result reader on ``<unique>`` and its
    result list ``<unique>:results`` (the names ``sortedset_config`` gives the daemon)."""
    results = f"{unique}:results"
    yield GoSide(unique, results, GoProducer(r, unique, results), GoResultReader(r, results))
