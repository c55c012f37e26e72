"""The deadline expiry of held work (``pipeline/held.py``) at 10,000 held messages.

In-process, no broker, no HTTP: a pool's ``HeldWork`` with a real ``Settler`` writing into
a memory stream. Printed: CPU µs per message held then taken by a worker (the hot path)
while 10,000 others wait, the heap's size meanwhile (stale entries bounded by the live
ones), and CPU µs per message when all 10,000 reach their deadline at once.

Run: ``python -m bench.held [--quick]``. Figures only, never asserted.
"""

from __future__ import annotations

import argparse
import os
import time

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from async_processor.config.queues import QueueSpec
from async_processor.logs import configure_logging
from async_processor.messages import Envelope, Request, Routing
from async_processor.metrics import Metrics
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.held import HeldWork
from async_processor.pipeline.results import Op
from async_processor.pipeline.settle import Settler
from async_processor.transports.base import Delivery, Transport
from async_processor.work import Work

QUEUE = QueueSpec(id="q", name="q", pool="p")
METRICS = Metrics().queue(QUEUE.id, QUEUE.name, QUEUE.pool)


def _work(request_id: str, deadline: int) -> Work:
    envelope = Envelope(Request(id=request_id, deadline=deadline), Routing(), kind="redis")
    return Work(Delivery(QUEUE, b"", envelope=envelope), envelope, METRICS)


def _expiry(size: int) -> tuple[HeldWork, MemoryObjectReceiveStream[Op]]:
    send, receive = anyio.create_memory_object_stream[Op](size)
    transport: Transport = None  # type: ignore[assignment]  # never called here
    return HeldWork(Settler(transport=transport, writer=send, capacity=PoolCapacity(size))), receive


def _churn(held_count: int, churn: int) -> None:
    """Messages held then taken by a worker at once (the hot path), beside ``held_count``."""
    held, _ = _expiry(held_count)
    far = int(time.time()) + 3600
    for i in range(held_count):
        held.hold(_work(f"h{i}", far))
    passing = [_work(f"c{i}", far) for i in range(churn)]
    largest = 0
    started = time.process_time()
    for item in passing:
        held.hold(item)
        held.take(item)
        largest = max(largest, len(held._heap))
    per_message = (time.process_time() - started) / churn * 1e6
    print(f"  hold + take, {held_count:,} held        {per_message:.2f} µs CPU/msg")
    print(f"  heap entries meanwhile          at most {largest:,}")


async def _due_at_once(held_count: int) -> None:
    """``held_count`` messages reaching one deadline: each answered through the settler."""
    held, receive = _expiry(held_count)
    await anyio.sleep(1 - time.time() % 1)  # deadlines are whole seconds
    due = int(time.time()) + 2
    for i in range(held_count):
        held.hold(_work(f"h{i}", due))
    async with anyio.create_task_group() as tg:
        tg.start_soon(held.run)
        await anyio.sleep(max(0.0, due - time.time()))
        started = time.process_time()
        with anyio.fail_after(60):
            for _ in range(held_count):
                await receive.receive()
        answered = (time.process_time() - started) / held_count * 1e6
        late = time.time() - due
        tg.cancel_scope.cancel()
    print(f"  {held_count:,} due at once, each answered  {answered:.1f} µs CPU/msg")
    print(f"  the last answered               {late:.2f} s after the deadline")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.held", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer churned messages")
    args = p.parse_args(argv)
    print("\n== held work: the deadline expiry at 10,000 held messages")
    configure_logging("warning", "json")  # an expiry's info line would dominate
    _churn(10_000, 20_000 if args.quick else 200_000)
    anyio.run(_due_at_once, 10_000)
    print(f"  machine                         load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
