"""The daemon: its stages, in the order a message meets them.

- ``daemon``: the process around the processor (signals, hard stop, tracing setup).
- ``processor``: wiring, one task group; start, ready, drain, stop.
- ``discovery``: finds the queues a pattern names and starts or stops their pollers.
- ``reload``: re-reads the transport config file and applies its queues (hot reload).
- ``running``: the pollers running now, each started and stopped on its own.
- ``poller``: one per queue; fetches under the queue gate's budget, into a merge lane.
- ``intake``: the poller's fetched batch admitted one message at a time (queue gate).
- ``idle_gates``: reads the gates of queues waiting for a message (true gauges).
- ``held``: what waits in memory for a worker, answered at its deadline.
- ``admission``: the pool gates' verdicts on each message (Continue, Refuse, Drop, Wait).
- ``worker``: one message's life (admit, build, send, classify, settle).
- ``dispatch``: builds the gateway request (headers, deadline) and sends it.
- ``cancels``: cancellation markers cut a message queued or in flight.
- ``usage``: token accounting from the gateway's answer.
- ``backlog``: the broker backlog poll (depth, availability, deadline proximity).
- ``tracing``: spans around a message's trip (OpenTelemetry, optional).
- ``settle``: turns an outcome into a result, a retry or a hand-back on the broker.
- ``results``: the result writer (bounded batches to the transport).
- ``capacity``: pool slots, shedding and prefetch sizing.
"""

from typing import TYPE_CHECKING

from async_processor.registry import lazy_exports

if TYPE_CHECKING:
    from async_processor.pipeline.daemon import run, validate_plugins
    from async_processor.pipeline.processor import Processor

__all__ = ["Processor", "run", "validate_plugins"]

# Lazy: a stage imported on its own (a test, a benchmark) does not load the whole daemon.
__getattr__ = lazy_exports(
    __name__,
    {
        "Processor": "async_processor.pipeline.processor",
        "run": "async_processor.pipeline.daemon",
        "validate_plugins": "async_processor.pipeline.daemon",
    },
)
