"""``async-processor dead-letters`` against a real redis-server.

Dead letters are parked by the transport itself; replay must put them back where the
daemon claims them (the queue, scored by the deadline), purge must remove exactly what was
named, and every action is logged without the payload.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from async_processor.cli.main import main
from async_processor.config import SortedSetConfig
from async_processor.messages import Envelope, Request, decode_envelope
from async_processor.transports.base import TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport

GW = "http://gw.test:8000"
pytestmark = pytest.mark.usefixtures("restore_logging")  # the commands configure logging
SECRET = "payload-must-not-be-logged"


@pytest.fixture
def setup(tmp_path: Path, redis_url: str, unique: str) -> tuple[list[str], dict[str, Any]]:
    raw = {
        "url": redis_url,
        "retry_queue_name": f"{unique}-retry",
        "queues": [{"queue_name": f"{unique}-a", "igw_base_url": GW}],
    }
    path = tmp_path / "transport.json"
    path.write_text(json.dumps(raw))
    return ["--transport", "redis-sortedset", "--transport-config-file", str(path)], raw


def message(request_id: str, deadline: float) -> bytes:
    request = Request(
        id=request_id, deadline=int(deadline), payload=json.dumps({"s": SECRET}).encode()
    )
    return Envelope(request=request, kind="redis").encode()


async def _park(config: SortedSetConfig, reasons: list[str]) -> None:
    """Claim every message of the queue and dead-letter it with the next reason."""
    transport = SortedSetTransport(config, TransportContext())
    try:
        deliveries = await transport.fetch(transport.queues[0], len(reasons), 0)
        for delivery, reason in zip(deliveries, reasons, strict=True):
            await transport.dead_letter(delivery, reason, f"detail of {reason}")
    finally:
        await transport.aclose()


def park(redis_url: str, raw: dict[str, Any], queue: str, members: list[bytes]) -> None:
    r = redis.Redis.from_url(redis_url)
    base = time.time() + 600
    r.zadd(queue, {m: base + i for i, m in enumerate(members)})
    reasons = [f"reason-{i}" for i in range(len(members))]
    anyio.run(_park, SortedSetConfig.model_validate(raw), reasons)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["dead-letters", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_show_replay_purge(
    capsys: pytest.CaptureFixture[str], redis_url: str, unique: str,
    setup: tuple[list[str], dict[str, Any]],
) -> None:  # fmt: skip
    flags, raw = setup
    queue = f"{unique}-a"
    own_deadline = time.time() + 3600
    park(redis_url, raw, queue, [message("m0", own_deadline), message("m1", own_deadline + 1),
                                 b"not json", message("m3", own_deadline + 3)])  # fmt: skip
    r = redis.Redis.from_url(redis_url)
    assert r.zcard(queue) == 0 and r.llen(f"{queue}:dead-letter") == 4

    code, out, _ = run(capsys, "list", *flags, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [row["request_id"] for row in rows] == ["m3", None, "m1", "m0"]  # newest first
    assert [row["reason"] for row in rows] == ["reason-3", "reason-2", "reason-1", "reason-0"]
    assert 0 <= rows[-1]["age_seconds"] < 60
    assert SECRET not in out  # list shows no payload
    m3, bad, m1, m0 = (row["id"] for row in rows)

    code, out, _ = run(capsys, "show", m0, *flags)
    [shown] = json.loads(out)
    assert shown["reason"] == "reason-0" and SECRET in shown["raw"]  # show is the whole entry

    # Replay m0 with its own deadline: back on the queue, scored by it, bytes unchanged.
    code, out, err = run(capsys, "replay", m0, *flags, "--log-format", "json")
    assert (code, out.strip()) == (0, "replayed 1")
    [(member, score)] = r.zrange(queue, 0, -1, withscores=True)
    assert member == message("m0", own_deadline) and score == int(own_deadline)
    [logged] = [json.loads(line) for line in err.splitlines() if "dead_letter_replay" in line]
    assert (logged["outcome"], logged["request_id"], logged["entry"]) == ("replayed", "m0", m0)
    assert SECRET not in err

    # The ids did not move when m0 left. Replay m1 with a fresh deadline: written into the
    # message as well as the score, the payload untouched.
    code, out, err = run(capsys, "replay", m1, *flags, "--deadline-in", "2h")
    assert (code, out.strip()) == (0, "replayed 1"), err
    fresh = decode_envelope(r.zrange(queue, -1, -1)[0])
    assert fresh.id == "m1" and abs(fresh.request.deadline - (time.time() + 7200)) < 30
    assert json.loads(bytes(fresh.request.payload)) == {"s": SECRET}

    # Purge m3; replaying it afterwards finds nothing.
    code, out, _ = run(capsys, "purge", m3, *flags)
    assert (code, out.strip()) == (0, "purged 1")
    assert r.llen(f"{queue}:dead-letter") == 1
    code, _, err = run(capsys, "replay", m3, *flags)
    assert err == f"async-processor dead-letters: no dead letter with id {m3}\n"  # not config
    assert code == 2
    # The undecodable one is not replayed (the daemon would park it again at once): the
    # operator is told why and it stays on the list.
    before = r.zcard(queue)
    code, out, err = run(capsys, "replay", bad, *flags)
    assert (code, out.strip()) == (1, "undecodable 1")
    assert f"{bad} on {queue} cannot be replayed: the message does not decode (" in err
    assert f"it stays on the dead-letter list ('show {bad}'" in err
    assert r.zcard(queue) == before and r.llen(f"{queue}:dead-letter") == 1
    # An entry holding only a prefix of a large message is never replayed.
    prefix = {"reason": "oversized", "raw": '{"id":"big","deadline":1', "truncated": True}
    r.lpush(f"{queue}:dead-letter", json.dumps(prefix))
    code, out, err = run(capsys, "replay", "--all", *flags)
    assert (code, out.strip()) == (1, "truncated 1, undecodable 1") and r.zcard(queue) == before
    assert "holds only the start of a message too large to keep" in err
    assert json.loads(run(capsys, "list", *flags, "--json")[1])[0]["truncated"] is True
    r.lpush(f"{queue}:dead-letter", "x", "y")
    code, out, _ = run(capsys, "purge", "--all", *flags)
    assert out.strip() == "purged 4" and r.llen(f"{queue}:dead-letter") == 0


def test_replayed_entry_cannot_be_replayed_twice(
    capsys: pytest.CaptureFixture[str], redis_url: str, unique: str,
    setup: tuple[list[str], dict[str, Any]],
) -> None:  # fmt: skip
    """Two operators replaying the same entry: the second finds it gone (atomic)."""
    from async_processor.ops.deadletters import DeadLetters

    _, raw = setup
    queue = f"{unique}-a"
    park(redis_url, raw, queue, [message("only", time.time() + 600)])
    config = SortedSetConfig.model_validate(raw)

    async def twice() -> list[int]:
        from async_processor.redis.conn import connect

        client = connect(config.redis_connection())
        try:
            lists = DeadLetters(config, client)
            [entry] = await lists.entries(queue)
            return [await lists.replay(entry, None, time.time()) for _ in range(2)]
        finally:
            await client.aclose()

    assert anyio.run(twice) == [1, 0]
    assert redis.Redis.from_url(redis_url).zcard(queue) == 1


def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], setup: tuple[list[str], dict[str, Any]]
) -> None:
    flags, _ = setup
    code, _, err = run(capsys, "replay", *flags)
    assert code == 2 and "needs entry ids or --all" in err
    code, _, err = run(capsys, "list", *flags, "--queue", "nope")
    assert code == 2 and "not a queue the daemon serves" in err


def test_redis_pubsub_replay_keeps_the_entry_when_nobody_subscribes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, redis_url: str, unique: str
) -> None:
    channel = f"{unique}-ch"
    raw = {"url": redis_url, "queues": [{"queue_name": channel, "igw_base_url": GW}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    flags = ["--transport", "redis-pubsub", "--transport-config-file", str(path)]
    r = redis.Redis.from_url(redis_url)
    parked = message("p1", time.time() + 600)
    entry = {"reason": "superseded", "detail": "", "raw": parked.decode(), "time": time.time(),
             "queue": channel}  # fmt: skip
    r.lpush(f"{channel}:dead-letter", json.dumps(entry))
    code, out, _ = run(capsys, "replay", "--all", *flags)
    assert (code, out.strip()) == (0, "no subscriber 1")  # a PUBLISH to nobody would lose it
    assert r.llen(f"{channel}:dead-letter") == 1
    subscriber = r.pubsub()
    subscriber.subscribe(channel)
    try:
        code, out, _ = run(capsys, "replay", "--all", *flags)
        assert out.strip() == "replayed 1" and r.llen(f"{channel}:dead-letter") == 0
        got = [subscriber.get_message(timeout=5) for _ in range(2)]  # subscribe ack, then it
        assert got[-1] is not None and got[-1]["data"] == parked
    finally:
        subscriber.close()
