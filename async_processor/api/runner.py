"""Drives each open batch through its statuses: validate, submit, finalize, cancel.

Stage: the API's producer side (and, beside it, the result collector and the retention
sweep). Input: the open batches in the store. Output: their
lines as queue messages (through the client library, in bounded chunks from a saved
cursor), their status moved on by compare-and-set, and at the end their output and
error files (``finish``). One replica drives a batch at a time (a lease it renews at
every step); every step is idempotent, so a replica that takes over (or a restart)
resumes where the last one stopped (docs/batch-api.md, "Design").
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
import structlog
from anyio.abc import TaskGroup
from redis.exceptions import RedisError

from async_processor.api import keys
from async_processor.api.collector import collect
from async_processor.api.context import Context
from async_processor.api.finish import CANCELLED, EXPIRED, close_lines, finalize
from async_processor.api.lines import bodies, check_lines, line_request
from async_processor.api.metrics import OPEN_STATUSES
from async_processor.api.replicas import keep_watch
from async_processor.api.retention import keep_retention
from async_processor.api.store import TERMINAL, as_int
from async_processor.client import SortedSetClient
from async_processor.errors import TransportError

log = structlog.get_logger(__name__)

SUBMIT_CHUNK = 500  # lines per submission round trip
TICK = 0.5  # seconds between looks at the open batches
WAIT = 0.2  # seconds a driver waits for results before it looks again
MAX_DRIVERS = 64  # batches one replica drives at once
IDS_CHUNK = 1000  # custom ids per HSET
STATUS_EVERY = 5.0  # seconds between counts of the open batches by status


class Runner:
    def __init__(self, ctx: Context, client: SortedSetClient, replica: str) -> None:
        self.ctx, self.client, self.replica = ctx, client, replica
        self._driving: set[str] = set()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, self.client, self.ctx.store, self.ctx.metrics)
            tg.start_soon(keep_retention, self.ctx, self.replica, self.ctx.retention_every)
            redis, results, timeout = (
                self.ctx.store.redis,
                self.client.result_queue,
                self.ctx.replica_timeout,
            )
            tg.start_soon(keep_watch, redis, results, self.replica, timeout)
            tg.start_soon(self._count_statuses)
            while True:
                await self._schedule(tg)
                await anyio.sleep(TICK)

    async def _count_statuses(self) -> None:
        """The open batches by status, on the ``batches`` gauge (read from Redis, so
        every replica shows all of them)."""
        while True:
            try:
                ids = await self.ctx.store.open_batches(limit=100_000)
                statuses = await self.ctx.store.statuses(ids)
                for status in OPEN_STATUSES:
                    self.ctx.metrics.open_batches.labels(status).set(statuses.count(status))
            except (RedisError, TransportError) as exc:
                log.warning("api_status_count_failed", error=str(exc))
            await anyio.sleep(STATUS_EVERY)

    async def _schedule(self, tg: TaskGroup) -> None:
        store = self.ctx.store
        for batch_id in await store.open_batches():
            if batch_id in self._driving or len(self._driving) >= MAX_DRIVERS:
                continue
            if await store.lease(batch_id, self.replica):
                self._driving.add(batch_id)
                tg.start_soon(self._drive, batch_id)

    async def _drive(self, batch_id: str) -> None:
        driver = Driver(self, batch_id)
        try:
            while await driver.step():
                if not await self.ctx.store.lease(batch_id, self.replica):
                    log.info("api_batch_lease_lost", batch_id=batch_id)
                    return
        except Exception:  # the scheduler starts it again; nothing is half-done for long
            log.exception("api_batch_step_failed", batch_id=batch_id)
            await anyio.sleep(TICK)
        finally:
            self._driving.discard(batch_id)


class Driver:
    """One batch's steps in this replica; ``step`` says whether there is more to do."""

    def __init__(self, runner: Runner, batch_id: str) -> None:
        self.ctx, self.client, self.batch_id = runner.ctx, runner.client, batch_id
        self._lines: AsyncIterator[tuple[int, bytes]] | None = None

    async def step(self) -> bool:
        record = await self.ctx.store.batch(self.batch_id)
        if record is None or record["status"] in TERMINAL:
            # Deleted by hand, or a crash between its last status and this: off the lists.
            await self.ctx.store.closed(self.batch_id)
            return False
        status = record["status"]
        if status in ("validating", "in_progress") and time.time() >= int(record["deadline"]):
            await close_lines(self.ctx, self.client, record, *EXPIRED)
            await finalize(self.ctx, record, status, "expired")
        elif status == "validating":
            await self._validate(record)
        elif status == "in_progress":
            await self._progress(record)
        elif status == "cancelling":
            await close_lines(self.ctx, self.client, record, *CANCELLED)
            await finalize(self.ctx, record, "cancelling", "cancelled")
        elif status == "finalizing":
            await finalize(self.ctx, record, "finalizing", "completed")
        return True

    async def _validate(self, record: dict[str, str]) -> None:
        store, batch_id = self.ctx.store, self.batch_id
        try:
            checked = await check_lines(
                self.ctx.storage.reader(record["input_file_id"]), record["endpoint"]
            )
        except OSError as exc:
            errors = [{"code": "file_unavailable", "message": str(exc), "line": None}]
            await store.update(batch_id, {"errors": json.dumps(errors)})
            await store.transition(batch_id, "failed", ["validating"], int(time.time()))
            return
        if checked.bad:
            await store.update(batch_id, {"errors": json.dumps([b.as_obj() for b in checked.bad])})
            await store.transition(batch_id, "failed", ["validating"], int(time.time()))
            return
        ids = keys.batch_part(batch_id, "ids")
        for start in range(0, len(checked.custom_ids), IDS_CHUNK):
            part = checked.custom_ids[start : start + IDS_CHUNK]
            await store.redis.hset(ids, mapping={start + i: c for i, c in enumerate(part)})
        await store.update(batch_id, {"total": len(checked.custom_ids), "model": checked.model})
        await store.transition(batch_id, "in_progress", ["validating"], int(time.time()))

    async def _progress(self, record: dict[str, str]) -> None:
        total, submitted = as_int(record, "total"), as_int(record, "submitted")
        answered = as_int(record, "completed") + as_int(record, "failed")
        if submitted >= total and answered >= total:
            await self.ctx.store.transition(
                self.batch_id, "finalizing", ["in_progress"], int(time.time())
            )
            return
        open_lines = self.ctx.limits.max_open_lines - (submitted - answered)
        room = min(SUBMIT_CHUNK, total - submitted, open_lines)
        if room <= 0:
            await anyio.sleep(WAIT)
            return
        await self._submit(record, submitted, room)

    async def _submit(self, record: dict[str, str], start: int, count: int) -> None:
        """Lines [start, start + count) onto the queue, then the cursor past them. A line
        whose result is recorded already is left out; a line still live is refused by the
        client's submit script: none is queued twice."""
        store = self.ctx.store
        if self._lines is None:
            self._lines = bodies(self.ctx.storage.reader(record["input_file_id"]), start)
        chunk = [await anext(self._lines) for _ in range(count)]
        if chunk[0][0] != start:  # another replica moved the cursor: read from it again
            self._lines = None
            return
        done = await store.done(self.batch_id, start, start + count)
        custom_ids = await store.custom_ids(self.batch_id, [i for i, _ in chunk])
        requests = [
            line_request(record, index, body, custom_id or "")
            for (index, body), custom_id, answered in zip(chunk, custom_ids, done, strict=True)
            if not answered
        ]
        await self.client.submit_each(
            requests, queue=self.ctx.queue, result_queue=keys.result_list(self.ctx.queue)
        )
        await store.update(self.batch_id, {"submitted": start + count})
