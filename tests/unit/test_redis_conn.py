"""The Redis connection surface: modes, sentinels and TLS fields, checked at startup, the
same on transports (``mode``), gates (``redis_mode``) and the producer commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from redis.asyncio.connection import Connection
from redis.exceptions import DataError
from structlog.testing import capture_logs

from async_processor.config import SortedSetConfig, redis_connection_file
from async_processor.config.redis import RedisConnection
from async_processor.demo.local_servers import free_port
from async_processor.errors import ConfigError, TransportError
from async_processor.gates.leased_rate import LeasedRateParams
from async_processor.gates.redis import QuotaParams, RedisBudgetParams
from async_processor.redis import conn as conn_module
from async_processor.redis.conn import connect, redis_errors

QUEUES = [{"queue_name": "q", "igw_base_url": "http://gw"}]
SENTINEL = {"mode": "sentinel", "sentinels": ["127.0.0.1:26379"], "sentinel_master": "m"}


def _transport(**fields: Any) -> SortedSetConfig:
    return SortedSetConfig.model_validate({"url": "redis://h:6379/0", "queues": QUEUES, **fields})


def test_standalone_is_the_default_and_unchanged() -> None:
    conn = _transport().redis_connection()
    assert conn == RedisConnection(url="redis://h:6379/0")
    assert conn.tls_options() == {}


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"url": "http://h"}, "url\n.*redis://, rediss:// or unix://"),
        ({"tls_ca_cert": "/ca.pem"}, "need a rediss:// url"),
        ({"url": "rediss://h", "tls_cert": "/c.pem"}, "given together"),
        ({"mode": "sentinel"}, "needs master_name"),
        ({"mode": "sentinel", "master_name": "m", "sentinel_master": "m"}, "not both"),
        ({**SENTINEL, "addrs": ["h:1"]}, "not both"),
        ({"mode": "sentinel", "sentinel_master": "m"}, "needs sentinels"),
        ({"addrs": ["h:1"]}, "addrs needs mode cluster or sentinel"),
        ({"mode": "cluster", "addrs": ["nohost"]}, "is not host:port"),
        ({"master_name": "m"}, "master_name needs mode sentinel"),
        ({"mode": "cluster", "master_name": "m"}, "master_name needs mode sentinel"),
        ({"mode": "cluster", "url": "redis://h:1/2"}, "database 0"),
        ({"mode": "cluster", "url": "redis://h:1?db=3"}, "database 0"),
        ({**SENTINEL, "sentinels": ["nohost"]}, "is not host:port"),
        ({**SENTINEL, "url": "unix:///tmp/r.sock"}, "redis:// or rediss://"),
        ({"sentinel_master": "m"}, "need mode sentinel"),
        ({"mode": "replicas"}, "mode"),
        ({"wait_replicas": -1}, "wait_replicas"),
    ],
)
def test_bad_connections_fail_at_startup(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        _transport(**fields)


def test_tls_fields_become_redis_py_options() -> None:
    conn = _transport(
        url="rediss://h", tls_ca_cert="/ca", tls_cert="/c", tls_key="/k"
    ).redis_connection()
    assert conn.tls_options() == {
        "ssl_ca_certs": "/ca",
        "ssl_certfile": "/c",
        "ssl_keyfile": "/k",
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
    }
    skip = _transport(url="rediss://h", tls_insecure_skip_verify=True).redis_connection()
    assert skip.tls_options()["ssl_cert_reqs"] == "none"
    assert skip.tls_options()["ssl_check_hostname"] is False


@pytest.mark.anyio
async def test_sentinel_mode_asks_the_sentinels_with_the_url_credentials() -> None:
    conn = _transport(url="rediss://user:pw@ignored:1/3", **SENTINEL).redis_connection()
    client = connect(conn)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("user", "pw", 3)
    assert client.connection_pool.service_name == "m"  # type: ignore[attr-defined]
    assert "SSL" in client.connection_pool.connection_class.__name__
    await client.aclose()


@pytest.mark.anyio
async def test_upstreams_names_ask_the_urls_host_and_addrs_for_the_master() -> None:
    """llm-d-async #491: ``url`` is the first sentinel, ``addrs`` the others."""
    conn = _transport(
        url="redis://u:pw@10.0.0.1:26379/2",
        mode="sentinel",
        addrs="10.0.0.2:26379, 10.0.0.3:26380",
        master_name="m",
    ).redis_connection()
    assert conn.seeds() == ("10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26380")
    assert conn.deprecated == ()
    with capture_logs() as logs:
        client = connect(conn)
    assert client.connection_pool.service_name == "m"  # type: ignore[attr-defined]
    sentinels = client.sentinel_manager.sentinels  # type: ignore[attr-defined]
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [26379, 26379, 26380]
    assert not [e for e in logs if e["event"] == "redis_config_deprecated"]
    await client.aclose()


@pytest.mark.anyio
async def test_the_old_sentinel_fields_still_work_with_a_warning(monkeypatch) -> None:
    monkeypatch.setattr(conn_module, "_warned", set())  # warned once per process
    conn = _transport(url="redis://ignored:1/0", **SENTINEL).redis_connection()
    assert conn.seeds() == ("127.0.0.1:26379",)
    with capture_logs() as logs:
        client = connect(conn)
    assert client.connection_pool.service_name == "m"  # type: ignore[attr-defined]
    [warning] = [e for e in logs if e["event"] == "redis_config_deprecated"]
    assert warning["fields"] == ["sentinels", "sentinel_master"]
    await client.aclose()


@pytest.mark.anyio
async def test_cluster_addrs_are_more_seed_nodes() -> None:
    conn = RedisConnection(url="redis://10.0.0.1:7000", mode="cluster", addrs=("10.0.0.2:7001",))
    client = connect(conn.check())
    seeds = client.nodes_manager.startup_nodes  # type: ignore[attr-defined]
    assert set(seeds) == {"10.0.0.1:7000", "10.0.0.2:7001"}
    await client.aclose()


def test_gates_take_the_same_fields_as_redis_mode_and_helm_strings() -> None:
    """``mode`` stays the quota's own field; Helm passes lists and bools as strings."""
    params = QuotaParams.model_validate(
        {
            "address": "redis://:pw@x:1/0",
            "limit": 3,
            "mode": "concurrency",
            "redis_mode": "sentinel",
            "sentinels": "10.0.0.1:26379, 10.0.0.2:26379",
            "sentinel_master": "m",
        }
    )
    assert params.mode == "concurrency"
    conn = params.redis_connection()
    assert conn.mode == "sentinel"
    assert conn.sentinels == ("10.0.0.1:26379", "10.0.0.2:26379")
    with pytest.raises(ValidationError, match="rediss"):
        RedisBudgetParams.model_validate({"address": "h:6380", "tls_insecure_skip_verify": "true"})
    assert RedisBudgetParams.model_validate({"address": "h:6380"}).redis_connection().url == (
        "redis://h:6380"
    )


def test_producer_commands_read_the_daemons_transport_config(tmp_path: Path) -> None:
    path = tmp_path / "transport.json"
    path.write_text(json.dumps({"queues": QUEUES, "batch_size": 5, **SENTINEL}))
    conn = redis_connection_file(str(path), "redis://u:pw@h/2")
    assert conn.mode == "sentinel" and conn.url == "redis://u:pw@h/2"
    path.write_text(json.dumps({"mode": "sentinel", "queues": QUEUES}))
    with pytest.raises(ConfigError, match="needs master_name"):
        redis_connection_file(str(path), "redis://h")


def test_leased_rate_keys_must_share_a_slot_in_cluster_mode() -> None:
    base = {"address": "redis://h:1", "redis_mode": "cluster"}
    with pytest.raises(ValidationError, match="share a hash slot"):
        LeasedRateParams.model_validate({**base, "control_key": "rate", "state_key": "other"})
    ok = LeasedRateParams.model_validate({**base, "control_key": "{rate}:control"})
    assert ok.state_key == "{rate}:control:state"


@pytest.mark.anyio
async def test_a_connection_closed_under_a_write_is_a_transport_error() -> None:
    """redis-py 8.1 leaks AttributeError when the writer is gone (redis/redis-py#4287);
    the daemon treats it as the lost connection it is, and only that."""
    conn = Connection()
    with pytest.raises(TransportError, match="connection closed"), redis_errors("claim"):
        await conn._send_packed_command([b"PING\r\n"])  # its writer is None: never connected
    with pytest.raises(AttributeError), redis_errors("claim"):
        raise AttributeError("a bug of ours stays a bug")


@pytest.mark.anyio
async def test_an_unreachable_cluster_is_a_transport_error() -> None:
    """The cluster client's own exceptions are not RedisErrors; they still mean 'retry'."""
    client = connect(RedisConnection(url=f"redis://127.0.0.1:{free_port()}", mode="cluster"))
    with pytest.raises(TransportError, match="cannot be connected"), redis_errors("ping"):
        await client.ping()
    await client.aclose()


PACKED_ARGS: list[tuple[Any, ...]] = [
    ("SET", "k", "v"),
    ("SCRIPT LOAD", "return 1"),  # a multi-word command name is split, as redis-py does
    ("EVALSHA", "f" * 40, 2, "{q}:a", b"{q}:b", 3600, 0.25, 1e20, "é", memoryview(b"raw")),
    ("LPUSH", "list", b"x" * 10_000),  # over redis-py's buffer cutoff
    ("SET", "k", bytearray(b"v")),  # hiredis refuses it; redis-py packs it
]


@pytest.mark.parametrize("args", PACKED_ARGS)
def test_asyncio_connections_pack_in_c_the_same_bytes(
    args: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """hiredis packs (redis-py's asyncio connections would in Python), byte for byte alike."""
    import hiredis
    from redis.connection import PythonRespSerializer

    calls = []
    real = hiredis.pack_command

    def spy(packed: tuple[Any, ...]) -> bytes:
        calls.append(packed)
        return real(packed)

    monkeypatch.setattr(hiredis, "pack_command", spy)
    conn = Connection()
    python = PythonRespSerializer(conn._buffer_cutoff, conn.encoder.encode)
    assert b"".join(conn.pack_command(*args)) == b"".join(python.pack(*args))
    assert len(calls) == 1


def test_what_redis_py_refuses_is_still_a_data_error() -> None:
    with pytest.raises(DataError, match="'bool'"):
        Connection().pack_command("SET", "k", True)


@pytest.mark.parametrize(
    ("options", "value"),
    [({"encoding": "latin-1"}, "é"), ({"encoding_errors": "replace"}, "\udcff")],
)
def test_a_connection_of_another_encoding_packs_as_redis_py_does(
    options: dict[str, str], value: str
) -> None:
    """The patch is process-wide (an application using the client library has its own
    connections): hiredis only encodes UTF-8, strictly."""
    from redis.connection import PythonRespSerializer

    conn = Connection(**options)  # type: ignore[arg-type]
    python = PythonRespSerializer(conn._buffer_cutoff, conn.encoder.encode)
    assert b"".join(conn.pack_command("SET", "k", value)) == b"".join(
        python.pack("SET", "k", value)
    )
