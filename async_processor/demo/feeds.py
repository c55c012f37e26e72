"""Demo feeds: the producer and result-consumer side of each transport, for the demo.

Stage: outside the daemon (``async-processor demo --transport ...``). Input: the run's
requests, in the transport's own wire format:
- redis-sortedset: envelopes ZADDed with ``SortedSetClient``, results BRPOPed from a list;
- redis-pubsub: envelopes PUBLISHed on the channels, results read from the result channel
  (subscribed before the daemon starts: a result published while nobody listens is gone);
- gcp-pubsub: the bare request JSON published on the topics, results pulled (and acked)
  from a subscription on the result topic (created before the daemon starts, likewise).
Output: ``messages.Result`` objects, the daemon's transport config, and a tidy-up that
leaves a shared Redis with nothing but expiring markers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Protocol

import anyio
from google.api_core import exceptions as gexc
from google.pubsub_v1 import PublisherAsyncClient, SubscriberAsyncClient
from google.pubsub_v1.types import PubsubMessage, ReceivedMessage

from async_processor.client.redis_sortedset import SortedSetClient, delete_matching
from async_processor.config import (
    GcpPubSubConfig,
    PubSubTopic,
    RedisPubSubConfig,
    RedisQueue,
    SortedSetConfig,
    SortedSetQueue,
    TransportConfig,
)
from async_processor.config.redis import RedisConnection
from async_processor.messages import Envelope, Request, Result, Routing
from async_processor.redis.conn import connect
from async_processor.transports.gcp_pubsub.transport import resource_path

TRANSPORTS = ("redis-sortedset", "redis-pubsub", "gcp-pubsub")
QUEUES = ("interactive", "batch")
PULL_TIMEOUT = 1.0
IDLE_PAUSE = 0.05


class Feed(Protocol):
    def transport_config(self, gateway: str) -> TransportConfig: ...

    async def submit(self, requests: Sequence[Request], queue: int) -> None:
        """Send ``requests`` to queue number ``queue`` (an index into ``QUEUES``)."""
        ...

    async def results(self, n: int, wait: float) -> list[Result]:
        """Up to ``n`` results, waiting at most about ``wait`` s."""
        ...

    async def tidy(self) -> None:
        """Remove what the run left on the broker (after the daemon's drain)."""
        ...


class _RedisFeed:
    """Names both Redis feeds share: ``demo-<run>-<queue>``, the result and retry keys."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url = url
        self.queues = [f"demo-{run_id}-{name}" for name in QUEUES]
        self.result_name = f"demo-{run_id}-results"
        self.retry_name = f"demo-{run_id}-retry"

        # Every key of the run starts with its prefix, bare or as a hash tag ({R}:pushed):
        # queues, in-flight and dead-letter keys, and the per-id/per-deadline bookkeeping.
        self.leftovers = (f"demo-{run_id}-*", f"{{demo-{run_id}-*")


class SortedSetFeed(_RedisFeed):
    def __init__(self, url: str, run_id: str) -> None:
        super().__init__(url, run_id)
        # The client writes its result list into each envelope: the daemon answers there.
        self.client = SortedSetClient(url, result_queue=self.result_name)

    def transport_config(self, gateway: str) -> SortedSetConfig:
        return SortedSetConfig(
            url=self.url,
            retry_queue_name=self.retry_name,
            result_queue_name=self.result_name,
            poll_interval_ms=100,  # an idle queue is looked at 10×/s: the demo starts at once
            dedup_ttl_seconds=600,  # leave little behind in a shared Redis
            queues=[SortedSetQueue(queue_name=q, igw_base_url=gateway) for q in self.queues],
        )

    async def submit(self, requests: Sequence[Request], queue: int) -> None:
        await self.client.submit_many(requests, queue=self.queues[queue])

    async def open(self) -> None:
        return None  # results wait in their list until read

    async def results(self, n: int, wait: float) -> list[Result]:
        return await self.client.drain_results(n, wait)

    async def tidy(self) -> None:
        await self.client.clear_matching(*self.leftovers)

    async def aclose(self) -> None:
        await self.client.aclose()


class RedisPubSubFeed(_RedisFeed):
    def __init__(self, url: str, run_id: str) -> None:
        super().__init__(url, run_id)
        self.redis = connect(RedisConnection(url=url), socket_timeout=None)
        self.listener = self.redis.pubsub(ignore_subscribe_messages=True)

    def transport_config(self, gateway: str) -> RedisPubSubConfig:
        return RedisPubSubConfig(
            url=self.url,
            retry_queue_name=self.retry_name,
            result_queue_name=self.result_name,
            queues=[RedisQueue(queue_name=q, igw_base_url=gateway) for q in self.queues],
        )

    async def submit(self, requests: Sequence[Request], queue: int) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for request in requests:
                pipe.publish(
                    self.queues[queue], Envelope(request, Routing(), kind="redis").encode()
                )
            receivers = await pipe.execute()
        if 0 in receivers:
            # Nobody subscribed means the message is simply gone: say so now.
            raise RuntimeError(f"nobody is subscribed to {self.queues[queue]}")

    async def results(self, n: int, wait: float) -> list[Result]:
        out: list[Result] = []
        with anyio.move_on_after(wait):
            while len(out) < n:
                message = await self.listener.get_message(
                    ignore_subscribe_messages=True, timeout=0.1
                )
                if message is not None:
                    out.append(Result.decode(message["data"]))
        return out

    async def open(self) -> None:
        await self.listener.subscribe(self.result_name)

    async def tidy(self) -> None:
        await delete_matching(self.redis, self.leftovers)

    async def aclose(self) -> None:
        await self.listener.aclose()  # type: ignore[no-untyped-call]
        await self.redis.aclose()


class GcpPubSubFeed:
    """Topics ``demo-<run>-<queue>`` with subscriptions ``...-sub``; results likewise."""

    def __init__(self, project: str, run_id: str) -> None:
        self.project = project
        self.topics = [f"demo-{run_id}-{name}" for name in QUEUES]
        self.result_topic = f"demo-{run_id}-results"
        self.publisher = PublisherAsyncClient()
        self.subscriber = SubscriberAsyncClient()

    def _path(self, kind: str, name: str) -> str:
        return resource_path(self.project, kind, name)

    async def open(self) -> None:
        for topic in [*self.topics, self.result_topic]:
            await self.publisher.create_topic(name=self._path("topics", topic))
            await self.subscriber.create_subscription(
                name=self._path("subscriptions", f"{topic}-sub"),
                topic=self._path("topics", topic),
            )

    def transport_config(self, gateway: str) -> GcpPubSubConfig:
        return GcpPubSubConfig(
            project_id=self.project,
            result_topic_id=self.result_topic,
            topics=[
                PubSubTopic(subscriber_id=f"{t}-sub", igw_base_url=gateway) for t in self.topics
            ],
        )

    async def submit(self, requests: Sequence[Request], queue: int) -> None:
        messages = [PubsubMessage(data=r.encode()) for r in requests]
        await self.publisher.publish(
            topic=self._path("topics", self.topics[queue]), messages=messages
        )

    async def results(self, n: int, wait: float) -> list[Result]:
        """One pull; after an empty one (the emulator answers at once) pause, do not spin."""
        subscription = self._path("subscriptions", f"{self.result_topic}-sub")
        received: list[ReceivedMessage] = []
        with suppress(gexc.DeadlineExceeded):
            response = await self.subscriber.pull(
                subscription=subscription, max_messages=min(n, 1000), timeout=PULL_TIMEOUT
            )
            received = list(response.received_messages)
        if not received:
            await anyio.sleep(min(wait, IDLE_PAUSE))
            return []
        await self.subscriber.acknowledge(
            subscription=subscription, ack_ids=[m.ack_id for m in received]
        )
        return [Result.decode(m.message.data) for m in received]

    async def tidy(self) -> None:
        return None  # the emulator, and all it holds, stops with the demo

    async def aclose(self) -> None:
        await self.publisher.transport.close()  # type: ignore[no-untyped-call]
        await self.subscriber.transport.close()  # type: ignore[no-untyped-call]


@asynccontextmanager
async def open_feed(
    transport: str, run_id: str, *, redis_url: str = "", project: str = ""
) -> AsyncIterator[Feed]:
    """The feed for ``transport``, its result reader listening before any daemon starts."""
    feed: SortedSetFeed | RedisPubSubFeed | GcpPubSubFeed
    if transport == "gcp-pubsub":
        feed = GcpPubSubFeed(project, run_id)
    elif transport == "redis-pubsub":
        feed = RedisPubSubFeed(redis_url, run_id)
    else:
        feed = SortedSetFeed(redis_url, run_id)
    try:
        await feed.open()
        yield feed
    finally:
        await feed.aclose()
