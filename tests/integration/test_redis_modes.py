"""Redis modes against real servers: TLS (fixture-made certificates), ACL users (the exact
lines from docs/security.md), and Sentinel (primary + replica + 3 sentinels).

Each test would fail if its feature broke: the TLS server refuses plain or unverified
clients, the ACL users can run nothing beyond their lines, and the sentinel tests kill
the primary and expect the daemon to carry on against the promoted replica.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError
from structlog.testing import capture_logs

from async_processor.cli.main import main as cli_main
from async_processor.client.commands import main as producer_main
from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import SortedSetConfig
from async_processor.config.queues import QueueSpec
from async_processor.config.redis import RedisConnection
from async_processor.gates.base import (
    CONTINUE,
    REFUSE,
    GateContext,
    GateOwner,
    Releases,
    build_gate,
)
from async_processor.messages import Envelope, Request, Result
from async_processor.metrics import Metrics
from async_processor.pipeline.processor import Processor
from async_processor.redis import keyspace as redis_keyspace
from async_processor.redis.conn import connect
from async_processor.redis.keyspace import KeySpace
from async_processor.transports.base import Completion, Delivery, TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.inprocess import numbered_requests, running, sortedset_config
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.redis_modes import (
    MASTER_NAME,
    Certs,
    SentinelGroup,
    TlsRedis,
    acl_lines,
    set_acl_user,
)
from tests.fixtures.servers import RedisServer
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio
SECURITY_DOC = Path(__file__).parents[2] / "docs" / "security.md"


async def _round_trip(conn: RedisConnection, queue: str, prefix: str, n: int) -> set[str]:
    """Submit ``n`` requests through ``conn`` to a running daemon; the ids answered."""
    async with SortedSetClient(conn, queue, f"{queue}:results") as client:
        await client.submit_many(numbered_requests(prefix, n))
        results = await client.drain_results(n, 30)
    assert all(not r.error_code for r in results), results[:3]
    return {r.id for r in results}


# ------------------------------------------------------------------------------ TLS


def _tls(server: TlsRedis, certs: Certs, **fields: Any) -> dict[str, Any]:
    base = {"tls_ca_cert": str(certs.ca), "tls_cert": str(certs.client_cert)}
    return {"url": server.url, **base, "tls_key": str(certs.client_key), **fields}


async def test_daemon_and_client_over_tls(
    tls_redis: TlsRedis, certs: Certs, simulator: SimulatorProcess, unique: str
) -> None:
    fields = _tls(tls_redis, certs)
    config = sortedset_config(tls_redis.url, simulator.url, unique, transport_extra=fields)
    conn = config.transport_config.redis_connection()  # type: ignore[union-attr]
    async with running(config):
        answered = await _round_trip(conn, unique, "tls", 20)
    assert answered == {f"tls-{i}" for i in range(20)}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tls_ca_cert": "other"}, "server certificate signed by a CA we do not trust"),
        ({"tls_cert": "", "tls_key": ""}, "no client certificate for a server requiring one"),
        ({"url": "plain"}, "plain TCP to a TLS port"),
    ],
)
async def test_tls_refuses_what_it_should(
    tls_redis: TlsRedis, certs: Certs, change: dict[str, str], why: str
) -> None:
    fields = _tls(tls_redis, certs, **change)
    if change.get("tls_ca_cert") == "other":
        fields["tls_ca_cert"] = str(certs.other_ca)
    if change.get("url") == "plain":
        fields = {"url": f"redis://127.0.0.1:{tls_redis.port}/0"}
    client = connect(RedisConnection(**fields).check(), socket_timeout=2)
    with pytest.raises((RedisConnectionError, OSError)):
        await client.ping()
    await client.aclose()


async def test_tls_skip_verify_trusts_any_server(tls_redis: TlsRedis, certs: Certs) -> None:
    fields = _tls(tls_redis, certs, tls_ca_cert="", tls_insecure_skip_verify=True)
    client = connect(RedisConnection(**fields).check())
    assert await client.ping()
    await client.aclose()


def test_producer_commands_connect_like_the_daemon(
    tls_redis: TlsRedis, certs: Certs, tmp_path: Path, unique: str
) -> None:
    """``submit --transport-config-file`` reaches a TLS-only Redis with the daemon's fields."""
    transport = tmp_path / "transport.json"
    transport.write_text(json.dumps({**_tls(tls_redis, certs), "queues": []}))
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in numbered_requests("cli", 3)))
    args = ["submit", str(lines), "--transport-config-file", str(transport), "--queue", unique]
    assert producer_main(args) == 0
    plain = f"redis://127.0.0.1:{tls_redis.port}/0"
    assert producer_main([*args[:2], "--redis-url", plain, "--queue", unique]) == 1

    async def depth() -> int:
        conn = RedisConnection(**_tls(tls_redis, certs))
        async with SortedSetClient(conn, unique) as client:
            return await client.request_depth()

    assert anyio.run(depth) == 3


# ------------------------------------------------------------------------------ ACL


async def test_acl_users_from_the_security_doc_are_enough(
    private_redis: RedisServer, simulator: SimulatorProcess
) -> None:
    """The daemon and a producer run as the doc's users on the default key names, through
    results, retries (503s), a dead-letter, heartbeats, the reaper and the retry mover."""
    users = acl_lines(SECURITY_DOC)
    for name in ("async-processor", "async-producer"):
        set_acl_user(private_redis.url, users[name], f"pw-{name}")
    port = private_redis.port
    daemon_url = f"redis://async-processor:pw-async-processor@127.0.0.1:{port}/0"
    producer_url = f"redis://async-producer:pw-async-producer@127.0.0.1:{port}/0"
    config = _default_names_config(daemon_url, simulator.url)
    admin = aioredis.Redis.from_url(private_redis.url)
    await admin.zadd("request-sortedset", {b"not json": time.time() + 600})
    simulator.configure(error_rate=0.3, error_status=503, seed=7)
    async with running(config) as processor, SortedSetClient(producer_url) as client:
        await client.submit_many(numbered_requests("acl", 30))
        results = await client.drain_results(30, 60)
        assert await client.cancel(["acl-0"]) == 0  # finished: nothing to cancel
        await _upkeep(processor)
    assert {r.id for r in results} == {f"acl-{i}" for i in range(30)}
    assert await admin.llen("request-sortedset:dead-letter") == 1
    await _refused_elsewhere(daemon_url)
    await admin.aclose()


def _default_names_config(url: str, gateway: str) -> Any:
    names = {"result_queue_name": "result-list", "retry_queue_name": "retry-sortedset"}
    extra = {**names, "lease_seconds": 1}
    return sortedset_config(url, gateway, "request-sortedset", transport_extra=extra)


async def _upkeep(processor: Processor) -> None:
    """Each upkeep step once more, directly: a missing permission raises here."""
    transport = processor.transport
    assert isinstance(transport, SortedSetTransport)
    await transport.heartbeat()
    await transport.reap()
    await transport.move_due()
    await transport.retain()
    await transport.settle_removed()
    await transport.health()
    assert await transport.backlog(transport.queues[0]) == 0
    # The idle probe takes a failure for "look": a missing permission would only show as
    # every idle queue claimed each step, so it is asked here directly.
    assert await transport._fetcher._ready([transport.queues[0].name]) == set()


async def _refused_elsewhere(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    with pytest.raises(NoPermissionError):
        await client.set("someone-elses-key", "x")
    with pytest.raises(NoPermissionError):
        await client.flushdb()
    await client.aclose()


# ------------------------------------------------------------------------------ sentinel


def _sentinel_fields(group: SentinelGroup) -> dict[str, Any]:
    return {"mode": "sentinel", "sentinels": group.sentinels, "sentinel_master": MASTER_NAME}


async def _readyz(processor: Processor) -> int:
    """/readyz's status, asked from a thread: the server runs on this event loop."""
    return await anyio.to_thread.run_sync(_get_status, processor)


def _get_status(processor: Processor) -> int:
    try:
        url = f"http://127.0.0.1:{processor.health_port}/readyz"
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_sentinel_daemon_follows_a_failover(
    sentinel_group: SentinelGroup, simulator: SimulatorProcess, unique: str
) -> None:
    fields = _sentinel_fields(sentinel_group)
    url = "redis://127.0.0.1:1/0"  # the host is ignored: the sentinels name the master
    config = sortedset_config(url, simulator.url, unique, transport_extra=fields)
    conn = config.transport_config.redis_connection()  # type: ignore[union-attr]
    assert sentinel_group.replica is not None
    async with running(config) as processor:
        assert await _round_trip(conn, unique, "before", 20)
        sentinel_group.kill_primary()
        await anyio.to_thread.run_sync(sentinel_group.wait_master, sentinel_group.replica.port)
        answered = await _round_trip(conn, unique, "after", 20)
        assert await _readyz(processor) == 200
    assert answered == {f"after-{i}" for i in range(20)}


async def test_upstreams_sentinel_names_reach_the_master(
    sentinel_group: SentinelGroup, simulator: SimulatorProcess, unique: str
) -> None:
    """llm-d-async #491's fields: ``url`` names the first sentinel, ``addrs`` the rest."""
    first, *others = sentinel_group.sentinels
    fields = {"mode": "sentinel", "addrs": others, "master_name": MASTER_NAME}
    config = sortedset_config(f"redis://{first}/0", simulator.url, unique, transport_extra=fields)
    conn = config.transport_config.redis_connection()  # type: ignore[union-attr]
    async with running(config):
        assert await _round_trip(conn, unique, "upstream", 10) == {
            f"upstream-{i}" for i in range(10)
        }


async def test_readyz_is_503_while_no_master_is_reachable(
    tmp_path: Path, simulator: SimulatorProcess, unique: str
) -> None:
    group = SentinelGroup(dir=tmp_path).start(with_replica=False)
    try:
        fields = _sentinel_fields(group)
        config = sortedset_config("redis://x:1/0", simulator.url, unique, transport_extra=fields)
        async with running(config) as processor:
            assert await _readyz(processor) == 200
            assert group.primary is not None
            group.primary.kill()  # no replica: nothing to promote
            assert await _readyz(processor) == 503
            group.primary.start()  # same port: the sentinels' master is back
            for _ in range(100):
                if await _readyz(processor) == 200:
                    break
                await anyio.sleep(0.1)
            assert await _readyz(processor) == 200
    finally:
        group.stop()


# ------------------------------------------------------------------------------ WAIT


async def test_wait_replicas_waits_for_a_replica_and_warns_without_one(
    sentinel_group: SentinelGroup, redis_url: str, simulator: SimulatorProcess, unique: str
) -> None:
    """With a replica, WAIT 1 returns 1 (no warning); with none, the results are still
    written after the timeout and the shortfall is logged."""
    wait = {"wait_replicas": 1, "wait_timeout_ms": 200}
    replicated = sortedset_config(
        "redis://x:1/0",
        simulator.url,
        unique,
        transport_extra={**_sentinel_fields(sentinel_group), **wait},
    )
    lonely = sortedset_config(redis_url, simulator.url, unique, transport_extra=wait)
    warnings = []
    for config in (replicated, lonely):
        conn = config.transport_config.redis_connection()  # type: ignore[union-attr]
        with capture_logs() as logs:
            async with running(config):
                assert len(await _round_trip(conn, unique, "w", 5)) == 5
        warnings.append([e for e in logs if e["event"] == "results_not_replicated"])
    assert warnings[0] == []
    assert warnings[1] and warnings[1][0]["replicas"] == 0


# ------------------------------------------------------------------------------ gates


async def test_quota_gates_work_on_a_cluster_and_behind_sentinels(
    redis_cluster: RedisClusterNodes, sentinel_group: SentinelGroup, unique: str
) -> None:
    """The concurrency quota (two scripts) over each mode's client: the limit holds and a
    release gives the slot back."""
    modes = [
        {"address": redis_cluster.url, "redis_mode": "cluster"},
        {"address": "redis://x:1/0", **_sentinel_fields(sentinel_group)},
    ]
    for fields in modes:
        if "mode" in fields:
            fields["redis_mode"] = fields.pop("mode")
        ctx = GateContext(owner=GateOwner("q", "q", "p"), metrics=Metrics(CollectorRegistry()))
        params = {**fields, "mode": "concurrency", "limit": 1, "prefix": f"{unique}:"}
        gate = build_gate("redis-quota", params, ctx)
        message = Envelope(Request(id="r", deadline=2_000_000_000, metadata={"userid": "u"}))
        first = Releases()
        assert await gate.apply(message, first) == CONTINUE
        assert await gate.apply(message, Releases()) == REFUSE
        await first.release_all()
        assert await gate.apply(message, Releases()) == CONTINUE
        for close in ctx.closers:
            await close()


# ------------------------------------------------------------------------------ commands


@pytest.mark.usefixtures("restore_logging")
def test_dead_letters_and_status_commands_on_a_cluster(
    redis_cluster: RedisClusterNodes, tmp_path: Path, unique: str, capsys: Any
) -> None:
    """A message the daemon dead-lettered in cluster mode (``{q}:dead-letter``) is listed
    and replayed onto its queue, where ``status`` counts it."""
    queue = f"{unique}-dl"
    raw = {"url": redis_cluster.url, "mode": "cluster", "result_queue_name": f"{{{queue}}}:r",
           "queues": [{"queue_name": queue, "igw_base_url": "http://gw"}]}  # fmt: skip
    path = tmp_path / "transport.json"
    path.write_text(json.dumps(raw))
    flags = ["--transport", "redis-sortedset", "--transport-config-file", str(path)]
    anyio.run(_dead_letter_one, SortedSetConfig.model_validate(raw))
    assert cli_main(["dead-letters", "list", *flags, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["reason"] == "testing"
    assert cli_main(["dead-letters", "replay", row["id"], *flags]) == 0
    assert capsys.readouterr().out.strip() == "replayed 1"
    assert cli_main(["status", *flags, "--json"]) == 0
    [status] = json.loads(capsys.readouterr().out)["queues"]
    assert (status["queue"], status["depth"], status["dead_letters"]) == (queue, 1, 0)


async def _dead_letter_one(config: SortedSetConfig) -> None:
    transport = SortedSetTransport(config, TransportContext())
    conn = config.redis_connection()
    try:
        async with SortedSetClient(
            conn, config.queues[0].queue_name, config.result_queue_name
        ) as c:
            await c.submit({"id": "d1", "deadline": int(time.time() + 600), "payload": {}})
        [delivery] = await transport.fetch(transport.queues[0], 1, 0)
        await transport.dead_letter(delivery, "testing", "detail")
        assert await transport.backlog(transport.queues[0]) == 0
    finally:
        await transport.aclose()


def test_cancel_command_marks_in_the_queues_slot_on_a_cluster(
    redis_cluster: RedisClusterNodes, tmp_path: Path, unique: str, capsys: Any
) -> None:
    """``cancel --queue`` with the daemon's cluster config writes ``{q}:request-cancel:<id>``."""
    queue = f"{unique}-cq"
    path = tmp_path / "transport.json"
    path.write_text(json.dumps({"url": redis_cluster.url, "mode": "cluster", "queues": []}))

    async def submit() -> str:
        conn = RedisConnection(url=redis_cluster.url, mode="cluster")
        async with SortedSetClient(conn, queue, f"{{{queue}}}:results") as client:
            return await client.submit({"id": "x", "deadline": int(time.time() + 600)})

    token = anyio.run(submit)
    args = ["cancel", "x", "--transport-config-file", str(path), "--queue", queue]
    assert producer_main(args) == 0
    assert "cancelled 1 of 1" in capsys.readouterr().out
    cluster = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        assert cluster.get(f"{{{queue}}}:request-cancel:x") == token.encode()
    finally:
        cluster.close()


async def test_cluster_pipelines_load_their_scripts_on_every_primary(
    redis_cluster: RedisClusterNodes, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scripts in a cluster pipeline go as EVALSHA, loaded on every primary first and again
    after ``RELOAD_EVERY``, so a node that lost them (here: SCRIPT FLUSH) recovers."""
    client = connect(RedisConnection(url=redis_cluster.url, mode="cluster"))
    extend = KeySpace(cluster=True).scripts(client)["extend"]
    claim_keys = [KeySpace(cluster=True).owners(unique), KeySpace(cluster=True).claims_idx(unique)]

    async def extend_in_a_pipeline() -> Any:
        async with client.pipeline(transaction=False) as pipe:
            args = [30, "0123456789abcdef", 1, "no-such-claim", 2e9]
            await extend(keys=claim_keys, args=args, client=pipe)
            return (await pipe.execute())[0]

    assert await extend_in_a_pipeline() == [[b"no-such-claim"]]  # not held: reported lost
    for port in redis_cluster.ports:
        node = aioredis.Redis(port=port)
        assert await node.script_exists(extend.sha) == [True]
        await node.script_flush()
        await node.aclose()
    with pytest.raises(NoScriptError):  # until the next reload, the callers retry
        await extend_in_a_pipeline()
    monkeypatch.setattr(redis_keyspace, "RELOAD_EVERY", 0.0)
    assert await extend_in_a_pipeline() == [[b"no-such-claim"]]
    await client.aclose()


async def test_the_docs_tenant_acl_user_serves_discovered_queues(
    private_redis: RedisServer, unique: str
) -> None:
    """The doc's discovery user runs every new path of discovered queues: the set read, a
    claim round of two queues, the idle probe, a result on a per-queue list and its
    retention (EXPIRE), upkeep, and a queue's removal (its grace bookkeeping)."""
    set_acl_user(private_redis.url, acl_lines(SECURITY_DOC)["async-processor-tenants"], "pw")
    url = f"redis://async-processor-tenants:pw@127.0.0.1:{private_redis.port}/0"
    served, removed = f"tenant-{unique}-a", f"tenant-{unique}-b"
    admin = aioredis.Redis.from_url(private_redis.url)
    await admin.sadd("tenants", served, removed)
    deadline = time.time() + 600
    envelope = {"id": "t-1", "deadline": int(deadline), "payload": {}}
    await admin.zadd(served, {json.dumps(envelope): deadline})
    config = SortedSetConfig.model_validate(
        {
            "url": url,
            "result_queue_name": "result-list",
            "retry_queue_name": "retry-sortedset",
            "result_ttl_seconds": 3600,
            "queue_discovery": {
                "set_key": "tenants",
                "template": {
                    "igw_base_url": "http://gw.test",
                    "result_queue_name": "{<queue>}:results",
                },
            },
        }
    )
    transport = SortedSetTransport(config, TransportContext())
    try:
        specs = await transport.discover()
        got: dict[str, list[Delivery]] = {}

        async def fetch(spec: QueueSpec) -> None:
            got[spec.name] = await transport.fetch(spec, 2, 0)

        async with anyio.create_task_group() as tg:  # one round: both queues' claims
            for spec in specs:
                tg.start_soon(fetch, spec)
        [delivery] = got[served]
        await transport.heartbeat()
        transport.decode(delivery)
        await transport.complete([Completion(delivery, Result.http("t-1", 200, b"{}"))])
        assert await transport._fetcher._ready([served, removed]) == set()
        await transport.retain()
        await admin.srem("tenants", removed)
        assert [q.name for q in await transport.discover()] == [served]
        await transport.reap()
        await transport.move_due()
    finally:
        await transport.aclose()
    assert await admin.llen(f"{{{served}}}:results") == 1
    assert await admin.ttl(f"{{{served}}}:results") > 3600  # retention's expiry, renewed
    assert await admin.zscore("async-processor:removed-queues:empty-since", removed)
    await admin.aclose()
