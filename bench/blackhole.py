"""A TCP proxy to the Sentinel group's current primary whose path can be blackholed.

Stage: bench support (chaos). Input: a callable naming the primary's port (asked again
for each new connection, as a service in front of a Sentinel-managed Redis does).
Output: ``serve`` listens on a free loopback port; ``cut(seconds)`` blackholes the path:
no byte goes either way and new connections get no answer, then everything held flows
on, as TCP retransmits once a dropped route comes back (a real blackhole shorter than
TCP's own give-up). The client must notice with its own timeouts.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio.abc import ByteStream, SocketStream, TaskStatus

_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


class Blackhole:
    def __init__(self, primary_port: Callable[[], int | None]) -> None:
        self._primary_port = primary_port
        self._open = anyio.Event()
        self._open.set()
        self.cuts = 0

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(self._handle)

    async def cut(self, seconds: float) -> None:
        self._open = anyio.Event()
        self.cuts += 1
        try:
            await anyio.sleep(seconds)
        finally:
            self._open.set()

    async def _handle(self, client: SocketStream) -> None:
        async with client:
            await self._open.wait()
            port = await anyio.to_thread.run_sync(self._primary_port)
            if port is None:
                return
            try:
                upstream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as pumps:
                pumps.start_soon(self._pump, client, upstream, pumps.cancel_scope)
                pumps.start_soon(self._pump, upstream, client, pumps.cancel_scope)

    async def _pump(self, source: ByteStream, sink: ByteStream, both: anyio.CancelScope) -> None:
        try:
            async for chunk in source:
                await self._open.wait()  # held, not dropped: TCP would resend it
                await sink.send(chunk)
        except _GONE:
            pass
        both.cancel()  # one side gone: close the other, as a Redis restart would
