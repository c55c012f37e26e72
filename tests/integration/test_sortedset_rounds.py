"""Fetching with many queues (redis_fetch.py) on real Redis, standalone and a 3-master
cluster: claims of several queues share a round trip without losing or duplicating a
message, one queue's stray key fails only its own claim, an idle queue is probed instead
of claimed and still wakes for a new message, and held claims' cancel readings are
refreshed by the cancel watch's read."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis, RedisCluster
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig
from async_processor.errors import TransportError
from async_processor.messages import Result
from async_processor.metrics import Metrics
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Completion, Delivery, TransportContext
from async_processor.transports.redis_sortedset.fetch import Fetcher
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.integration.test_sortedset import GW, future, member

pytestmark = pytest.mark.anyio
QUEUES = 12
PER_QUEUE = 15


def names_of(unique: str, count: int = QUEUES) -> list[str]:
    return [f"{unique}-q{n}" for n in range(count)]


def config_for(url: str, mode: str, names: list[str], **extra: Any) -> SortedSetConfig:
    queues = [
        {"queue_name": name, "igw_base_url": GW, "result_queue_name": f"{{{name}}}:r"}
        for name in names
    ]
    return SortedSetConfig.model_validate(
        {"url": url, "mode": mode, "lease_seconds": 30, "queues": queues, **extra}
    )


@asynccontextmanager
async def opened(
    config: SortedSetConfig, ctx: TransportContext | None = None
) -> AsyncIterator[SortedSetTransport]:
    transport = SortedSetTransport(config, ctx or TransportContext())
    try:
        yield transport
    finally:
        await transport.aclose()


def count_rounds(transport: SortedSetTransport, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of queue claims in each round the transport sends."""
    rounds: list[int] = []
    send = Fetcher._claim_round

    async def counted(self: Fetcher, asks: list[Any]) -> None:
        rounds.append(len(asks))
        await send(self, asks)

    monkeypatch.setattr(Fetcher, "_claim_round", counted)
    return rounds


async def test_concurrent_claims_of_many_queues_share_rounds_and_deliver_each_message_once(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, r = redis_for
    names = names_of(unique)
    deadline = future()
    for name in names:
        await r.zadd(name, {member(f"{name}/{i}", deadline, token=f"{i:032x}"): deadline
                            for i in range(PER_QUEUE)})  # fmt: skip
    config = config_for(url, mode, names, claim_gather_ms=20)
    fetched: list[Delivery] = []
    async with opened(config) as transport:
        rounds = count_rounds(transport, monkeypatch)

        async def drain(index: int) -> None:
            queue = transport.queues[index]
            while got := await transport.fetch(queue, 1 + index % 3, 0):
                fetched.extend(got)

        async with anyio.create_task_group() as tg:
            for index in range(len(names)):
                tg.start_soon(drain, index)
        ids = Counter(transport.decode(d).id for d in fetched)
        for name in names:
            assert await r.zcard(transport._keys.claims_idx(name)) == PER_QUEUE
        await transport.complete(
            [Completion(d, Result.http(ids_of(d), 200, b"{}")) for d in fetched]
        )
        for name in names:
            assert await r.zcard(name) == 0
            assert await r.zcard(transport._keys.claims_idx(name)) == 0
            assert await r.llen(f"{{{name}}}:r") == PER_QUEUE
    assert ids == Counter(f"{name}/{i}" for name in names for i in range(PER_QUEUE))
    assert max(rounds) > 1  # claims of several queues went together
    assert sum(rounds) > len(rounds)


def ids_of(delivery: Delivery) -> str:
    assert delivery.envelope is not None
    return delivery.envelope.id


async def test_a_round_of_many_queues_is_one_claim_call_and_one_marker_read(
    redis_url: str, unique: str
) -> None:
    """Standalone: 10 queues fetching at once cost one EVALSHA and one MGET in all."""
    r = Redis.from_url(redis_url)
    names = names_of(unique, 10)
    deadline = future()
    for name in names:
        await r.zadd(name, {member(f"{name}/m", deadline, token="a" * 32): deadline})
    config = config_for(redis_url, "standalone", names, claim_gather_ms=200)

    async def calls() -> Counter[str]:
        stats = await r.info("commandstats")
        return Counter({k: int(v["calls"]) for k, v in stats.items()})

    async with opened(config) as transport:
        await transport._scripts["claim"].registered_client.script_load(
            transport._scripts["claim"].script
        )
        before = await calls()
        got: list[Delivery] = []

        async def fetch(index: int) -> None:
            got.extend(await transport.fetch(transport.queues[index], 1, 0))

        async with anyio.create_task_group() as tg:
            for index in range(len(names)):
                tg.start_soon(fetch, index)
        used = await calls() - before
    await r.aclose()
    assert sorted(ids_of_raw(d) for d in got) == sorted(f"{name}/m" for name in names)
    assert used["cmdstat_evalsha"] == 1
    assert used["cmdstat_mget"] == 1


def ids_of_raw(delivery: Delivery) -> str:
    return delivery.raw.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()


async def test_a_stray_key_fails_only_its_own_queues_claim(
    mode: str, redis_for: tuple[str, Any], unique: str
) -> None:
    url, r = redis_for
    bad, good = names_of(unique, 2)
    deadline = future()
    await r.zadd(bad, {member("bad/m", deadline): deadline})
    await r.zadd(good, {member("good/m", deadline): deadline})
    config = config_for(url, mode, [bad, good], claim_gather_ms=200)
    async with opened(config) as transport:
        await r.set(transport._keys.claims_idx(bad), "not a sorted set")
        outcome: dict[str, Any] = {}

        async def fetch(index: int) -> None:
            try:
                outcome[transport.queues[index].name] = await transport.fetch(
                    transport.queues[index], 5, 0
                )
            except TransportError as exc:
                outcome[transport.queues[index].name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch, 0)
            tg.start_soon(fetch, 1)
        await r.delete(transport._keys.claims_idx(bad))
    assert isinstance(outcome[bad], TransportError)
    assert "WRONGTYPE" in str(outcome[bad])
    assert [ids_of_raw(d) for d in outcome[good]] == ["good/m"]
    assert await r.zcard(bad) == 1  # untouched


async def test_an_idle_queue_is_probed_not_claimed_and_wakes_for_a_new_message(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, r = redis_for
    names = names_of(unique, 3)
    config = config_for(url, mode, names)
    async with opened(config) as transport:
        rounds = count_rounds(transport, monkeypatch)
        got: list[Delivery] = []

        async def fetch() -> None:
            got.extend(await transport.fetch(transport.queues[1], 1, 30.0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch)
            await anyio.sleep(1.0)  # ten probe steps on an empty queue
            assert rounds == [1]  # claimed once, found empty; since then only probed
            deadline = future()
            await r.zadd(names[1], {member("late", deadline): deadline})
            with anyio.fail_after(10):  # well inside the fetch's own 30 s
                while not got:
                    await anyio.sleep(0.02)
    assert [ids_of_raw(d) for d in got] == ["late"]
    assert rounds == [1, 1]


async def test_a_failing_probe_is_counted_and_warned_rate_limited(
    redis_url: str, unique: str
) -> None:
    """A Redis refusing the probe (here an ACL losing EVALSHA) is seen, not swallowed: each
    failure counted, one warning per PROBE_WARN_SECONDS, no payload or password in it."""
    admin = Redis.from_url(redis_url)
    await admin.execute_command("ACL", "SETUSER", unique, "on", f">{unique}pw", "~*", "+@all")
    host_port = redis_url.split("//", 1)[1]
    config = config_for(f"redis://{unique}:{unique}pw@{host_port}", "standalone", [unique])
    metrics = Metrics()
    try:
        async with opened(config, TransportContext(metrics=metrics)) as transport:
            assert await transport.fetch(transport.queues[0], 1, 0) == []  # now idle
            await admin.execute_command("ACL", "SETUSER", unique, "-evalsha", "-eval")
            with capture_logs() as logs:
                for _ in range(3):
                    with pytest.raises(TransportError, match="no permissions"):  # the claim
                        await transport.fetch(transport.queues[0], 1, 1.0)
    finally:
        await admin.execute_command("ACL", "DELUSER", unique)
        await admin.aclose()
    assert metrics.registry.get_sample_value("llm_d_async_async_idle_probe_errors_total") == 3
    [warned] = [x for x in logs if x["event"] == "idle_probe_failed"]
    assert warned["log_level"] == "warning" and "no permissions" in warned["error"]
    assert warned["queues"] == 1 and f"{unique}pw" not in str(warned)


async def test_a_removed_idle_queue_is_forgotten_by_the_probe(redis_url: str, unique: str) -> None:
    names = names_of(unique, 2)
    config = config_for(redis_url, "standalone", names)
    async with opened(config) as transport:
        assert await transport.fetch(transport.queues[0], 1, 0) == []
        assert transport._fetcher._empty == {names[0]}
        transport._fetcher.served({names[1]})
        assert transport._fetcher._empty == set()


async def test_the_cancel_watch_read_refreshes_prefetched_claims(
    redis_url: str, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel made while a message waits for a worker is seen by the worker's check from
    the watch's last read, with no read of its own; later readings are not reused."""
    r = Redis.from_url(redis_url)
    name = names_of(unique, 1)[0]
    deadline = future()
    await r.zadd(name, {member("busy", deadline, token="a" * 32): deadline,
                        member("waiting", deadline + 1, token="b" * 32): deadline + 1})  # fmt: skip
    config = config_for(redis_url, "standalone", [name])
    async with opened(config) as transport:
        busy, waiting = await transport.fetch(transport.queues[0], 2, 0)
        for delivery in (busy, waiting):
            transport.decode(delivery)
            assert not await transport.is_cancelled(delivery)  # the poller's check
        await anyio.sleep(0.25)  # older than REFRESH_AGE
        await r.set(redis_keys.cancel_key("waiting"), "b" * 32)
        assert await transport.cancelled([busy]) == [False]  # the watch's round
        reads: list[Any] = []
        mget = transport._redis.mget

        async def counted(*args: Any, **kwargs: Any) -> Any:
            reads.append(args)
            return await mget(*args, **kwargs)

        monkeypatch.setattr(transport._redis, "mget", counted)
        assert await transport.is_cancelled(waiting)  # from the watch's reading
        assert reads == []
        await r.delete(redis_keys.cancel_key("waiting"))
        assert not await transport.is_cancelled(waiting)  # that reading answered once
        assert len(reads) == 1
    await r.aclose()


async def test_a_node_failing_its_claim_fails_only_its_queues_in_a_cluster_round(
    redis_cluster: RedisClusterNodes, unique: str
) -> None:
    """A round's claims go to each master in one pipeline: a master that lost its scripts
    (restarted, or a promoted replica) fails its own queues' claims, and the queue on a
    healthy master still gets its message (not claimed in Redis and then discarded, to
    wait out its lease in nobody's hands)."""
    r = RedisCluster.from_url(redis_cluster.url)
    await r.initialize()
    names = names_of(unique, 40)
    bad = names[0]
    bad_node = r.get_node_from_key(bad)
    good = next(n for n in names if r.get_node_from_key(n).name != bad_node.name)
    config = config_for(redis_cluster.url, "cluster", [bad, good], claim_gather_ms=200)
    async with opened(config) as transport:
        await both_fetched(transport)  # both empty: loads the scripts on every master
        await r.execute_command("SCRIPT", "FLUSH", target_nodes=bad_node)
        deadline = future()
        await r.zadd(bad, {member("bad/m", deadline): deadline})
        await r.zadd(good, {member("good/m", deadline): deadline})
        try:
            outcome = await both_fetched(transport)
        finally:  # the next tests' transports find their scripts at once
            for script in transport._scripts.values():
                await script.registered_client.script_load(script.script)
    await r.aclose()
    assert isinstance(outcome[bad], TransportError)
    assert "NoScript" in str(outcome[bad])
    assert [ids_of_raw(d) for d in outcome[good]] == ["good/m"]


async def test_a_master_lost_mid_round_keeps_what_the_other_masters_claimed(
    tmp_path: Path, unique: str
) -> None:
    """A master killed under a round: its connection fails at the send, and the cluster
    pipeline raises as a whole. The claim another master made in that round is still
    delivered (claimed once, not left to wait out its lease in nobody's hands)."""
    cluster = RedisClusterNodes(dir=tmp_path).start()  # its own: a master is killed
    r = RedisCluster.from_url(cluster.url)
    try:
        await r.initialize()
        names = names_of(unique, 40)
        first = f"127.0.0.1:{cluster.ports[0]}"  # the client's startup node stays up
        bad = next(n for n in names if r.get_node_from_key(n).name != first)
        bad_node = r.get_node_from_key(bad)
        good = next(n for n in names if r.get_node_from_key(n).name != bad_node.name)
        config = config_for(cluster.url, "cluster", [bad, good], claim_gather_ms=200)
        async with opened(config) as transport:
            await both_fetched(transport)  # both empty: scripts loaded, connections open
            cluster.procs[cluster.ports.index(int(bad_node.port))].kill()
            cluster.procs[cluster.ports.index(int(bad_node.port))].wait()
            await both_fetched(transport)  # its pooled connection found dead, dropped
            deadline = future()
            await r.zadd(good, {member("good/m", deadline): deadline})
            outcome = await both_fetched(transport)  # reconnecting to it fails the send
            assert isinstance(outcome[bad], TransportError)
            assert not isinstance(outcome[good], TransportError), outcome[good]
            assert [ids_of_raw(d) for d in outcome[good]] == ["good/m"]
            assert await r.zcard(transport._keys.claims_idx(good)) == 1  # claimed once
            assert await r.zcard(good) == 0
    finally:
        await r.aclose()
        cluster.stop()


async def both_fetched(transport: SortedSetTransport) -> dict[str, Any]:
    """The first two queues fetched in one round: their deliveries, or the error."""
    outcome: dict[str, Any] = {}

    async def fetch(index: int) -> None:
        queue = transport.queues[index]
        try:
            outcome[queue.name] = await transport.fetch(queue, 5, 0)
        except TransportError as exc:
            outcome[queue.name] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetch, 0)
        tg.start_soon(fetch, 1)
    return outcome
