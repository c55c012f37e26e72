"""Admission control gates (queue level and pool level); see ``gates.base``."""

from __future__ import annotations

import importlib

# Modules that register gate types in ``GATES`` when imported.
_GATE_MODULES: tuple[str, ...] = (
    "basic",
    "adaptive",
    "redis",
    "leased_rate",
    "prometheus",
    "scrape",
    "tiers",
)


def load_all() -> None:
    for name in _GATE_MODULES:
        importlib.import_module(f"async_processor.gates.{name}")
