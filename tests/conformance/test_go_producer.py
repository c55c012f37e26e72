"""A Go producer's requests through our daemon and the simulator, read back by a Go
``ReceiveResult`` reader (upstream-v0.10.md §1 steps 3-4, §2, §4, §5, §14 rows 1-4).

Everything on the wire is written and read by ``go_side`` as upstream's Go code does;
the daemon runs in-process on a real redis-server and sends to the simulator over HTTP.
"""

from __future__ import annotations

import json

import pytest
from redis.asyncio import Redis

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import PoolConfig
from tests.conformance.go_side import (
    GoRequest,
    GoRouting,
    go_compact,
    go_envelope,
    go_score,
    new_token,
)
from tests.conformance.support import GoSide, deadline_in, upstream, wait_until
from tests.fixtures.inprocess import metric, running, sortedset_config
from tests.fixtures.simulator import LocalSimulator

pytestmark = pytest.mark.anyio

# Payload texts a re-encoding would change: key order, big integers, float texts, escapes,
# HTML characters (Go escapes them in an inline envelope), non-ASCII, a line separator.
ODD = (
    b'{"z": 1, "a": 12345678901234567890, "f": 1.10, "e": 1E2, "s": "caf\\u00e9 <b>&",'
    b' "u": "\xc3\xa9\xe2\x80\xa8", "n": null, "model": "sim-model"}'
)


def bodies(sim: LocalSimulator) -> list[bytes]:
    return [r["body"].encode() for r in sim.requests()]


@upstream("§2", "§4", "§14.1", "§14.3")
async def test_inline_requests_are_sent_verbatim_and_answered_once_with_their_token(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    deadline = deadline_in(300)
    # With data.model (upstream's, #458: span attribute only, not sent).
    sent = [
        await go.producer.submit(GoRequest(f"i{n}", deadline, ODD, model="m")) for n in range(3)
    ]
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        results = await go.reader.receive_all(3)
    # The gateway got the envelope's payload bytes as the Go producer wrote them.
    assert bodies(local_simulator) == [go_compact(ODD)] * 3
    for n, submitted in enumerate(sent):
        result = results[f"i{n}"]
        assert result["status_code"] == 200
        assert result["request_token"] == submitted.token
        assert json.loads(result["payload"])["object"]  # the simulator's completion
        # Upstream's marker cleanup after the result: the active marker is gone.
        assert not await r.exists(f"request-active:i{n}")
    assert await r.zcard(go.queue) == 0


@upstream("§4", "§14.3")
async def test_payload_keys_dispatch_the_stored_bytes_and_go_with_the_result(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    go.producer.payload_keys = True
    submitted = await go.producer.submit(GoRequest("keyed", deadline_in(300), ODD))
    key = f"request-payload:keyed:{submitted.token}"
    envelope = json.loads(submitted.member)
    assert envelope["internal"]["payload_ref"] == key and "payload" not in envelope["data"]
    assert await r.get(key) == ODD  # stored as given: not compacted, not escaped
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        results = await go.reader.receive_all(1)
    assert bodies(local_simulator) == [ODD]
    assert results["keyed"]["request_token"] == submitted.token
    assert not await r.exists(key)


@upstream("§4")
async def test_a_missing_payload_key_is_one_payload_unavailable_result(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    go.producer.payload_keys = True
    submitted = await go.producer.submit(GoRequest("evicted", deadline_in(300), ODD))
    await r.delete(f"request-payload:evicted:{submitted.token}")  # evicted, expired
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        results = await go.reader.receive_all(1)
        with pytest.raises(TimeoutError):  # exactly one result
            await go.reader.receive(timeout=0.5)
    result = results["evicted"]
    assert result["error_code"] == "PAYLOAD_UNAVAILABLE"
    assert result["error_message"] == "request payload is missing"
    assert json.loads(result["payload"]) == {"error": "request payload is missing"}
    assert result["request_token"] == submitted.token
    assert bodies(local_simulator) == []


@upstream("§5", "§14.3")
async def test_go_and_python_producers_share_one_submission_order(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """Six requests of one deadline, from both producers in turn, leave in the order
    they were submitted (one worker, so the gateway sees that order)."""
    deadline = deadline_in(300)
    order = [f"o{n}" for n in range(6)]
    async with SortedSetClient(redis_url, go.queue, go.results) as ours:
        for n, request_id in enumerate(order):
            if n % 2:
                payload = {"model": "sim-model", "prompt": request_id}
                await ours.submit({"id": request_id, "deadline": deadline, "payload": payload})
            else:
                payload_text = b'{"model":"sim-model","prompt":"%s"}' % request_id.encode()
                await go.producer.submit(GoRequest(request_id, deadline, payload_text))
    members = await r.zrange(go.queue, 0, -1, withscores=True)
    assert [s for _, s in members] == [go_score(deadline, n) for n in range(1, 7)]
    assert [json.loads(m)["internal"]["enqueue_seq"] for m, _ in members] == [1, 2, 3, 4, 5, 6]
    counter = f"request-seq:{go.queue}:{deadline}"
    assert abs(await r.expiretime(counter) - (deadline + 3600)) <= 1
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue, pools=[PoolConfig(id="one", workers=1)]
    )
    async with running(config):
        await go.reader.receive_all(6)
    prompts = [json.loads(body)["prompt"] for body in bodies(local_simulator)]
    assert prompts == order


@upstream("§1.3", "§14.3")
async def test_an_expired_request_is_answered_deadline_exceeded(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    deadline = deadline_in(2)
    submitted = await go.producer.submit(GoRequest("late", deadline))
    await wait_until(lambda: deadline_in(0) > deadline, timeout=10)
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)) as daemon:
        results = await go.reader.receive_all(1)
        expired = metric(daemon, "llm_d_async_async_exceeded_deadline_requests_total")
    result = results["late"]
    assert result["error_code"] == "DEADLINE_EXCEEDED"
    assert result["status_code"] == 0
    assert result["request_token"] == submitted.token
    assert json.loads(result["payload"]) == {"error": result["error_message"]}
    assert expired == 1
    assert bodies(local_simulator) == []


@upstream("§1.4", "§2")
async def test_a_go_cancel_is_answered_cancelled_without_a_dispatch(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    submitted = await go.producer.submit(GoRequest("stop", deadline_in(300)))
    kept = await go.producer.submit(GoRequest("go-on", deadline_in(300)))
    await go.producer.cancel("stop")
    assert await r.get("request-cancel:stop") == submitted.token.encode()
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        results = await go.reader.receive_all(2)
    assert results["stop"]["error_code"] == "CANCELLED"
    assert results["stop"]["request_token"] == submitted.token
    # Upstream's cleanup after the result: both markers, while they hold this token.
    assert not await r.exists("request-cancel:stop", "request-active:stop")
    assert results["go-on"]["status_code"] == 200
    assert results["go-on"]["request_token"] == kept.token
    assert len(bodies(local_simulator)) == 1


@upstream("§2")
async def test_a_resubmitted_id_reaches_the_reader_again(
    redis_url: str, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """The reader's duplicate suppression is per (id, request_token): a result without
    its token would be taken for a duplicate of the first and dropped for 7 days."""
    config = sortedset_config(redis_url, local_simulator.url, go.queue)
    async with running(config):
        first = await go.producer.submit(GoRequest("again", deadline_in(300)))
        assert (await go.reader.receive_all(1))["again"]["request_token"] == first.token
        second = await go.producer.submit(GoRequest("again", deadline_in(300)))
        assert (await go.reader.receive_all(1))["again"]["request_token"] == second.token


@upstream("§2")
async def test_a_duplicate_of_an_answered_result_is_suppressed_by_the_reader(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """What a crash between a cluster ack's push and its claim drop leaves (§6): the same
    result twice. The reader hands it over once (our results carry the key it dedupes by)."""
    await go.producer.submit(GoRequest("twice", deadline_in(300)))
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        await wait_until(lambda: r.llen(go.results))
    [raw] = await r.lrange(go.results, 0, -1)
    await r.lpush(go.results, raw)
    assert list(await go.reader.receive_all(1)) == ["twice"]
    with pytest.raises(TimeoutError):
        await go.reader.receive(timeout=0.5)
    assert await r.llen(go.results) == 0


@upstream("§14.4")
async def test_the_queue_objective_goes_in_the_header_upstream_sends(
    redis_url: str, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """Unverified upstream (§14 row 4): the queue-level objective header after v0.10; we
    keep ``x-gateway-inference-objective`` as its code sends it."""
    await go.producer.submit(GoRequest("objective", deadline_in(300)))
    config = sortedset_config(
        redis_url, local_simulator.url, go.queue, queue_extra={"inference_objective": "gold"}
    )
    async with running(config):
        await go.reader.receive_all(1)
    [request] = local_simulator.requests()
    assert request["headers"].get("x-gateway-inference-objective") == "gold"


@upstream("§2")
async def test_the_legacy_brpop_reader_reads_the_same_results(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """``GetResult`` (BRPOP, oldest first) still works on the same list."""
    for n in range(2):
        await go.producer.submit(GoRequest(f"b{n}", deadline_in(300 + n)))
    config = sortedset_config(redis_url, local_simulator.url, go.queue)
    async with running(config):
        popped = []
        while len(popped) < 2:
            reply = await r.brpop([go.results], timeout=15)
            assert reply is not None
            popped.append(json.loads(reply[1])["id"])
    assert sorted(popped) == ["b0", "b1"]


@upstream("§4")
async def test_a_null_payload_is_sent_as_null(
    redis_url: str, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """A Go request without a payload (``json.RawMessage`` nil is written ``null``)
    reaches the gateway as the body ``null``, as upstream's worker sends it."""
    submitted = await go.producer.submit(GoRequest("empty", deadline_in(300), None))
    assert b'"payload":null' in submitted.member
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        result = (await go.reader.receive_all(1))["empty"]
    assert bodies(local_simulator) == [b"null"]
    assert result["request_token"] == submitted.token


@upstream("§2")
async def test_a_gateway_error_is_a_result_a_go_reader_parses(
    redis_url: str, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """A non-retryable HTTP answer: ``status_code`` and the body as the ``payload``
    string, typed as upstream's result struct reads them."""
    local_simulator.configure(error_rate=1.0, error_status=400)
    submitted = await go.producer.submit(GoRequest("bad", deadline_in(300)))
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        result = (await go.reader.receive_all(1))["bad"]
    assert result["status_code"] == 400
    assert json.loads(result["payload"])["error"]  # the gateway's body, as text
    assert result["request_token"] == submitted.token


@upstream("§1.1")
async def test_unusable_members_leave_the_queue(
    redis_url: str, r: Redis, go: GoSide, local_simulator: LocalSimulator
) -> None:
    """Upstream drops a member that is not JSON, has no ``data`` or a deadline <= 0,
    with no result. Ours (on purpose): nothing is dropped silently: one without a usable
    id goes to ``<queue>:dead-letter`` (no result: there is no id to answer), one with an
    id is answered ``INVALID_REQUEST``. Either way it leaves the queue, and no reader
    sees a result it cannot parse."""
    zero = go_envelope(GoRouting(request_token=new_token()), GoRequest("zero", 0))
    no_data = b'{"internal":{},"request_kind":"redis"}'
    await r.zadd(go.queue, {zero: 0, b"not json": 1, no_data: 2})
    async with running(sortedset_config(redis_url, local_simulator.url, go.queue)):
        result = (await go.reader.receive_all(1))["zero"]
        parked = await wait_until(_parked_twice(r, f"{go.queue}:dead-letter"))
    assert result["error_code"] == "INVALID_REQUEST"
    assert {json.loads(e)["raw"] for e in parked} == {"not json", no_data.decode()}
    assert await r.zcard(go.queue) == 0
    assert bodies(local_simulator) == []


def _parked_twice(r: Redis, key: str):  # type: ignore[no-untyped-def]
    async def check() -> list[bytes] | None:
        entries = await r.lrange(key, 0, -1)
        return entries if len(entries) == 2 else None

    return check


@upstream("§4")
async def test_our_producer_refuses_a_payload_upstreams_refuses(
    redis_url: str, unique: str
) -> None:
    """A payload that is not a JSON object or ``null`` is refused before anything is
    written, as upstream's producer refuses it."""
    async with SortedSetClient(redis_url, unique, f"{unique}:results") as ours:
        for payload in ([1], "text", 5):
            with pytest.raises(ValueError, match="payload must be a JSON object"):
                await ours.submit({"id": "x", "deadline": deadline_in(300), "payload": payload})
        assert await ours.request_depth() == 0
