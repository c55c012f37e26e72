"""The OpenAI-compatible inference simulator (``async-processor sim``): stands alone, it
imports nothing of the daemon."""

from typing import TYPE_CHECKING

from async_processor.registry import lazy_exports

if TYPE_CHECKING:
    from async_processor.sim.app import Simulator, main
    from async_processor.sim.config import SimConfig

__all__ = ["SimConfig", "Simulator", "main"]

__getattr__ = lazy_exports(
    __name__,
    {
        "Simulator": "async_processor.sim.app",
        "main": "async_processor.sim.app",
        "SimConfig": "async_processor.sim.config",
    },
)
