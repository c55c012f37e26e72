"""Result writer: batched result writes and hand-backs to the transport.

Input: completions (delivery + result) and deferrals (delivery + delay) from pollers and
workers, through one bounded stream. Output: ``transport.complete`` / ``transport.defer``
calls, one per batch. A failed write is retried with backoff until it lands: the
message stays leased on the broker meanwhile, so a crash loses nothing (DESIGN.md §5.1).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream

from async_processor.errors import TransportError
from async_processor.messages import Result
from async_processor.transports.base import Deferral, Delivery, Transport

log = structlog.get_logger(__name__)

BATCH = 64
BUFFER = 1024


@dataclass(frozen=True, slots=True)
class Completion:
    delivery: Delivery
    result: Result


Op = Completion | Deferral


class ResultWriter:
    """Owns the write side of the pipeline; ``run`` ends once every sender has closed."""

    def __init__(self, transport: Transport, buffer: int = BUFFER) -> None:
        self._transport = transport
        self._send, self._receive = anyio.create_memory_object_stream[Op](buffer)

    def sender(self) -> ObjectSendStream[Op]:
        """A sender for one producer task; the writer stops when all are closed."""
        return self._send.clone()

    def close(self) -> None:
        """Drop the writer's own sender (call once every producer has its clone)."""
        self._send.close()

    async def run(self) -> None:
        async with self._receive:
            while True:
                try:
                    first = await self._receive.receive()
                except anyio.EndOfStream:
                    return
                batch = [first, *_take_ready(self._receive, BATCH - 1)]
                await self._write(batch)

    async def _write(self, batch: Sequence[Op]) -> None:
        completions = [(op.delivery, op.result) for op in batch if isinstance(op, Completion)]
        deferrals = [op for op in batch if isinstance(op, Deferral)]
        if completions:
            await _with_retries("complete", lambda: self._transport.complete(completions))
        if deferrals:
            await _with_retries("defer", lambda: self._transport.defer(deferrals))


def _take_ready(stream: MemoryObjectReceiveStream[Op], limit: int) -> list[Op]:
    out: list[Op] = []
    while len(out) < limit:
        try:
            out.append(stream.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    return out


async def _with_retries(what: str, write: Callable[[], Awaitable[None]]) -> None:
    """Retry a broker write until it lands (the lease keeps the message safe meanwhile)."""
    delay, attempt = 0.1, 0
    while True:
        attempt += 1
        try:
            await write()
            return
        except TransportError as exc:
            log.warning("result_write_failed", op=what, attempt=attempt, error=str(exc))
            await anyio.sleep(delay)
            delay = min(5.0, delay * 2)
