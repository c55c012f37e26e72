"""``async-processor status`` against a real redis-server, for both Redis transports.

The state is made by the transport itself (claims, a deferral, a dead letter), so the
counts are what an operator would see with the daemon running.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis.asyncio import Redis

from async_processor.cli.main import main
from async_processor.config import SortedSetConfig
from async_processor.messages import Envelope, Request, Routing
from async_processor.ops.status import redis_status
from async_processor.redis import keys as redis_keys
from async_processor.transports.base import Deferral, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.lossy_proxy import lossy_proxy
from tests.fixtures.servers import RedisServer

GW = "http://gw.test:8000"
pytestmark = pytest.mark.usefixtures("restore_logging")  # the commands configure logging


def envelope(request_id: str, deadline: float, queue: str = "") -> bytes:
    routing = Routing(request_queue_name=queue)
    request = Request(id=request_id, deadline=int(deadline), payload=b"{}")
    return Envelope(request=request, routing=routing, kind="redis").encode()


@pytest.fixture
def sortedset(tmp_path: Path, redis_url: str, unique: str) -> tuple[str, dict[str, Any]]:
    raw = {
        "url": redis_url,
        "retry_queue_name": f"{unique}-retry",
        "result_queue_name": f"{unique}-results",
        "queues": [
            {"queue_name": f"{unique}-a", "igw_base_url": GW},
            {"queue_name": f"{unique}-b", "igw_base_url": GW, "result_queue_name": f"{unique}-rb"},
        ],
    }
    path = tmp_path / "transport.json"
    path.write_text(json.dumps(raw))
    return str(path), raw


async def _claim_defer_and_dead_letter(config: SortedSetConfig) -> None:
    """Claim two of queue a: defer one by 10 min (parked), dead-letter the other."""
    transport = SortedSetTransport(config, TransportContext())
    try:
        first, second = await transport.fetch(transport.queues[0], 2, 0)
        transport.decode(first)
        await transport.defer([Deferral(first, 600)])
        await transport.dead_letter(second, "malformed", "test")
    finally:
        await transport.aclose()


def status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["status", *args])
    return code, capsys.readouterr().out


def test_status_of_a_sorted_set_counts_every_state(
    capsys: pytest.CaptureFixture[str], redis_url: str, unique: str,
    sortedset: tuple[str, dict[str, Any]],
) -> None:  # fmt: skip
    path, raw = sortedset
    r = redis.Redis.from_url(redis_url)
    now = time.time()
    # queue a: 5 waiting (deadlines now+100 .. now+500); b: 1 waiting.
    r.zadd(f"{unique}-a", {envelope(f"a{i}", now + 100 * i): now + 100 * i for i in range(1, 6)})
    r.zadd(f"{unique}-b", {envelope("b1", now + 900): now + 900})
    anyio.run(_claim_defer_and_dead_letter, SortedSetConfig.model_validate(raw))
    # A due retry for b (its origin named in the envelope), and one naming no known queue.
    r.zadd(f"{unique}-retry", {envelope("b2", now + 900, f"{unique}-b"): now - 1})
    r.zadd(f"{unique}-retry", {envelope("x", now + 900, "elsewhere"): now - 1})
    r.lpush(f"{unique}-results", "r1", "r2")
    r.lpush(f"{unique}-rb", "r3")
    # The claim stays in flight until its lease runs out: claim one more of a.
    anyio.run(_claim_one, SortedSetConfig.model_validate(raw))

    code, out = status(capsys, "--transport", "redis-sortedset", "--transport-config-file", path,
                       "--json")  # fmt: skip
    assert code == 0
    got = json.loads(out)
    # Other tests' removed queues may be listed too (one Redis): ours are configured.
    a, b = [q for q in got["queues"] if q["origin"] == "configured"]
    assert (a["queue"], a["depth"], a["in_flight"], a["dead_letters"]) == (f"{unique}-a", 2, 1, 1)
    # The deferred one is parked; the stray retry counts for the first queue, as the mover does.
    assert (a["retry_due"], a["retry_parked"]) == (1, 1)
    assert (b["depth"], b["in_flight"], b["retry_due"], b["retry_parked"]) == (1, 0, 1, 0)
    assert abs(a["oldest_deadline"] - (now + 400)) < 2  # a1..a3 were claimed; a4 is next
    assert abs(b["oldest_deadline"] - (now + 900)) < 2
    assert got["result_lists"] == {f"{unique}-results": 2, f"{unique}-rb": 1}
    assert got["retry_sets"][f"{unique}-retry"] == {"due": 2, "parked": 1}

    code, table = status(capsys, "--transport", "redis-sortedset", "--transport-config-file", path)
    assert code == 0
    row = next(line for line in table.splitlines() if line.startswith(f"{unique}-a "))
    cells = row.split()  # queue, [origin: other tests' removed queues may be listed], pool
    assert cells[cells.index("default") + 1 :][:4] == ["2", "1", "1", "1"] and "in 6m" in row
    assert f"{unique}-rb  1" in table
    assert f"retry set {unique}-retry: 2 due, 1 parked" in table


@pytest.mark.anyio
async def test_status_reads_each_result_list_once_in_one_snapshot(
    redis_server: RedisServer, unique: str, sortedset: tuple[str, dict[str, Any]]
) -> None:
    """The clock, then one pipeline with every count, the result lists' lengths and
    their retention marks (which the ages need) included."""
    _, raw = sortedset
    config = SortedSetConfig.model_validate(raw)
    transport = SortedSetTransport(config, TransportContext())
    try:
        await transport._redis.lpush(f"{unique}-results", "r1", "r2")
        await transport.retain()  # dates them
    finally:
        await transport.aclose()
    async with lossy_proxy(redis_server.port) as proxy:
        client = Redis.from_url(proxy.url)
        try:
            await client.ping()  # connected
            before = proxy.requests
            got = await redis_status("redis-sortedset", config, client, per_queue_retries=False)
            round_trips = proxy.requests - before
        finally:
            await client.aclose()
    assert round_trips == 2
    assert got.result_lists == {f"{unique}-results": 2, f"{unique}-rb": 0}
    assert got.oldest_results[f"{unique}-results"] is not None
    assert got.oldest_results[f"{unique}-rb"] is None  # empty


async def _claim_one(config: SortedSetConfig) -> None:
    transport = SortedSetTransport(config, TransportContext())
    try:
        assert len(await transport.fetch(transport.queues[0], 1, 0)) == 1
    finally:
        await transport.aclose()


def test_status_of_redis_pubsub_says_what_a_channel_cannot_tell(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, redis_url: str, unique: str
) -> None:
    raw = {"url": redis_url, "retry_queue_name": f"{unique}-retry",
           "queues": [{"queue_name": f"{unique}-ch", "igw_base_url": GW}]}  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    r = redis.Redis.from_url(redis_url)
    r.zadd(f"{unique}-retry", {envelope("p", time.time() + 900, f"{unique}-ch"): time.time() + 60})
    r.lpush(f"{unique}-ch:dead-letter", "{}")
    code, out = status(capsys, "--transport-config-file", str(path), "--json")  # default transport
    assert code == 0
    [q] = json.loads(out)["queues"]
    assert (q["depth"], q["in_flight"], q["oldest_deadline"]) == (None, None, None)
    assert (q["retry_due"], q["retry_parked"], q["dead_letters"]) == (0, 1, 1)
    assert json.loads(out)["result_lists"] == {"result-queue": 0}


def test_status_without_redis_exits_1_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    raw = {"url": "redis://127.0.0.1:9/0", "queues": [{"queue_name": "q", "igw_base_url": GW}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    assert main(["status", "--transport-config-file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("async-processor status: redis status failed") and err.count("\n") == 1


def test_status_of_gcp_pubsub_lists_each_subscription_unknown_on_the_emulator(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cloud Monitoring is not reachable from the emulator: depth is unknown, not 0."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:9")
    topics = [{"subscriber_id": "s1", "igw_base_url": GW},
              {"subscriber_id": "s2", "igw_base_url": GW, "worker_pool_id": "batch"}]  # fmt: skip
    raw = {"project_id": "p", "result_topic_id": "results", "topics": topics}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps([{"id": "default", "workers": 1}, {"id": "batch", "workers": 1}]))
    args = ["--transport", "gcp-pubsub", "--transport-config-file", str(path),
            "--pool-config-file", str(pools)]  # fmt: skip
    code, out = status(capsys, *args, "--json")
    assert code == 0
    queues = json.loads(out)["queues"]
    assert [(q["queue"], q["pool"], q["depth"]) for q in queues] == [
        ("s1", "default", None),
        ("s2", "batch", None),
    ]
    code, table = status(capsys, *args)
    assert "s2" in table and "-" in table.splitlines()[-1]


def test_status_and_dead_letter_replay_on_a_cluster_use_each_queues_slot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, redis_cluster: Any, unique: str
) -> None:
    """In cluster mode the daemon's keys carry the queue's hash tag ({q}:inflight,
    {q}:retry, ...); status and dead-letters must read those, across nodes."""
    queues = [f"{unique}-a", f"{unique}-b"]  # two names: most likely two slots
    raw = {"url": redis_cluster.url, "mode": "cluster",
           "queues": [{"queue_name": q, "igw_base_url": GW, "result_queue_name": f"{{{q}}}:out"}
                      for q in queues]}  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    r = redis.RedisCluster.from_url(redis_cluster.url)
    now = time.time()
    for i, queue in enumerate(queues):
        r.zadd(queue, {envelope(f"{queue}-{n}", now + 600): now + 600 for n in range(i + 1)})
        r.zadd(f"{{{queue}}}:claims-idx", {"claim": now + 30})
        r.zadd(f"{{{queue}}}:retry", {envelope("r", now + 600, queue): now + 60})
    entry = {"reason": "malformed", "raw": envelope("dl", now + 900).decode(), "time": now}
    r.lpush(f"{{{queues[1]}}}:dead-letter", json.dumps(entry))
    flags = ["--transport", "redis-sortedset", "--transport-config-file", str(path)]
    code = main(["status", *flags, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = {q["queue"]: q for q in json.loads(out)["queues"]}
    for i, queue in enumerate(queues):
        counts = (got[queue]["depth"], got[queue]["in_flight"], got[queue]["retry_parked"])
        assert counts == (i + 1, 1, 1)
    assert got[queues[1]]["dead_letters"] == 1
    assert json.loads(out)["retry_sets"][f"{{{queues[0]}}}:retry"] == {"due": 0, "parked": 1}
    r.lpush(f"{{{queues[0]}}}:out", "result")
    code, out = status(capsys, *flags, "--json")
    assert json.loads(out)["result_lists"][f"{{{queues[0]}}}:out"] == 1
    code = main(["dead-letters", "replay", "--all", *flags])
    assert code == 0 and r.llen(f"{{{queues[1]}}}:dead-letter") == 0
    assert r.zscore(queues[1], envelope("dl", now + 900)) == int(now + 900)
    r.close()


def test_status_and_dead_letters_see_the_daemons_discovered_and_removed_queues(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, redis_url: str, unique: str
) -> None:
    """With ``queue_discovery`` the commands read the same set as the daemon, with its
    refusal rules and cap, each queue's own retry set and result list, and the removed
    queues still draining; dead-letters lists, selects and replays their entries."""
    listed, a, b, c = f"{unique}:tenants", f"{unique}-a", f"{unique}-b", f"{unique}-c"
    raw = {
        "url": redis_url,
        "retry_queue_name": f"{unique}-retry",
        "result_queue_name": f"{unique}-results",
        "queue_discovery": {
            "set_key": listed,
            "max_queues": 2,
            "template": {
                "igw_base_url": GW,
                "result_queue_name": "<queue>:out",
            },
        },
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    flags = ["--transport", "redis-sortedset", "--transport-config-file", str(path)]
    r = redis.Redis.from_url(redis_url)
    now = time.time()
    for queue in (a, b, c):
        r.zadd(queue, {envelope(f"{queue}-{n}", now + 600 + n): now + 600 + n for n in range(3)})
    r.sadd(listed, a, b, f"{a}:inflight")  # the last one is a daemon key: refused
    anyio.run(_defer_and_dead_letter_in_discovered, SortedSetConfig.model_validate(raw), a)
    r.lpush(f"{a}:out", "result")
    r.sadd(redis_keys.REMOVED_QUEUES_KEY, c)  # removed, draining: a claim left
    r.zadd(f"{c}:claims-idx", {"claim": now + 30})
    r.zadd(f"{c}:retry", {envelope("c-r", now + 900, c): now + 60})  # its own retry set
    capsys.readouterr()  # the transport's log lines
    try:
        code = main(["status", *flags, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        got = json.loads(out)
        queues = {q["queue"]: q for q in got["queues"] if q["queue"].startswith(unique)}
        assert {n: q["origin"] for n, q in queues.items()} == {
            a: "discovered", b: "discovered", c: "removed"}  # fmt: skip
        assert (queues[a]["depth"], queues[a]["retry_parked"], queues[a]["dead_letters"]) == (
            1, 1, 1)  # fmt: skip
        assert (queues[b]["depth"], queues[c]["in_flight"], queues[c]["retry_parked"]) == (3, 1, 1)
        assert got["retry_sets"][f"{a}:retry"] == {"due": 0, "parked": 1}
        assert got["result_lists"][f"{a}:out"] == 1
        code, table = status(capsys, *flags)
        assert "ORIGIN" in table and "removed" in table
        code = main(["dead-letters", "list", *flags, "--queue", a, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        [entry] = json.loads(out)
        assert entry["queue"] == a
        assert main(["dead-letters", "replay", "--all", *flags]) == 0
        assert r.llen(f"{a}:dead-letter") == 0 and r.zcard(a) == 2
        capsys.readouterr()  # the counts replay printed
        r.sadd(listed, f"{unique}-z")  # past max_queues: the daemon leaves one (any) out
        code, out = status(capsys, *flags, "--json")
        assert len([q for q in json.loads(out)["queues"] if q["origin"] == "discovered"]) == 2
    finally:
        r.srem(redis_keys.REMOVED_QUEUES_KEY, c)
        r.close()


async def _defer_and_dead_letter_in_discovered(config: SortedSetConfig, queue: str) -> None:
    """Discover the queues, claim two of ``queue``: defer one 10 min, dead-letter the other."""
    transport = SortedSetTransport(config, TransportContext())
    try:
        spec = next(s for s in await transport.discover() if s.name == queue)
        first, second = await transport.fetch(spec, 2, 0)
        transport.decode(first)
        await transport.defer([Deferral(first, 600)])
        await transport.dead_letter(second, "malformed", "test")
    finally:
        await transport.aclose()
