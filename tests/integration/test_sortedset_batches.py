"""Scripts that cover many queues in one call, on real Redis, standalone and a 3-master
cluster. Result batches: one ``complete.lua`` call per hash slot (one in all outside
cluster mode), a queue whose key has the wrong type fails only its own items, and a batch
whose reply was lost is sent again without a second result. The heartbeat: one
``extend.lua`` call per hash slot, and a queue with a stray key fails alone; so does it
in the deadline sweep."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig
from async_processor.config.redis import slot
from async_processor.errors import PartialWrite, TransportError
from async_processor.messages import ErrorCode, Result
from async_processor.metrics import Metrics
from async_processor.pipeline.results import ResultWriter
from async_processor.transports.base import Completion, Deferral, Delivery, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from async_processor.transports.redis_sortedset.writes import ScriptCall
from tests.integration.test_sortedset import future, member, results_of
from tests.integration.test_sortedset_rounds import GW, config_for, ids_of, names_of, opened

pytestmark = pytest.mark.anyio
PER_QUEUE = 3


async def claimed(transport: SortedSetTransport, r: Any, names: list[str]) -> list[Delivery]:
    """``PER_QUEUE`` messages put on each queue and claimed."""
    deadline = future()
    fetched: list[Delivery] = []
    for name in names:
        await r.zadd(name, {member(f"{name}/{i}", deadline, token=f"{i:032x}"): deadline
                            for i in range(PER_QUEUE)})  # fmt: skip
    for queue in transport.queues:
        fetched += await transport.fetch(queue, PER_QUEUE, 0)
    assert len(fetched) == PER_QUEUE * len(names)
    return fetched


def sample(ctx: TransportContext, name: str, labels: dict[str, str]) -> float | None:
    assert ctx.metrics is not None
    return ctx.metrics.registry.get_sample_value(name, labels)


def done(delivery: Delivery) -> Completion:
    return Completion(delivery, Result.http(ids_of(delivery), 200, b"{}"))


async def test_a_batch_of_many_queues_is_one_call_per_slot(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, r = redis_for
    names = names_of(unique, 8)
    async with opened(config_for(url, mode, names)) as transport:
        items = [done(d) for d in await claimed(transport, r, names)]
        sent: list[int] = []
        real = transport._run_complete

        async def counted(calls: list[ScriptCall]) -> list[Any]:
            sent.append(len(calls))
            return await real(calls)

        monkeypatch.setattr(transport, "_run_complete", counted)
        await transport.complete(items)
        for name in names:
            assert await r.llen(f"{{{name}}}:r") == PER_QUEUE
            assert await r.zcard(transport._keys.claims_idx(name)) == 0
        assert not any(transport._claims.held.values())
    # Standalone: one call; cluster: one per hash slot (8 queues rarely share one).
    assert sent == [1 if mode == "standalone" else len({slot(n) for n in names})]


async def test_a_stray_key_fails_only_its_own_queues_results(
    mode: str, redis_for: tuple[str, Any], unique: str
) -> None:
    url, r = redis_for
    names = names_of(unique, 3)
    bad = names[1]
    async with opened(config_for(url, mode, names)) as transport:
        items = [done(d) for d in await claimed(transport, r, names)]
        meta = transport._keys.claimed(bad)
        held = await r.hgetall(meta)
        await r.delete(meta)
        await r.set(meta, "not a hash")
        with pytest.raises(PartialWrite, match="WRONGTYPE") as caught:
            await transport.complete(items)
        failed = [items[i] for i in caught.value.failed]
        assert sorted(ids_of(d) for d, _ in failed) == [f"{bad}/{i}" for i in range(PER_QUEUE)]
        for name in names:
            written = 0 if name == bad else PER_QUEUE
            assert await r.llen(f"{{{name}}}:r") == written
            assert await r.zcard(transport._keys.claims_idx(name)) == PER_QUEUE - written
        assert len(transport._claims.held[bad]) == PER_QUEUE  # still held: tried again
        await r.delete(meta)
        await r.hset(meta, mapping=held)
        await transport.complete(failed)
        assert await r.llen(f"{{{bad}}}:r") == PER_QUEUE
        assert await r.zcard(transport._keys.claims_idx(bad)) == 0


async def written(transport: SortedSetTransport, items: list[Completion]) -> list[Any]:
    """``items`` written by a result writer (retries included); the log events."""
    writer = ResultWriter(transport)
    sender = writer.sender()
    writer.close()
    async with sender:
        for item in items:
            await sender.send(item)
    with anyio.fail_after(20), capture_logs() as logs:
        await writer.run()
    return logs


async def test_a_lost_reply_resent_does_not_complete_twice(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scripts ran, the connection dropped before their reply: the writer sends the
    # whole batch again, and each dedup marker stops a second result. Nor is it counted
    # as a duplicate or a lapsed lease: the markers and the acks found are our own.
    url, r = redis_for
    names = names_of(unique, 4)
    ctx = TransportContext(metrics=Metrics())
    async with opened(config_for(url, mode, names), ctx) as transport:
        items = [done(d) for d in await claimed(transport, r, names)]
        real = transport._run_complete
        sent: list[int] = []

        async def reply_lost(calls: list[ScriptCall]) -> list[Any]:
            replies = await real(calls)
            sent.append(len(calls))
            if len(sent) == 1:
                raise RedisConnectionError("connection lost before the reply")
            return replies

        monkeypatch.setattr(transport, "_run_complete", reply_lost)
        logs = await written(transport, items)
        events = {e["event"] for e in logs}
        assert not events & {"duplicate_suppressed", "lease_expired_before_complete"}
        for name in names:
            labels = {"queue_id": name, "queue_name": name, "pool_name": "default"}
            assert not sample(ctx, "llm_d_async_async_duplicates_suppressed_total", labels)
            results = await r.lrange(f"{{{name}}}:r", 0, -1)
            assert sorted(Result.decode(raw).id for raw in results) == [
                f"{name}/{i}" for i in range(PER_QUEUE)
            ]
            assert await r.zcard(transport._keys.claims_idx(name)) == 0
        assert not any(transport._claims.held.values())
    assert len(sent) == 2  # sent once more, as a whole


async def test_a_heartbeat_between_a_lost_reply_and_its_resend_warns_no_lost_lease(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scripts acknowledged the claims, their reply was lost: the beat before the
    # writer's resend finds the claims gone, by our own write, not by a lapsed lease.
    url, r = redis_for
    names = names_of(unique, 2)
    async with opened(config_for(url, mode, names)) as transport:
        items = [done(d) for d in await claimed(transport, r, names)]
        real = transport._run_complete

        async def reply_lost(calls: list[ScriptCall]) -> list[Any]:
            await real(calls)
            raise RedisConnectionError("connection lost before the reply")

        monkeypatch.setattr(transport, "_run_complete", reply_lost)
        with pytest.raises(TransportError):
            await transport.complete(items)
        monkeypatch.setattr(transport, "_run_complete", real)
        with capture_logs() as logs:
            await transport.heartbeat()
            await transport.complete(items)
        for name in names:
            assert await r.llen(f"{{{name}}}:r") == PER_QUEUE
        assert not any(transport._claims.held.values())
    events = {e["event"] for e in logs}
    assert not events & {"leases_lost", "duplicate_suppressed", "lease_expired_before_complete"}


async def test_a_batch_resent_after_its_cleanup_failed_is_no_duplicate(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scripts ran (one claim among them no longer ours: fenced), then the step after
    # them failed: the batch is sent again, and neither a written result nor the fenced
    # claim counts as a duplicate or a lost lease the second time.
    url, r = redis_for
    names = names_of(unique, 2)
    ctx = TransportContext(metrics=Metrics())
    async with opened(config_for(url, mode, names), ctx) as transport:
        fetched = await claimed(transport, r, names)
        items = [done(d) for d in fetched]
        lapsed = fetched[0]
        await r.hset(transport._keys.owners(lapsed.queue.name), lapsed.handle.id, "f" * 16)
        real = transport._drop_payloads
        calls: list[int] = []

        async def fails_once(deliveries: list[Delivery]) -> None:
            calls.append(len(deliveries))
            if len(calls) == 1:
                raise TransportError("redis complete failed: connection lost")
            await real(deliveries)

        monkeypatch.setattr(transport, "_drop_payloads", fails_once)
        logs = await written(transport, items)
        assert len(calls) == 2
        events = [e["event"] for e in logs]
        assert "duplicate_suppressed" not in events
        # The fenced claim is warned of once: the resend, after a lost reply, is unsure.
        assert events.count("lease_expired_before_complete") == 1
        for name in names:
            fenced = name == lapsed.queue.name
            assert await r.llen(f"{{{name}}}:r") == PER_QUEUE - fenced
        assert not any(transport._claims.held.values())


async def test_the_heartbeat_is_one_call_per_slot_and_a_stray_key_fails_alone(
    mode: str, redis_for: tuple[str, Any], unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was one call per queue, in turn: 200 tenant queues, 200 round trips a beat, and
    # a queue whose key had the wrong type stopped the beat for every queue after it.
    url, r = redis_for
    names = names_of(unique, 6)
    bad = names[0]
    async with opened(config_for(url, mode, names)) as transport:
        fetched = await claimed(transport, r, names)
        await r.delete(transport._keys.claims_idx(bad))
        await r.set(transport._keys.claims_idx(bad), "not a sorted set")
        expiries = {d: await r.zscore(transport._keys.claims_idx(d.queue.name), d.handle.id)
                    for d in fetched if d.queue.name != bad}  # fmt: skip
        sent: list[int] = []
        real = transport._run_calls

        async def counted(action: str, script: str, calls: list[Any]) -> list[Any]:
            sent.append(len(calls))
            return await real(action, script, calls)

        monkeypatch.setattr(transport, "_run_calls", counted)
        await anyio.sleep(0.01)  # the new expiries are later
        with capture_logs() as logs:
            await transport.heartbeat()
        await r.delete(transport._keys.claims_idx(bad))
        for delivery, before in expiries.items():
            key = transport._keys.claims_idx(delivery.queue.name)
            assert await r.zscore(key, delivery.handle.id) > before
        assert len(transport._claims.held[bad]) == PER_QUEUE  # not taken for lost
    assert [e["queue"] for e in logs if e["event"] == "heartbeat_failed"] == [bad]
    assert sent == [1 if mode == "standalone" else len({slot(n) for n in names})]


async def test_a_stray_key_stops_only_its_own_queues_deadline_sweep(
    mode: str, redis_for: tuple[str, Any], unique: str
) -> None:
    # The sweep raised at the first queue with a stray key, so the expired members of
    # every queue after it were never answered while the key stayed.
    url, r = redis_for
    names = names_of(unique, 3)
    bad = names[0]
    past = int(time.time()) - 1
    async with opened(config_for(url, mode, names)) as transport:
        for name in names:
            await r.zadd(name, {member(f"{name}/late", past): past})
        await r.set(transport._keys.owners(bad), "not a hash")
        with capture_logs() as logs:
            await transport.expire_due()
        assert await r.zcard(bad) == 1  # left queued: tried again next round
        for name in names[1:]:
            [result] = await results_of(r, f"{{{name}}}:r")
            assert (result.id, result.error_code) == (f"{name}/late", ErrorCode.DEADLINE_EXCEEDED)
            assert await r.zcard(name) == 0
    assert [e["queue"] for e in logs if e["event"] == "expire_failed"] == [bad]


async def test_let_go_messages_of_many_slots_are_got_back_and_found_again(
    mode: str, redis_for: tuple[str, Any], unique: str
) -> None:
    # Deliveries whose bytes were let go, over queues of several hash slots: hand-backs
    # read their members back in one pipeline, and results after a lapsed lease (claims
    # reclaimed) are fenced, each in its own slot, leaving the members queued.
    url, r = redis_for
    names = names_of(unique, 4)
    async with opened(config_for(url, mode, names)) as transport:
        fetched = await claimed(transport, r, names)
        lapsed, handed = fetched[::2], fetched[1::2]
        members = {d: d.raw for d in lapsed}
        expected = {}
        for delivery in handed:
            assert delivery.envelope is not None
            delivery.envelope.routing.retry_count = 2
            expected[delivery] = delivery.envelope.encode()
        for delivery in fetched:
            transport.let_go(delivery)
        for delivery in lapsed:  # what the reaper does with a lapsed claim
            name, claim = delivery.queue.name, delivery.handle
            await r.zadd(name, {members[delivery]: claim.score})
            await r.zrem(transport._keys.claims_idx(name), claim.id)
            await r.hdel(transport._keys.claimed(name), claim.id)
            await r.hdel(transport._keys.owners(name), claim.id)
        await transport.complete([done(d) for d in lapsed])
        await transport.defer([Deferral(d, 0) for d in handed])
        for name in names:
            queued = set(await r.zrange(name, 0, -1))
            back = {expected[d] for d in handed if d.queue.name == name}
            assert queued == back | {members[d] for d in lapsed if d.queue.name == name}
            assert await r.llen(f"{{{name}}}:r") == 0


@pytest.mark.parametrize("mode", ["cluster"], indirect=True)
async def test_a_stray_key_stops_only_its_own_queues_retries_in_a_slot_group(
    mode: str, redis_for: tuple[str, Any], unique: str
) -> None:
    # move_due_own.lua failed the whole call for one wrong-typed key, so while it stayed no
    # due retry of any queue in its slot group (one call) went home.
    url, r = redis_for
    names = [f"{{{unique}}}-q{n}" for n in range(4)]  # one hash tag: one slot, one call
    stray_queue, stray_retry = names[0], names[1]
    past = int(time.time()) - 1
    queues = [{"queue_name": n, "igw_base_url": GW, "result_queue_name": f"{{{unique}}}:r"}
              for n in names]  # fmt: skip
    config = SortedSetConfig.model_validate({"url": url, "mode": mode, "queues": queues})
    async with opened(config) as transport:
        for name in names:
            await r.zadd(transport._keys.retry(name, ""), {member(f"{name}/r", past): past})
        await r.set(stray_queue, "not a sorted set")
        await r.delete(transport._keys.retry(stray_retry, ""))
        await r.set(transport._keys.retry(stray_retry, ""), "not a sorted set")
        with capture_logs() as logs:
            await transport.move_due()
        assert await r.zcard(transport._keys.retry(stray_queue, "")) == 1  # stays to retry
        for name in names[2:]:
            assert await r.zrange(name, 0, -1) == [member(f"{name}/r", past)]
            assert not await r.exists(transport._keys.retry(name, ""))
        for name in names[:2]:
            await r.delete(name, transport._keys.retry(name, ""))
    failed = {e["queue"]: e["error"] for e in logs if e["event"] == "retry_move_failed"}
    assert sorted(failed) == sorted(names[:2])
    assert all(error.startswith("WRONGTYPE") for error in failed.values())
