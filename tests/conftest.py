"""Shared fixtures: each real server lives in its own plugin module under tests/fixtures.

Markers (``redis``, ``pubsub``, ``prometheus``, ``gcp``) are set here from the fixtures a
test uses, so ``-m "not pubsub"`` deselects every test that would start the emulator
without each test saying so; tests that pick a broker at run time (the transport
contract) mark their parameters instead.
"""

import pytest

pytest_plugins = [
    "tests.fixtures.servers",
    "tests.fixtures.simulator",
    "tests.fixtures.daemon",
    "tests.fixtures.api",
    "tests.fixtures.prometheus",
    "tests.fixtures.pubsub",
    "tests.fixtures.otlp",
    "tests.fixtures.redis_cluster",
    "tests.fixtures.redis_modes",
    "tests.fixtures.logstate",
    "tests.fixtures.httpclients",
]

# Fixture -> the markers a test using it (directly or through other fixtures) gets.
SERVICE_MARKERS = {
    "redis_server": ("redis",),
    "private_redis": ("redis",),
    "auth_redis_url": ("redis",),
    "tls_redis": ("redis",),
    "sentinel_group": ("redis",),
    "redis_cluster": ("redis",),
    "redis_cluster_replicated": ("redis",),
    "pubsub_emulator": ("pubsub", "gcp"),
    "prometheus_factory": ("prometheus",),
}


@pytest.fixture
def anyio_backend() -> str:
    """Every async test and fixture runs on asyncio (the daemon's event loop)."""
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = getattr(item, "fixturenames", ())
        for marker in sorted({m for name in used for m in SERVICE_MARKERS.get(name, ())}):
            item.add_marker(marker)
