"""The OpenAI-compatible front door: ``async-processor api`` (docs/batch-api.md).

Stage: outside the daemon, a producer and consumer of its queues. Input: HTTP calls of
OpenAI's Files and Batches API. Output: queue messages (one per batch line) and, from
their results, the batch's output and error files. Modules: ``app`` (command, wiring),
``auth``, ``errors``, ``files`` and ``batches`` (routes), ``lines`` (line checks, results
to output lines), ``runner`` (drives batches, collects results), ``store`` (Redis state),
``storage`` (file bytes), ``keys`` (key names).
"""
