"""A loopback TCP proxy that holds every chunk ``--delay`` seconds in each direction.

Used by ``bench.pubsub`` in front of the Pub/Sub emulator to give its pulls, publishes and
acks a cloud-like round trip (2 × delay) where the kernel's ``netem`` is not available.
Chunks keep their order and are forwarded as soon as they are due, so the delay adds
latency, not a bandwidth cap. Run: ``python -m bench.delay_proxy --listen-port P --target
127.0.0.1:Q --delay 0.02`` (serves until killed).
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio
from anyio.abc import SocketStream

CHUNK = 65536
IN_TRANSIT = 4096  # chunks held per direction; a full pipe stops reading (TCP backpressure)


async def forward(source: SocketStream, sink: SocketStream, delay: float) -> None:
    """Copy ``source`` to ``sink``, each chunk ``delay`` s after it was read."""
    send, receive = anyio.create_memory_object_stream[tuple[float, bytes]](IN_TRANSIT)

    async def read() -> None:
        async with send:
            try:
                async for chunk in source:
                    await send.send((anyio.current_time() + delay, chunk))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        async with receive:
            try:
                async for due, chunk in receive:
                    await anyio.sleep_until(due)
                    await sink.send(chunk)
                await sink.send_eof()  # half-close: the other direction may still talk
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                tg.cancel_scope.cancel()


async def handle(host: str, port: int, delay: float, client: SocketStream) -> None:
    async with client:
        try:
            upstream = await anyio.connect_tcp(host, port)
        except OSError:
            return
        async with upstream, anyio.create_task_group() as tg:
            tg.start_soon(forward, client, upstream, delay)
            tg.start_soon(forward, upstream, client, delay)


async def serve(listen_port: int, target: str, delay: float) -> None:
    host, _, port = target.rpartition(":")
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=listen_port)
    await listener.serve(partial(handle, host, int(port), delay))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delay_proxy")
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--target", required=True, help="host:port to forward to")
    p.add_argument("--delay", type=float, default=0.02, help="seconds per chunk per direction")
    args = p.parse_args(argv)
    anyio.run(serve, args.listen_port, args.target, args.delay)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
