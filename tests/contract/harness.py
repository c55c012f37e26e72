"""One harness per transport, so that one contract suite can drive all three the same way.

Stage: test support for ``tests/contract``. Input: a transport name, a unique prefix and
the broker (a redis-server URL or the Pub/Sub emulator). Output: a ``TransportHarness``
that builds the daemon's ``AppConfig`` for that transport and talks to the broker the way
producers and result consumers do, in that transport's own wire format:

- redis-sortedset: an envelope ZADDed to the queue (score = deadline), results BRPOPed
  from the result list, dead letters on ``<queue>:dead-letter``;
- redis-pubsub: an envelope PUBLISHed on the channel, results read from the result
  channel (subscribed when the harness opens, before any daemon starts, because a result
  published while nobody listens is gone), dead letters on ``<channel>:dead-letter``;
- gcp-pubsub: the bare request JSON published on the topic (Pub/Sub has no envelope), its
  ``metadata`` sent as message attributes (the transport merges them back), results pulled
  from a subscription on the result topic, dead letters from ``<subscription>-dead-letter``.

Where a transport legitimately differs, the harness says so in an attribute
(``keeps_messages_sent_while_down``, ``retry_state_survives_restart``) instead of the suite
skipping a contract case.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from google.pubsub_v1.types import PubsubMessage
from redis.asyncio import Redis

from async_processor.config import (
    AppConfig,
    GcpPubSubConfig,
    RedisPubSubConfig,
    SortedSetConfig,
)
from async_processor.config.redis import RedisConnection
from async_processor.messages import Envelope, Request, Routing
from async_processor.redis import keys
from async_processor.redis.conn import connect
from async_processor.redis.keyspace import KeySpace
from tests.fixtures.inprocess import runtime_config
from tests.fixtures.pubsub import PubSubAdmin, pubsub_admin

T = TypeVar("T")
DEFAULT_PAYLOAD = b'{"prompt":"hi","max_tokens":4}'
Result = dict[str, Any]  # a result as the consumer sees it: the decoded JSON object


@dataclass(frozen=True, slots=True)
class Submission:
    """One request to submit; ``payload`` is the exact JSON text the gateway must receive."""

    id: str
    deadline: int
    payload: bytes = DEFAULT_PAYLOAD
    headers: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def request(self, *, with_metadata: bool = True) -> Request:
        """The public request (its payload bytes kept verbatim by ``Request.encode``)."""
        return Request(
            id=self.id,
            deadline=self.deadline,
            payload=self.payload,
            headers=dict(self.headers),
            metadata=dict(self.metadata) if with_metadata else {},
        )


class TransportHarness(Protocol):
    name: str
    queue_name: str  # the ``queue_name`` metric label: sorted-set key, channel, subscription
    # Whether a message sent while no daemon runs waits for one. False only for
    # redis-pubsub: a channel keeps nothing for absent subscribers (its documented limit).
    keeps_messages_sent_while_down: bool
    # Whether a retry's state (count, last HTTP answer) survives a restart of the daemon.
    # The Redis envelopes carry it on the broker; a Pub/Sub message is redelivered as it
    # was published, and the transport remembers the state only in the deferring process.
    retry_state_survives_restart: bool

    def config(self, gateway: str, *, objective: str = "", **runtime: Any) -> AppConfig:
        """The daemon's config: one queue to ``gateway``, ``runtime`` as RuntimeConfig fields."""
        ...

    async def submit(self, submissions: Sequence[Submission], *, offline: bool = False) -> None:
        """Send requests; ``offline``: no daemon is running (redis-pubsub then reaches nobody)."""
        ...

    async def inject_raw(self, raw: bytes) -> None:
        """Put bytes on the request queue as they are (bad input)."""
        ...

    async def results(self, n: int, timeout: float) -> list[Result]:
        """Up to ``n`` results, waiting at most ``timeout`` s in total."""
        ...

    async def dead_letters(self, n: int, timeout: float) -> list[bytes]:
        """Up to ``n`` dead-lettered messages (their original bytes)."""
        ...

    async def parked(self) -> int | None:
        """Messages handed back and waiting on the broker's side (None: not observable)."""
        ...


async def poll(
    fetch: Callable[[], Awaitable[list[T]]], n: int, timeout: float, step: float = 0.05
) -> list[T]:
    """Call ``fetch`` until it returned ``n`` items in all, or ``timeout`` s passed."""
    out: list[T] = []
    give_up = time.monotonic() + timeout
    while True:
        out += await fetch()
        if len(out) >= n or time.monotonic() >= give_up:
            return out
        await anyio.sleep(step)


class _RedisHarness:
    """What both Redis transports share: a client, the retry set, the dead-letter list."""

    name = ""
    keeps_messages_sent_while_down = True
    retry_state_survives_restart = True

    def __init__(self, url: str, unique: str) -> None:
        self.url = url
        self.unique = unique
        self.queue_name = f"{unique}-q"
        self.result_name = f"{unique}-results"
        self.retry_name = f"{unique}-retry"
        self.redis = Redis.from_url(url)

    def _transport(self, gateway: str, objective: str) -> dict[str, Any]:
        return {
            "url": self.url,
            "result_queue_name": self.result_name,
            "retry_queue_name": self.retry_name,
            "queues": [
                {
                    "queue_name": self.queue_name,
                    "igw_base_url": gateway,
                    "inference_objective": objective,
                }
            ],
        }

    def dead_letter_key(self) -> str:
        return keys.dead_letter_key(self.queue_name)

    async def dead_letters(self, n: int, timeout: float) -> list[bytes]:
        key = self.dead_letter_key()

        async def fetch() -> list[bytes]:
            entry: bytes | None = await self.redis.rpop(key)  # type: ignore[assignment]
            return [] if entry is None else [json.loads(entry)["raw"].encode()]

        return await poll(fetch, n, timeout)

    async def aclose(self) -> None:
        await self.redis.aclose()


class SortedSetHarness(_RedisHarness):
    name = "redis-sortedset"

    def config(self, gateway: str, *, objective: str = "", **runtime: Any) -> AppConfig:
        transport = SortedSetConfig.model_validate(
            {**self._transport(gateway, objective), "poll_interval_ms": 50}
        )
        return AppConfig(
            transport=self.name, transport_config=transport, runtime=runtime_config(**runtime)
        )

    async def submit(self, submissions: Sequence[Submission], *, offline: bool = False) -> None:
        """As the producer client does, but written here so expired deadlines can be sent."""
        members: dict[bytes, float] = {}
        for s in submissions:
            routing = Routing(
                request_token=secrets.token_hex(16),
                request_queue_name=self.queue_name,
                result_queue_name=self.result_name,
            )
            members[Envelope(s.request(), routing, kind="redis").encode()] = s.deadline
        await self.redis.zadd(self.queue_name, members)

    async def inject_raw(self, raw: bytes) -> None:
        await self.redis.zadd(self.queue_name, {raw: time.time()})

    async def results(self, n: int, timeout: float) -> list[Result]:
        out: list[Result] = []
        give_up = time.monotonic() + timeout
        while len(out) < n and (left := give_up - time.monotonic()) > 0:
            popped = await self.redis.brpop([self.result_name], timeout=max(left, 0.01))
            if popped is None:
                break
            out.append(json.loads(popped[1]))
        return out

    async def parked(self) -> int:
        """Handed back to the queue at once, or waiting in the retry set."""
        return int(await self.redis.zcard(self.queue_name)) + int(
            await self.redis.zcard(self.retry_name)
        )


class ClusterSortedSetHarness(SortedSetHarness):
    """redis-sortedset in ``mode: cluster``: the queue carries a hash tag its result list
    shares; its dead letters and retries sit beside it in the same slot."""

    def __init__(self, url: str, unique: str) -> None:
        super().__init__(url, unique)
        self.redis = connect(RedisConnection(url=url, mode="cluster"))
        self.queue_name = f"{{{unique}}}-q"
        self.result_name = f"{{{unique}}}-results"
        self.retry_name = KeySpace(cluster=True).retry(self.queue_name, "")

    def _transport(self, gateway: str, objective: str) -> dict[str, Any]:
        return {**super()._transport(gateway, objective), "mode": "cluster"}

    def dead_letter_key(self) -> str:
        return KeySpace(cluster=True).dead_letter(self.queue_name)


class RedisPubSubHarness(_RedisHarness):
    name = "redis-pubsub"
    keeps_messages_sent_while_down = False  # see TransportHarness

    def __init__(self, url: str, unique: str) -> None:
        super().__init__(url, unique)
        self.listener = self.redis.pubsub(ignore_subscribe_messages=True)

    async def open(self) -> None:
        await self.listener.subscribe(self.result_name)

    def config(self, gateway: str, *, objective: str = "", **runtime: Any) -> AppConfig:
        transport = RedisPubSubConfig.model_validate(self._transport(gateway, objective))
        return AppConfig(
            transport=self.name, transport_config=transport, runtime=runtime_config(**runtime)
        )

    async def submit(self, submissions: Sequence[Submission], *, offline: bool = False) -> None:
        for s in submissions:
            envelope = Envelope(s.request(), Routing(), kind="redis").encode()
            await self._publish(envelope, listeners=0 if offline else 1)

    async def inject_raw(self, raw: bytes) -> None:
        await self._publish(raw)

    async def _publish(self, data: bytes, listeners: int = 1) -> None:
        # Nobody subscribed means the message is simply gone: fail here, not by a timeout.
        receivers = await self.redis.publish(self.queue_name, data)
        assert receivers == listeners, f"{receivers} subscribers on {self.queue_name}"

    async def results(self, n: int, timeout: float) -> list[Result]:
        out: list[Result] = []
        with anyio.move_on_after(timeout):
            while len(out) < n:
                message = await self.listener.get_message(
                    ignore_subscribe_messages=True, timeout=0.1
                )
                if message is not None:
                    out.append(json.loads(message["data"]))
        return out

    async def parked(self) -> int:
        """Only the retry set survives a stop (handed-back messages go there too)."""
        return int(await self.redis.zcard(self.retry_name))

    async def aclose(self) -> None:
        await self.listener.aclose()  # type: ignore[no-untyped-call]
        await super().aclose()


class GcpPubSubHarness:
    name = "gcp-pubsub"
    keeps_messages_sent_while_down = True  # the subscription keeps them
    retry_state_survives_restart = False  # see TransportHarness

    def __init__(self, admin: PubSubAdmin, unique: str) -> None:
        self.admin = admin
        self.topic = f"{unique}-req"
        self.queue_name = f"{unique}-sub"
        self.result_topic = f"{unique}-res"
        self.result_sub = f"{unique}-res-sub"
        self.dead_letter_sub = f"{unique}-dl-sub"
        self._pending: list[Result] = []

    async def open(self) -> None:
        await self.admin.create_subscription(self.queue_name, self.topic)
        await self.admin.create_subscription(self.result_sub, self.result_topic)
        # The transport copies undecodable messages to ``<subscription>-dead-letter``.
        await self.admin.create_subscription(self.dead_letter_sub, f"{self.queue_name}-dead-letter")

    def config(self, gateway: str, *, objective: str = "", **runtime: Any) -> AppConfig:
        transport = GcpPubSubConfig.model_validate(
            {
                "project_id": self.admin.project,
                "result_topic_id": self.result_topic,
                "topics": [
                    {
                        "subscriber_id": self.queue_name,
                        "igw_base_url": gateway,
                        "inference_objective": objective,
                    }
                ],
            }
        )
        return AppConfig(
            transport=self.name, transport_config=transport, runtime=runtime_config(**runtime)
        )

    async def submit(self, submissions: Sequence[Submission], *, offline: bool = False) -> None:
        """Bare request JSON; its metadata travels as attributes, as Pub/Sub producers do."""
        messages = [
            PubsubMessage(data=s.request(with_metadata=False).encode(), attributes=dict(s.metadata))
            for s in submissions
        ]
        await self.admin.publisher.publish(topic=self.admin.topic(self.topic), messages=messages)

    async def inject_raw(self, raw: bytes) -> None:
        await self.admin.publish(self.topic, [raw])

    async def results(self, n: int, timeout: float) -> list[Result]:
        # A pull can bring more than asked: keep the rest for the next call.
        if len(self._pending) < n:
            pulled = await self.admin.pull_until(self.result_sub, n - len(self._pending), timeout)
            self._pending += [json.loads(m.message.data) for m in pulled]
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    async def dead_letters(self, n: int, timeout: float) -> list[bytes]:
        pulled = await self.admin.pull_until(self.dead_letter_sub, n, timeout)
        return [bytes(m.message.data) for m in pulled]

    async def parked(self) -> None:
        return None  # held inside the subscription; the emulator has no backlog metric


@asynccontextmanager
async def open_harness(
    name: str, unique: str, *, redis_url: str = "", project: str = ""
) -> AsyncIterator[TransportHarness]:
    """The harness for ``name``, its queues created and its result reader listening."""
    if name == "gcp-pubsub":
        async with pubsub_admin(project) as admin:
            gcp = GcpPubSubHarness(admin, unique)
            await gcp.open()
            yield gcp
        return
    harness: _RedisHarness
    if name == "redis-pubsub":
        harness = RedisPubSubHarness(redis_url, unique)
        await harness.open()
    elif name == "redis-sortedset-cluster":
        harness = ClusterSortedSetHarness(redis_url, unique)
    else:
        harness = SortedSetHarness(redis_url, unique)
    try:
        yield harness
    finally:
        await harness.aclose()
