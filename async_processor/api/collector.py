"""Results back into batches: read the API's result list, record each line once.

Stage: the API's consumer side. Input: results the daemon wrote to the API's result list
(``keys.result_list``), read through the client library's claimed-then-acknowledged
``drain_results`` (a result is removed only at the next read, after it was recorded).
Output: each line's output or error file line, counted in its batch (``Store.record``:
a result read twice counts once), and each single request's answer in its record
(``Store.finish_request``, once). Any other result is logged and dropped: nothing else
writes to this list.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

import anyio
import structlog
from redis.exceptions import RedisError

from async_processor.api import keys
from async_processor.api.lines import outcome, result_line
from async_processor.api.metrics import ApiMetrics
from async_processor.api.store import Recorded, Store
from async_processor.client import SortedSetClient, UndecodableResult
from async_processor.errors import TransportError
from async_processor.messages import Result

log = structlog.get_logger(__name__)

DRAIN = 200  # results per read
WAIT = 0.5  # seconds a read waits for the first result
BACKOFF = 1.0  # seconds between attempts while Redis refuses


async def collect(client: SortedSetClient, store: Store, metrics: ApiMetrics) -> None:
    """Forever: read a batch of results, record them (retrying until Redis takes them),
    then read on (which removes them from this replica's processing list)."""
    while True:
        try:
            results = await client.drain_results(DRAIN, WAIT)
        except TransportError as exc:
            log.warning("api_results_read_failed", error=str(exc))
            await anyio.sleep(BACKOFF)
            continue
        while results:
            try:
                await record_results(store, results, metrics)
                break
            except (RedisError, TransportError) as exc:
                log.warning("api_results_record_failed", error=str(exc), results=len(results))
                await anyio.sleep(BACKOFF)


async def record_results(
    store: Store, results: Sequence[Result], metrics: ApiMetrics | None = None
) -> None:
    by_batch: dict[str, list[tuple[int, Result]]] = defaultdict(list)
    for result in results:
        known = not isinstance(result, UndecodableResult)
        where = keys.parse_line_id(result.id) if known else None
        single = keys.parse_request_message_id(result.id) if known else None
        if where is not None:
            by_batch[where[0]].append((where[1], result))
        elif single is not None:
            new = await _finish_single(store, result, *single)
            if metrics is not None:
                metrics.lines.labels("recorded" if new else "dropped").inc()
        else:
            log.warning("api_result_dropped", request_id=result.id[:200], reason="not_ours")
            if metrics is not None:
                metrics.lines.labels("dropped").inc()
    for batch_id, found in by_batch.items():
        custom_ids = await store.custom_ids(batch_id, [index for index, _ in found])
        lines = [
            result_line(result, index, custom_id)
            for (index, result), custom_id in zip(found, custom_ids, strict=True)
            if custom_id is not None
        ]
        done = await store.record(batch_id, lines) if lines else Recorded(new=-1)
        if done.new < 0 or len(lines) < len(found):  # finalized (or deleted)
            log.info("api_results_for_closed_batch", batch_id=batch_id, results=len(found))
        if metrics is not None:
            _count(metrics, done, len(found))


async def _finish_single(store: Store, result: Result, tenant: str, request_id: str) -> bool:
    answer = outcome(result)
    status = "completed" if answer.ok else "failed"
    return await store.finish_request(tenant, request_id, status, answer.response, answer.error)


def _count(metrics: ApiMetrics, done: Recorded, results: int) -> None:
    new = max(done.new, 0)
    metrics.outcomes.labels("completed").inc(done.new_ok)
    metrics.outcomes.labels("failed").inc(new - done.new_ok)
    metrics.lines.labels("recorded").inc(new)
    metrics.lines.labels("dropped").inc(results - new)
    if new and done.answered == new:  # the batch's first results
        metrics.first_result.observe(max(0.0, time.time() - done.created_at))
