"""Routing a Go daemon or producer wrote, through our retries and re-adds (upstream-v0.10.md
§3 frozen result routing and ``result_ttl_seconds``, §5 scores on every re-add, §14 rows
2 and 3): envelopes written as Go's bytes, the daemon and the simulator real."""

from __future__ import annotations

import json
import time

import anyio
import pytest
from redis.asyncio import Redis

from async_processor.config import PoolConfig, SortedSetConfig
from async_processor.ops.deadletters import DeadLetters, Entry
from async_processor.redis.entries import dead_letter_entry
from tests.conformance.go_side import (
    GoRequest,
    GoResultReader,
    GoRouting,
    go_envelope,
    go_score,
    new_token,
)
from tests.conformance.support import GoSide, deadline_in, upstream, wait_until
from tests.fixtures.inprocess import metric, running, sortedset_config
from tests.fixtures.simulator import LocalSimulator
from tests.integration.test_sortedset import opened

pytestmark = pytest.mark.anyio

# What another consumer may have written into the routing: the SQL branch's
# dispatch_epoch and a field no release has yet, with number texts a re-encoding changes.
FOREIGN = b'"dispatch_epoch":12345678901234567890,"x_future":{"a":1.50e0,"b":[1E2,-0.0]}'


def with_foreign(member: bytes) -> bytes:
    """``member`` with ``FOREIGN`` at the end of its routing object."""
    at = member.index(b',"request_kind"') - 1  # the routing's closing brace
    return member[:at] + b"," + FOREIGN + member[at:]


def field_text(member: bytes, name: str) -> bytes:
    """The exact JSON text of field ``name`` (scalar or one nested object/array)."""
    start = member.index(b'"%s":' % name.encode()) + len(name) + 3
    depth, end = 0, start
    while end < len(member):
        char = member[end : end + 1]
        if char in b"{[":
            depth += 1
        elif char in b"}]" and depth:
            depth -= 1
        elif char in b",}]":
            break
        end += 1
    return member[start:end]


@upstream("§14.2", "§3", "§5", "§14.3")
async def test_a_retried_go_request_keeps_foreign_fields_its_route_and_its_place(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    deadline, token = deadline_in(300), new_token()
    routing = GoRouting(
        request_token=token, request_queue_name=go.queue, result_queue_name=go.results,
        enqueue_seq=3,
    )  # fmt: skip
    await r.zadd(go.queue, {with_foreign(go_envelope(routing, GoRequest("re", deadline))):
                            go_score(deadline, 3)})  # fmt: skip
    bound = f"{go.queue}:bound"
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue,
        queue_extra={"result_queue_name": bound, "result_ttl_seconds": 900},
    )  # fmt: skip
    retry = f"{go.queue}:retry"
    local_simulator.configure(error_rate=1.0, error_status=503)
    async with running(config):
        [parked] = await wait_until(lambda: r.zrange(retry, 0, -1))
    routing_obj = json.loads(parked)["internal"]
    assert routing_obj["retry_count"] == 1
    for name in ("dispatch_epoch", "x_future"):  # byte for byte
        assert field_text(parked, name) == field_text(FOREIGN, name)
    assert routing_obj["enqueue_seq"] == 3 and routing_obj["request_token"] == token
    # Frozen at the first fetch as a Go daemon freezes it: the queue's list and TTL.
    assert routing_obj["result_routing_resolved"] is True
    assert routing_obj["result_queue_name"] == bound
    assert routing_obj["result_ttl_seconds"] == 900
    # Due now: the retry mover re-adds it with the §5 score, not its bare deadline.
    await r.zadd(retry, {parked: 0}, xx=True)
    transport = config.transport_config
    assert isinstance(transport, SortedSetConfig)
    async with opened(transport) as mover, anyio.create_task_group() as tg:
        await tg.start(mover.run)
        await wait_until(lambda: r.zscore(go.queue, parked))
        tg.cancel_scope.cancel()
    assert await r.zscore(go.queue, parked) == go_score(deadline, 3)
    local_simulator.configure(error_rate=0.0)
    async with running(config):
        await wait_until(lambda: r.llen(bound))
        # The route's TTL is applied to the list, as upstream's ack does.
        assert 890 <= await r.ttl(bound) <= 900
        result = (await GoResultReader(r, bound).receive_all(1))["re"]
    assert result["status_code"] == 200 and result["request_token"] == token


@upstream("§3")
async def test_a_route_frozen_by_a_go_daemon_answers_there_with_its_ttl(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """A request a Go daemon fetched first (and handed back) answers on the list and with
    the TTL it froze, whatever our queue config says now."""
    frozen = f"{go.queue}:frozen"
    routing = GoRouting(
        request_token=new_token(), request_queue_name=go.queue, result_queue_name=frozen,
        queue_id="go-queue", result_ttl_seconds=600, result_routing_resolved=True,
    )  # fmt: skip
    deadline = deadline_in(300)
    await r.zadd(go.queue, {go_envelope(routing, GoRequest("fz", deadline)): deadline})
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue, queue_extra={"result_queue_name": go.results}
    )
    async with running(config):
        await wait_until(lambda: r.llen(frozen))
        assert 590 <= await r.ttl(frozen) <= 600
        result = (await GoResultReader(r, frozen).receive_all(1))["fz"]
    assert result["status_code"] == 200
    assert await r.llen(go.results) == 0


@upstream("§3")
async def test_a_route_resolved_without_a_list_answers_on_the_transport_default(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """Resolved with no ``result_queue_name`` (the queue named none when a Go daemon
    froze it): the transport's default list, not the queue's list configured since."""
    routing = GoRouting(
        request_token=new_token(), request_queue_name=go.queue, result_routing_resolved=True
    )
    deadline = deadline_in(300)
    await r.zadd(go.queue, {go_envelope(routing, GoRequest("dflt", deadline)): deadline})
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue,
        queue_extra={"result_queue_name": f"{go.queue}:since"},
    )  # fmt: skip
    async with running(config):
        result = (await go.reader.receive_all(1))["dflt"]  # go.results: the default
    assert result["status_code"] == 200
    assert not await r.exists(f"{go.queue}:since")


@upstream("§3")
@pytest.mark.parametrize(("configured", "expected"), [(3600, (3500, 3600)), (0, (-1, -1))])
async def test_a_route_ttl_never_shortens_a_configured_lists_retention(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator,
    configured: int, expected: tuple[int, int],
) -> None:  # fmt: skip
    """Ours (a message is untrusted input): on a result list our config names, the
    configured retention wins over a TTL in the routing: a shorter one is raised to it,
    and a list kept for ever (0) gets no expiry, so one message cannot expire a list
    other requests' results wait in."""
    routing = GoRouting(
        request_token=new_token(), request_queue_name=go.queue, result_queue_name=go.results,
        result_ttl_seconds=1, result_routing_resolved=True,
    )  # fmt: skip
    deadline = deadline_in(300)
    await r.zadd(go.queue, {go_envelope(routing, GoRequest("short", deadline)): deadline})
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue,
        transport_extra={"result_ttl_seconds": configured},
    )  # fmt: skip
    async with running(config):
        await wait_until(lambda: r.llen(go.results))
        assert expected[0] <= await r.ttl(go.results) <= expected[1]


@upstream("§5", "§14.3")
async def test_a_dead_letter_replay_re_adds_with_the_submission_order_score(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    deadline = deadline_in(300)
    routing = GoRouting(request_token=new_token(), request_queue_name=go.queue, enqueue_seq=9)
    raw = go_envelope(routing, GoRequest("dl", deadline))
    config = sortedset_config(redis_url, local_simulator.url, go.queue).transport_config
    assert isinstance(config, SortedSetConfig)
    entry = dead_letter_entry(raw, go.queue, "superseded", "test").encode()
    lists = DeadLetters(config, r)
    await r.lpush(lists._keys.dead_letter(go.queue), entry)
    assert await lists.replay(Entry(go.queue, entry), None, time.time()) == 1
    assert await r.zscore(go.queue, raw) == go_score(deadline, 9)
    # A fresh deadline keeps the order among that deadline's requests too.
    await r.delete(go.queue)
    await r.lpush(lists._keys.dead_letter(go.queue), entry)
    now = time.time()
    assert await lists.replay(Entry(go.queue, entry), 600.0, now) == 1
    [(_, score)] = await r.zrange(go.queue, 0, -1, withscores=True)
    assert score == go_score(int(now + 600), 9)


@upstream("§14.2", "§5", "§14.3")
async def test_a_shutdown_hands_back_go_requests_with_their_fields_and_places(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """A daemon stopping with a prefetched claim hands it back to its queue: re-written
    (route frozen), the foreign fields byte for byte, at its §5 score."""
    deadline = deadline_in(300)
    for n in range(1, 6):
        routing = GoRouting(
            request_token=new_token(), request_queue_name=go.queue,
            result_queue_name=go.results, enqueue_seq=n,
        )  # fmt: skip
        member = with_foreign(go_envelope(routing, GoRequest(f"h{n}", deadline)))
        await r.zadd(go.queue, {member: go_score(deadline, n)})
    local_simulator.configure(latency=1.0)  # one at the gateway while the next waits
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue, pools=[PoolConfig(id="one", workers=1)]
    )
    async with running(config):
        await wait_until(lambda: local_simulator.stats()["in_flight"] >= 1)
    members = await r.zrange(go.queue, 0, -1, withscores=True)
    handed = [m for m, _ in members if json.loads(m)["internal"].get("result_routing_resolved")]
    assert handed, "nothing was handed back"
    for member, score in members:
        routing_obj = json.loads(member)["internal"]
        assert score == go_score(deadline, routing_obj["enqueue_seq"])
        for name in ("dispatch_epoch", "x_future"):
            assert field_text(member, name) == field_text(FOREIGN, name)
    assert len(members) + await r.llen(go.results) == 5


@upstream("§1.5")
async def test_a_closed_queue_gate_leaves_go_members_untouched(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """A queue whose gate gives no budget claims nothing: the producer's members keep
    their bytes and scores (nothing re-added, nothing answered), as upstream's zero batch."""
    deadline = deadline_in(300)
    sent = [await go.producer.submit(GoRequest(f"g{n}", deadline)) for n in range(3)]
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue,
        queue_extra={"gate_type": "constant", "gate_params": {"value": 0}},
    )  # fmt: skip
    async with running(config) as daemon:
        await wait_until(lambda: metric(daemon, "llm_d_async_async_gate_decisions_total") > 0)
    members = await r.zrange(go.queue, 0, -1, withscores=True)
    assert members == [(s.member, go_score(deadline, s.seq)) for s in sent]
    assert await r.llen(go.results) == 0
    assert local_simulator.requests() == []
