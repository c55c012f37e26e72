"""The daemon: its stages, in the order a message meets them.

- ``daemon``: the process around the processor (signals, hard stop, tracing setup).
- ``processor``: wiring, one task group; start, ready, drain, stop.
- ``discovery``: finds the queues a pattern names and starts or stops their pollers.
- ``poller``: one per queue; fetches under the queue gate's budget, into a merge lane.
- ``admission``: the pool gates' verdicts on each message (Continue, Refuse, Drop, Wait).
- ``worker``: one message's life (admit, build, send, classify, settle).
- ``dispatch``: builds the gateway request (headers, deadline) and sends it.
- ``cancels``: cancellation markers cut a message queued or in flight.
- ``usage``: token accounting from the gateway's answer.
- ``tracing``: spans around a message's trip (OpenTelemetry, optional).
- ``settle``: turns an outcome into a result, a retry or a hand-back on the broker.
- ``results``: the result writer (bounded batches to the transport).
- ``capacity``: pool slots, shedding and prefetch sizing.
"""
