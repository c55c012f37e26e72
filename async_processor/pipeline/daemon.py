"""The process around the daemon: signals, the hard stop, tracing setup.

Input: a validated ``AppConfig`` (from ``cli.main``). Output: a ``Processor`` run until
SIGTERM/SIGINT and drained; a second signal hands back at once, and a stop that outlives
its drain timeout by ``HARD_STOP_GRACE`` exits the process (``HARD_STOP_EXIT``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading

import anyio
import structlog

from async_processor.config import AppConfig
from async_processor.pipeline import tracing
from async_processor.pipeline.processor import Processor
from async_processor.transforms import build_transform_chain
from async_processor.transforms.base import TransformContext

log = structlog.get_logger(__name__)

# The last resort of a stop, this long after its first signal past the drain timeout:
# the stop's own bound (docs/operations.md: ~40 s with Redis hung) and room to spare.
HARD_STOP_GRACE = 60.0
HARD_STOP_EXIT = 124  # as timeout(1): the process was stopped, not drained


def validate_plugins(config: AppConfig) -> None:
    """Build every gate, merge policy, transform and transport, starting none (check-config)."""
    Processor(config)
    build_transform_chain(config.transforms, TransformContext())


async def run(config: AppConfig) -> None:
    """The daemon: run until SIGTERM/SIGINT, drain, exit (flushing spans if tracing)."""
    tracing.setup()
    try:
        processor = Processor(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, processor)
            await processor.run()
            tg.cancel_scope.cancel()
    finally:
        tracing.shutdown()


async def _watch_signals(processor: Processor) -> None:
    hard_stop: threading.Timer | None = None
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        try:
            count = 0
            async for signum in signals:
                count += 1
                log.info("signal_received", signal=signal.Signals(signum).name, count=count)
                if hard_stop is None:
                    drain = processor.config.runtime.drain_timeout
                    hard_stop = hard_stop_after(drain + HARD_STOP_GRACE)
                processor.request_stop(force=count > 1)
        finally:
            if hard_stop is not None:  # stopped in time
                hard_stop.cancel()


def hard_stop_after(seconds: float) -> threading.Timer:
    """Exit the process in ``seconds`` unless the timer is cancelled first.

    Every stage's stop is bounded, but one that is not (a loop that never saw its
    cancellation hung the soak at exit) must not keep the process up for good. A thread,
    so it fires even with the event loop stuck. Nothing is lost: what the process still
    holds is leased, and comes back when the lease lapses (docs/architecture.md G1).
    """
    timer = threading.Timer(seconds, _hard_stop, args=(seconds,))
    timer.daemon = True
    timer.start()
    return timer


def _hard_stop(seconds: float) -> None:
    log.error("hard_stop", after_seconds=seconds, exit_code=HARD_STOP_EXIT)
    faulthandler.dump_traceback(all_threads=True)  # where it hung, for the bug report
    os._exit(HARD_STOP_EXIT)
