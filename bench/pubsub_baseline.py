"""Baseline Pub/Sub consumer: the least code that does the gcp-pubsub daemon's job.

One pull at a time of up to the free worker slots (at most Pub/Sub's 1,000), N workers
POSTing the payload with aiohttp, one publisher publishing every result ready (≤ 1,000
per call) and acking those messages once the publish is confirmed. Same libraries as the
daemon; none of its features (no leases, gates, retries, deadlines, metrics). Exits after
``--count`` results, writing the mean time a POST took to ``--stats`` when given. Run by
``bench.pubsub`` side by side with the daemon.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import aiohttp
import anyio
from google.api_core import exceptions as gexc
from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
from google.pubsub_v1.types import PubsubMessage, ReceivedMessage

MAX_PULL = 1000


class Baseline:
    """The consumer's state, shared by its pull loop, its workers and its publisher."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.subscriber, self.publisher = SubscriberAsyncClient(), PublisherAsyncClient()
        self.inbox_send, self.inbox = anyio.create_memory_object_stream[ReceivedMessage](
            args.workers
        )
        self.ready: list[tuple[str, bytes]] = []  # (ack id, result) awaiting publish
        self.free, self.left = args.workers, args.count
        self.freed, self.produced = anyio.Event(), anyio.Event()
        self.url = args.gateway_url + "/v1/completions"
        self.post_seconds = 0.0  # summed over every POST: the gateway latency it saw

    async def pull(self) -> None:
        while self.left > 0:
            if self.free == 0:
                await self.freed.wait()
                self.freed = anyio.Event()
                continue
            asked = min(self.free, MAX_PULL)
            self.free -= asked
            try:
                got = await self.subscriber.pull(
                    subscription=self.args.subscription, max_messages=asked, timeout=5, retry=None
                )
                received = list(got.received_messages)
            except gexc.DeadlineExceeded:
                received = []
            self.free += asked - len(received)
            for message in received:
                await self.inbox_send.send(message)

    async def work(self, session: aiohttp.ClientSession) -> None:
        async for message in self.inbox:
            request = json.loads(message.message.data)
            started = time.monotonic()
            async with session.post(self.url, json=request["payload"]) as response:
                text = await response.text()
            self.post_seconds += time.monotonic() - started
            result = {"id": request["id"], "status_code": response.status, "payload": text}
            self.ready.append((message.ack_id, json.dumps(result).encode()))
            self.free += 1
            self.freed.set()
            self.produced.set()

    async def publish(self) -> None:
        while self.left > 0:
            await self.produced.wait()
            self.produced = anyio.Event()
            while self.ready:
                batch, self.ready[:MAX_PULL] = self.ready[:MAX_PULL], []
                messages = [PubsubMessage(data=data) for _, data in batch]
                await self.publisher.publish(topic=self.args.topic, messages=messages)
                ack_ids = [ack_id for ack_id, _ in batch]
                await self.subscriber.acknowledge(
                    subscription=self.args.subscription, ack_ids=ack_ids
                )
                self.left -= len(batch)


async def consume(args: argparse.Namespace) -> None:
    baseline = Baseline(args)
    connector = aiohttp.TCPConnector(limit=args.workers)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        anyio.create_task_group() as tg,
    ):
        for _ in range(args.workers):
            tg.start_soon(baseline.work, session)
        tg.start_soon(baseline.pull)
        await baseline.publish()
        tg.cancel_scope.cancel()
    if args.stats:
        args.stats.write_text(json.dumps({"post_seconds": baseline.post_seconds / args.count}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pubsub_baseline")
    p.add_argument("--subscription", required=True, help="projects/<p>/subscriptions/<s>")
    p.add_argument("--topic", required=True, help="result topic: projects/<p>/topics/<t>")
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--stats", type=Path, help="write the mean POST seconds here at exit")
    anyio.run(consume, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
