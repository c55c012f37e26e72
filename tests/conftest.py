"""Shared fixtures: each real server lives in its own plugin module under tests/fixtures."""

pytest_plugins = [
    "tests.fixtures.servers",
    "tests.fixtures.simulator",
    "tests.fixtures.daemon",
    "tests.fixtures.prometheus",
    "tests.fixtures.pubsub",
    "tests.fixtures.otlp",
    "tests.fixtures.redis_modes",
    "tests.fixtures.logstate",
]
