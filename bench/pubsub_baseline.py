"""Baseline Pub/Sub consumer: the least code that does the gcp-pubsub daemon's job.

One pull at a time of up to the free worker slots (at most Pub/Sub's 1,000), N workers
POSTing the payload with aiohttp, one publisher publishing every result ready (≤ 1,000
per call) and acking those messages once the publish is confirmed. Same libraries as the
daemon; none of its features (no leases, gates, retries, deadlines, metrics). Exits after
``--count`` results. Run by ``bench.pubsub`` side by side with the daemon.
"""

from __future__ import annotations

import argparse
import json

import aiohttp
import anyio
from google.api_core import exceptions as gexc
from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
from google.pubsub_v1.types import PubsubMessage, ReceivedMessage

MAX_PULL = 1000


async def consume(args: argparse.Namespace) -> None:
    subscriber, publisher = SubscriberAsyncClient(), PublisherAsyncClient()
    inbox_send, inbox = anyio.create_memory_object_stream[ReceivedMessage](args.workers)
    ready: list[tuple[str, bytes]] = []  # (ack id, result) awaiting publish
    state = {"free": args.workers, "left": args.count}
    freed, produced = anyio.Event(), anyio.Event()
    url = args.gateway_url + "/v1/completions"

    async def pull() -> None:
        nonlocal freed
        while state["left"] > 0:
            if state["free"] == 0:
                await freed.wait()
                freed = anyio.Event()
                continue
            asked = min(state["free"], MAX_PULL)
            state["free"] -= asked
            try:
                got = await subscriber.pull(
                    subscription=args.subscription, max_messages=asked, timeout=5, retry=None
                )
                received = list(got.received_messages)
            except gexc.DeadlineExceeded:
                received = []
            state["free"] += asked - len(received)
            for message in received:
                await inbox_send.send(message)

    async def work(session: aiohttp.ClientSession) -> None:
        async for message in inbox:
            request = json.loads(message.message.data)
            async with session.post(url, json=request["payload"]) as response:
                text = await response.text()
            result = {"id": request["id"], "status_code": response.status, "payload": text}
            ready.append((message.ack_id, json.dumps(result).encode()))
            state["free"] += 1
            freed.set()
            produced.set()

    async def publish() -> None:
        nonlocal produced
        while state["left"] > 0:
            await produced.wait()
            produced = anyio.Event()
            while ready:
                batch, ready[:MAX_PULL] = ready[:MAX_PULL], []
                messages = [PubsubMessage(data=data) for _, data in batch]
                await publisher.publish(topic=args.topic, messages=messages)
                ack_ids = [ack_id for ack_id, _ in batch]
                await subscriber.acknowledge(subscription=args.subscription, ack_ids=ack_ids)
                state["left"] -= len(batch)

    connector = aiohttp.TCPConnector(limit=args.workers)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        anyio.create_task_group() as tg,
    ):
        for _ in range(args.workers):
            tg.start_soon(work, session)
        tg.start_soon(pull)
        await publish()
        tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pubsub_baseline")
    p.add_argument("--subscription", required=True, help="projects/<p>/subscriptions/<s>")
    p.add_argument("--topic", required=True, help="result topic: projects/<p>/topics/<t>")
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--count", type=int, required=True)
    anyio.run(consume, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
