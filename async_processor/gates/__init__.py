"""Admission control gates (queue level and pool level); the seam is ``gates.base``.

Gate types register in ``GATES``, which imports their modules at its first lookup
(``registry.Registry``). Import from this package, not from ``base``.
"""

from async_processor.gates.base import (
    GATES,
    Action,
    Gate,
    GateContext,
    GateOwner,
    Observes,
    Releases,
    Verdict,
    WaitsForChange,
    build_gate,
)

__all__ = [
    "GATES",
    "Action",
    "Gate",
    "GateContext",
    "GateOwner",
    "Observes",
    "Releases",
    "Verdict",
    "WaitsForChange",
    "build_gate",
]
