"""Queue discovery (redis-sortedset ``queue_discovery``): the queue list from a Redis set or
a key-prefix scan, refreshed while running; hostile and excess names refused and counted;
removed queues drain without losing a message or leaving a claim (real redis-server, the
simulator over HTTP)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis, RedisCluster

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import AppConfig, PoolConfig, SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.messages import Result
from async_processor.metrics import Metrics
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Deferral, TransportContext
from async_processor.transports.redis_sortedset.discovery import (
    PREFIX_SCAN_CALLS,
    PREFIX_SCAN_COUNT,
)
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import running, runtime_config
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
GW = "http://127.0.0.1:9"


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def transport_config(redis_url: str, unique: str, **discovery: Any) -> SortedSetConfig:
    return SortedSetConfig.model_validate(
        {
            "url": redis_url,
            "result_queue_name": f"{unique}:results",
            "retry_queue_name": f"{unique}:retry-set",
            "poll_interval_ms": 50,
            "lease_seconds": 5,
            "queue_discovery": {
                "refresh_seconds": 0.2,
                "template": {"igw_base_url": GW, "worker_pool_id": "p"},
                **discovery,
            },
        }
    )


def daemon_config(transport: SortedSetConfig, gateway: str, workers: int = 4) -> AppConfig:
    assert transport.queue_discovery is not None
    template = transport.queue_discovery.template.model_copy(update={"igw_base_url": gateway})
    discovery = transport.queue_discovery.model_copy(update={"template": template})
    return AppConfig(
        transport="redis-sortedset",
        transport_config=transport.model_copy(update={"queue_discovery": discovery}),
        runtime=runtime_config(),  # ports 0: the OS's, no race for them
        pools=[PoolConfig(id="p", workers=workers)],
    )


async def submit(redis_url: str, unique: str, queue: str, *ids: str) -> None:
    deadline = int(time.time()) + 120
    async with SortedSetClient(redis_url, queue, f"{unique}:results") as client:
        await client.submit_many([{"id": i, "deadline": deadline, "payload": {}} for i in ids])


async def results(r: Redis, unique: str, count: int, timeout: float = 20) -> list[str]:
    ids: list[str] = []
    with anyio.fail_after(timeout):
        while len(ids) < count:
            popped = await r.brpop([f"{unique}:results"], timeout=1)
            if popped:
                ids.append(Result.decode(popped[1]).id)
    return ids


async def discover_a_whole_cycle(transport: SortedSetTransport) -> list[QueueSpec]:
    """Refresh until the prefix scan has walked a whole cycle (the shared server may hold
    more keys than one refresh visits)."""
    lister = transport._catalog._lister
    assert lister is not None and transport.config.queue_discovery is not None
    assert transport.config.queue_discovery.key_prefix  # a set is read whole at once
    with anyio.fail_after(60):
        while True:
            specs = await transport.discover()
            if lister.scan.cycles:
                return specs


async def test_queues_in_a_set_are_polled_and_followed_without_a_restart(
    redis_url: str, unique: str, r: Redis, simulator: SimulatorProcess
) -> None:
    listed = f"{unique}:tenants"
    config = daemon_config(transport_config(redis_url, unique, set_key=listed), simulator.url)
    await r.sadd(listed, f"{unique}-a", f"{unique}-b")
    async with running(config) as processor:
        await submit(redis_url, unique, f"{unique}-a", "a1")
        await submit(redis_url, unique, f"{unique}-b", "b1")
        assert sorted(await results(r, unique, 2)) == ["a1", "b1"]
        await r.sadd(listed, f"{unique}-c")  # found at the next refresh
        await submit(redis_url, unique, f"{unique}-c", "c1")
        assert await results(r, unique, 1) == ["c1"]
        await r.srem(listed, f"{unique}-a")
        await anyio.sleep(0.6)
        assert processor._discovery is not None
        assert sorted(processor._discovery.running) == [f"{unique}-b", f"{unique}-c"]
        await submit(redis_url, unique, f"{unique}-a", "a2")  # nobody polls it now
        await anyio.sleep(0.5)
        assert await r.zcard(f"{unique}-a") == 1
        assert processor.metrics.discovered_queues._value.get() == 2


async def test_a_removed_queue_drains_without_losing_a_message_or_a_claim(
    redis_url: str, unique: str, r: Redis, simulator: SimulatorProcess
) -> None:
    simulator.configure(latency=0.2)
    listed, queue = f"{unique}:tenants", f"{unique}-a"
    config = daemon_config(transport_config(redis_url, unique, set_key=listed), simulator.url)
    ids = [f"m{n}" for n in range(40)]
    await submit(redis_url, unique, queue, *ids)
    await r.sadd(listed, queue)
    async with running(config):
        await results(r, unique, 4)  # under way
        await r.srem(listed, queue)
        await anyio.sleep(1.5)  # removed, its poller stopped, what it forwarded finished
        inflight = await r.zcard(redis_keys.claims_idx_key(queue))
    answered = [Result.decode(raw).id for raw in await r.lrange(f"{unique}:results", 0, -1)]
    queued = await r.zcard(queue)
    assert inflight == 0  # no claim left behind
    assert len(set(answered)) == len(answered)  # no message answered twice
    assert len(answered) + 4 + queued == len(ids)  # every other one is back on its queue
    assert queued > 0  # it did stop


async def test_hostile_names_in_the_set_are_refused_and_counted(
    redis_url: str, unique: str, r: Redis
) -> None:
    listed = f"{unique}:tenants"
    config = transport_config(redis_url, unique, set_key=listed)
    hostile = [
        f"{unique}:retry-set",  # the shared retry set
        f"{unique}:results",  # the result list
        f"{unique}-x:inflight",
        f"{unique}-x:retry",
        f"{unique}-x:live:abc",
        "request-done:abc:1",
        "request-cancel:abc",
        listed,  # the set itself
    ]
    bad = ["", "a\nb", "x" * 600]
    await r.sadd(listed, f"{unique}-good", *hostile, *bad)
    await r.sadd(listed, b"\xff\xfe")  # not UTF-8
    metrics = Metrics()
    transport = SortedSetTransport(config, TransportContext(metrics=metrics))
    try:
        specs = await transport.discover()
    finally:
        await transport.aclose()
    assert [s.name for s in specs] == [f"{unique}-good"]
    assert specs[0].pool == "p" and specs[0].igw_base_url == GW  # from the template

    def refused(reason: str) -> float:
        return metrics.discovery_refused_total.labels(reason)._value.get()  # type: ignore[no-any-return]

    assert refused("daemon_key") == len(hostile)
    assert refused("bad_name") == len(bad) + 1


async def test_an_enormous_set_is_read_only_up_to_the_cap(
    redis_url: str, unique: str, r: Redis
) -> None:
    listed = f"{unique}:tenants"
    for start in range(0, 20_000, 5_000):
        await r.sadd(listed, *(f"{unique}-{n}" for n in range(start, start + 5_000)))
    config = transport_config(redis_url, unique, set_key=listed, max_queues=50)
    metrics = Metrics()
    transport = SortedSetTransport(config, TransportContext(metrics=metrics))

    async def sscans() -> int:
        return int((await r.info("commandstats")).get("cmdstat_sscan", {}).get("calls", 0))

    try:
        before = await sscans()
        specs = await transport.discover()
        calls = await sscans() - before
    finally:
        await transport.aclose()
    assert len(specs) == 50
    assert metrics.discovery_refused_total.labels("over_cap")._value.get() == 1
    assert calls == 1  # one SSCAN page of 20,000 members, not the whole set


async def test_a_prefix_scan_finds_the_sorted_sets_under_the_prefix(
    redis_url: str, unique: str, r: Redis
) -> None:
    prefix = f"{unique}:t:"
    await r.zadd(f"{prefix}a", {"m": 1})
    await r.zadd(f"{prefix}b", {"m": 1})
    await r.zadd(f"{prefix}a:inflight", {"c": 1})  # ours: skipped, not counted
    await r.rpush(f"{prefix}c", "not a sorted set")
    await r.zadd(f"{unique}:other", {"m": 1})
    metrics = Metrics()
    config = transport_config(redis_url, unique, key_prefix=prefix)
    transport = SortedSetTransport(config, TransportContext(metrics=metrics))
    try:
        specs = await discover_a_whole_cycle(transport)
    finally:
        await transport.aclose()
    assert sorted(s.name for s in specs) == [f"{prefix}a", f"{prefix}b"]
    assert metrics.discovery_refused_total.labels("daemon_key")._value.get() == 0


async def test_a_removed_queue_keeps_its_upkeep_until_its_retries_are_home(
    redis_url: str, unique: str, r: Redis
) -> None:
    listed, queue = f"{unique}:tenants", f"{unique}-a"
    await r.sadd(listed, queue)
    await submit(redis_url, unique, queue, "m1")
    transport = SortedSetTransport(
        transport_config(redis_url, unique, set_key=listed), TransportContext()
    )
    try:
        [spec] = await transport.discover()
        [delivery] = await transport.fetch(spec, 1, 0)
        transport.decode(delivery)
        await r.srem(listed, queue)
        assert await transport.discover() == []
        await transport.defer([Deferral(delivery, 0.05)])  # a retry of a removed queue
        assert await r.zcard(f"{queue}:retry") == 1  # its own retry set, not another's
        for _ in range(3):  # it lingers while its retry is out
            await transport.discover()
        assert queue in [q.name for q in transport.queues]
        await anyio.sleep(0.1)
        await transport.move_due()
        assert await r.zcard(queue) == 1  # home again
        with anyio.fail_after(15):  # then forgotten, once its grace has passed
            while queue in [q.name for q in transport.queues]:
                await transport.discover()
                await anyio.sleep(0.2)
    finally:
        await transport.aclose()


def test_existing_configs_keep_one_shared_retry_set_and_need_a_queue(
    redis_url: str, unique: str
) -> None:
    plain = SortedSetConfig.model_validate(
        {"url": redis_url, "queues": [{"queue_name": "q", "igw_base_url": GW}]}
    )
    transport = SortedSetTransport(plain, TransportContext())
    assert transport._keys.retry("q", plain.retry_queue_name) == "retry-sortedset"
    with pytest.raises(ValueError, match="at least one queue is required"):
        SortedSetConfig.model_validate({"url": redis_url})
    with pytest.raises(ValueError, match="exactly one of set_key or key_prefix"):
        transport_config(redis_url, unique, set_key="s", key_prefix="p")


async def test_a_listed_key_that_is_not_a_sorted_set_does_not_stop_the_others_upkeep(
    redis_url: str, unique: str, r: Redis
) -> None:
    listed, good, other = f"{unique}:tenants", f"{unique}-good", f"{unique}-session"
    await r.set(other, "another application's string")  # listed by mistake, or by a tenant
    await r.sadd(listed, good, other)
    await submit(redis_url, unique, good, "m1")
    metrics = Metrics()
    transport = SortedSetTransport(
        transport_config(redis_url, unique, set_key=listed), TransportContext(metrics=metrics)
    )
    try:
        specs = {s.name: s for s in await transport.discover()}
        assert list(specs) == [good]
        assert metrics.discovery_refused_total.labels("wrong_type")._value.get() == 1
        [delivery] = await transport.fetch(specs[good], 1, 0)
        transport.decode(delivery)
        await transport.defer([Deferral(delivery, 0.05)])
        await anyio.sleep(0.1)
        await transport.move_due()  # the good queue's retry goes home
        await transport.reap()
        await transport.expire_due()
        assert await r.zcard(good) == 1
    finally:
        await transport.aclose()


async def test_a_prefix_scan_reaches_every_master_of_a_cluster(
    redis_cluster: RedisClusterNodes, unique: str
) -> None:
    """Cluster mode: SCAN runs on each primary, so queues in every slot are found; each
    one's retries and results stay in its slot (``{q}:retry``, a tagged result list)."""
    prefix = f"{unique}:t:"
    names = [f"{{{prefix}{n}}}" for n in range(12)]  # hash tags: spread over the masters
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        for name in names:
            await client.zadd(name, {"m": 1})
        assert len({client.keyslot(n) for n in names}) > 1
        nodes = {client.get_node_from_key(n).name for n in names}
        assert len(nodes) == 3  # on every master
        template = {"igw_base_url": GW, "result_queue_name": "<queue>:results"}
        config = SortedSetConfig.model_validate(
            {
                "url": redis_cluster.url,
                "mode": "cluster",
                "queue_discovery": {"key_prefix": "{" + prefix, "template": template},
            }
        )
        transport = SortedSetTransport(config, TransportContext())
        try:
            found = sorted(s.name for s in await discover_a_whole_cycle(transport))
            await transport.move_due()  # per-queue retry sets, one call per slot
            await transport.expire_due()
        finally:
            await transport.aclose()
    finally:
        for name in names:
            await client.delete(name)
        await client.aclose()
    assert found == sorted(names)  # each with its result list in its own slot


async def test_a_prefix_scan_finds_every_queue_under_the_cap_beside_many_daemon_keys(
    redis_url: str, unique: str, r: Redis
) -> None:
    """The in-flight and retry sets of queues under the prefix are sorted sets too: they
    are skipped, and must not use up the scan's bound before the queues are found."""
    prefix = f"{unique}:t:"
    await r.zadd(f"{prefix}a", {"m": 1})
    await r.zadd(f"{prefix}b", {"m": 1})
    for n in range(300):  # claims and retries of busy (or removed) queues
        await r.zadd(f"{prefix}q{n}:retry", {"m": 1})
    metrics = Metrics()
    config = transport_config(redis_url, unique, key_prefix=prefix, max_queues=2)
    transport = SortedSetTransport(config, TransportContext(metrics=metrics))
    try:
        specs = await discover_a_whole_cycle(transport)
    finally:
        await transport.aclose()
    assert sorted(s.name for s in specs) == [f"{prefix}a", f"{prefix}b"]
    assert metrics.discovery_refused_total.labels("over_cap")._value.get() == 0


async def test_retries_left_in_the_shared_retry_set_still_go_home_with_discovery(
    redis_url: str, unique: str, r: Redis
) -> None:
    """Turning discovery on gives each queue its own retry set; what the deployment before
    it (or a replica of it still stopping, handing back) left in the shared one must not
    sit there for ever."""
    listed, queue = f"{unique}:tenants", f"{unique}-a"
    await r.sadd(listed, f"{unique}-b")
    member = (
        b'{"internal":{"request_queue_name":"' + queue.encode() + b'"},"request_kind":"x",'
        b'"data":{"id":"m1","deadline":' + str(int(time.time()) + 120).encode() + b"}}"
    )
    await r.zadd(f"{unique}:retry-set", {member: time.time() - 1})  # due
    config = transport_config(redis_url, unique, set_key=listed)
    config = config.model_copy(
        update={"queues": [SortedSetConfig.model_validate(
            {"queues": [{"queue_name": queue, "igw_base_url": GW}]}).queues[0]]}
    )  # fmt: skip
    transport = SortedSetTransport(config, TransportContext())
    try:
        await transport.discover()
        await transport.move_due()
    finally:
        await transport.aclose()
    assert await r.zcard(f"{unique}:retry-set") == 0
    assert await r.zrange(queue, 0, -1) == [member]


async def test_a_prefix_scan_costs_a_bounded_number_of_round_trips_per_refresh(
    private_redis: RedisServer, unique: str
) -> None:
    """Beside 60,000 unrelated keys a refresh makes at most PREFIX_SCAN_CALLS SCANs (a
    whole walk made 120 per refresh); a queue created is found within a cycle, and one
    deleted is gone within two."""
    r = Redis.from_url(private_redis.url)
    prefix = f"{unique}:t:"
    for start in range(0, 60_000, 5_000):
        await r.mset({f"unrelated:{n}": 1 for n in range(start, start + 5_000)})
    await r.zadd(f"{prefix}a", {"m": 1})
    config = transport_config(private_redis.url, unique, key_prefix=prefix)
    transport = SortedSetTransport(config, TransportContext())
    try:
        per_refresh = await _scans_per_refresh(r, transport, refreshes=3)
        assert max(per_refresh) <= PREFIX_SCAN_CALLS
        cycle = 60_000 // (PREFIX_SCAN_COUNT * PREFIX_SCAN_CALLS) + 1  # refreshes
        assert [s.name for s in await discover_a_whole_cycle(transport)] == [f"{prefix}a"]
        await r.zadd(f"{prefix}b", {"m": 1})
        await r.delete(f"{prefix}a")
        found: list[list[str]] = []
        for _ in range(2 * cycle + 1):
            found.append(sorted(s.name for s in await transport.discover()))
        assert f"{prefix}b" in found[cycle - 1]  # found within a cycle
        assert found[-1] == [f"{prefix}b"]  # and a gone within two
    finally:
        await transport.aclose()
        await r.aclose()


async def _scans_per_refresh(r: Redis, transport: SortedSetTransport, refreshes: int) -> list[int]:
    counts = []
    for _ in range(refreshes):
        before = (await r.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0)
        await transport.discover()
        after = (await r.info("commandstats"))["cmdstat_scan"]["calls"]
        counts.append(after - before)
    return counts


async def test_upkeep_asks_no_type_of_queues_with_nothing_to_do(
    redis_url: str, unique: str, r: Redis
) -> None:
    # Each retry-mover round type-checked every queue and its retry set, and each deadline
    # sweep every queue, although retry sets are almost always empty: with 200 tenant
    # queues Redis ran ~42 TYPEs per message. Now a round over idle queues asks none.
    listed = f"{unique}:tenants"
    names = [f"{unique}-t{n}" for n in range(40)]
    await r.sadd(listed, *names)
    for name in names:
        await submit(redis_url, unique, name, f"{name}/m")  # queued, not due, not retrying
    transport = SortedSetTransport(
        transport_config(redis_url, unique, set_key=listed), TransportContext()
    )
    try:
        assert len(await transport.discover()) == len(names)
        await transport.move_due()  # scripts loaded: the counted round runs them alone
        await transport.expire_due()
        before = await type_calls(r)
        await transport.move_due()
        await transport.expire_due()
        assert await type_calls(r) == before
        assert sum([await r.zcard(name) for name in names]) == len(names)
    finally:
        await transport.aclose()


async def type_calls(r: Redis) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_type", {}).get("calls", 0))
