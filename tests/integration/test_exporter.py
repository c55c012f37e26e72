"""``async-processor exporter`` against a real redis-server, over real HTTP.

What KEDA reads must follow the broker (the backlog rises and falls with the queue, the
retry set and the claims), survive a broker outage as "unknown", never as 0, and keep the
daemon's bearer token in front of /metrics and /backlog.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from async_processor.cli.main import main
from async_processor.config import AppConfig, SortedSetConfig, load_config
from async_processor.ops import exporter, status, status_table
from async_processor.ops.exporter import Exporter, serve
from async_processor.redis.keys import REMOVED_QUEUES_KEY
from async_processor.transports.base import TransportContext
from async_processor.transports.redis_sortedset.transport import SortedSetTransport
from tests.fixtures.servers import RedisServer

GW = "http://gw.test:8000"
P, OLD = "llm_d_async_async_", "llm_d_async_exporter_"
pytestmark = pytest.mark.usefixtures("restore_logging")


def config(tmp_path: Path, url: str, queue: str, *extra: str) -> AppConfig:
    raw = {"url": url, "retry_queue_name": f"{queue}-retry",
           "queues": [{"queue_name": queue, "igw_base_url": GW}]}  # fmt: skip
    path = tmp_path / "transport.json"
    path.write_text(json.dumps(raw))
    ports = ["--health-port", "0", "--metrics-port", "0", "--bind-address", "127.0.0.1"]
    argv = ["--transport", "redis-sortedset", "--transport-config-file", str(path), *ports]
    return load_config([*argv, *extra], {})


@asynccontextmanager
async def exporting(cfg: AppConfig) -> AsyncIterator[tuple[str, str]]:
    async with anyio.create_task_group() as tg:
        health, metrics = await tg.start(serve, cfg, 0.05)
        yield f"http://127.0.0.1:{health}", f"http://127.0.0.1:{metrics}"
        tg.cancel_scope.cancel()


async def get(url: str, token: str = "") -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
        return r.status, await r.text()


async def backlog_becomes(url: str, want: int) -> None:
    with anyio.fail_after(10):
        while True:
            status, body = await get(url)
            if status == 200 and json.loads(body)["backlog"] == want:
                return
            await anyio.sleep(0.05)


async def page_shows(url: str, line: str) -> str:
    """The /metrics page once it has ``line``: a page is rendered at most once a second
    (health.RENDER_EVERY), so one asked right after a change may be the last render."""
    with anyio.fail_after(10):
        while line not in (text := (await get(url))[1]).splitlines():
            await anyio.sleep(0.1)
    return text


@pytest.mark.anyio
async def test_backlog_follows_the_queue_retries_and_claims(
    tmp_path: Path, private_redis: RedisServer, unique: str
) -> None:
    """On a server of its own: every daemon serves the removed queues named in Redis."""
    redis_url = private_redis.url
    queue = f"{unique}-q"
    r = redis.Redis.from_url(redis_url)
    deadline = time.time() + 600
    r.zadd(queue, {f"m{i}": deadline for i in range(3)})
    async with exporting(config(tmp_path, redis_url, queue)) as (health, metrics):
        assert (await get(f"{health}/readyz"))[0] == 200
        await backlog_becomes(f"{metrics}/backlog", 3)
        r.zadd(f"{queue}-retry", {"later": time.time() + 60})  # a parked retry is work too
        r.zadd(f"{queue}:claims-idx", {"claim": time.time() + 30})  # so is a held claim
        await backlog_becomes(f"{metrics}/backlog", 5)
        retries = f'{P}retry_set_members{{retry_set="{queue}-retry",state="parked"}} 1.0'
        await page_shows(f"{metrics}/metrics", retries)
        r.delete(queue, f"{queue}-retry", f"{queue}:claims-idx")
        await backlog_becomes(f"{metrics}/backlog", 0)  # what lets KEDA scale to zero
        r.zadd(queue, {"m": deadline})
        r.lpush(f"{queue}:dead-letter", "x")
        await backlog_becomes(f"{metrics}/backlog", 1)
        text = await page_shows(f"{metrics}/metrics", f"{P}unanswered_requests 1.0")
        # A removed tenant draining: its claim is work, what waits on it nobody polls.
        r.zadd("gone", {"a": deadline, "b": deadline})
        r.zadd("gone:claims-idx", {"claim": time.time() + 30})
        r.sadd(REMOVED_QUEUES_KEY, "gone")
        await backlog_becomes(f"{metrics}/backlog", 2)
    samples = {(s.name, s.labels.get("queue_id"), s.labels.get("queue_name")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    # The daemon's scheme: its prefix and queue labels (the waiting count under the
    # daemon's own name for it), so one query reads daemons and exporter alike.
    assert samples[(f"{P}broker_backlog", queue, queue)] == 1
    assert samples[(f"{P}dead_letter_list_length", queue, queue)] == 1
    assert samples[(f"{P}broker_oldest_deadline_timestamp_seconds", queue, queue)] == deadline
    assert samples[(f"{P}unanswered_requests", None, None)] == 1
    assert samples[(f"{P}broker_backlog_source_available", queue, queue)] == 1
    # The first names, deprecated, for one release (no queue_id).
    assert samples[(f"{OLD}queue_depth", None, queue)] == 1
    assert samples[(f"{OLD}dead_letters", None, queue)] == 1
    assert samples[(f"{OLD}oldest_deadline_seconds", None, queue)] == deadline
    assert samples[(f"{OLD}backlog", None, None)] == 1
    assert samples[(f"{OLD}up", None, None)] == 1


@pytest.mark.anyio
async def test_an_unreachable_broker_is_unknown_not_zero(
    tmp_path: Path, private_redis: RedisServer, unique: str
) -> None:
    queue = f"{unique}-q"
    redis.Redis.from_url(private_redis.url).zadd(queue, {"m": time.time() + 600})
    async with exporting(config(tmp_path, private_redis.url, queue)) as (health, metrics):
        await backlog_becomes(f"{metrics}/backlog", 1)
        private_redis.stop()
        with anyio.fail_after(10):
            while (await get(f"{metrics}/backlog"))[0] != 503:
                await anyio.sleep(0.05)
        assert (await get(f"{health}/readyz"))[0] == 503
        labels = f'pool_name="default",queue_id="{queue}",queue_name="{queue}"'
        available = f"{P}broker_backlog_source_available{{{labels}}} 0.0"
        await page_shows(f"{metrics}/metrics", available)
        await page_shows(f"{metrics}/metrics", f"{OLD}up 0.0")


@pytest.mark.anyio
async def test_the_metrics_token_guards_backlog_too(
    tmp_path: Path, private_redis: RedisServer, unique: str
) -> None:
    redis_url = private_redis.url
    token = tmp_path / "token"
    token.write_text("s3cret")
    cfg = config(tmp_path, redis_url, f"{unique}-q", "--metrics-bearer-token-file", str(token))
    async with exporting(cfg) as (_, metrics):
        assert (await get(f"{metrics}/backlog"))[0] == 401
        assert (await get(f"{metrics}/metrics"))[0] == 401
        status, body = await get(f"{metrics}/backlog", "s3cret")
        assert (status, json.loads(body)) == (200, {"backlog": 0})


@pytest.mark.anyio
async def test_the_exporter_skips_the_result_ages_and_its_output_is_the_same(
    tmp_path: Path, private_redis: RedisServer, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No gauge shows how old results are, so the exporter does not read the retention
    counters and marks that date them; its output is what the full status would give."""
    queue = f"{unique}-q"
    cfg = config(tmp_path, private_redis.url, queue)
    assert isinstance(cfg.transport_config, SortedSetConfig)
    r = redis.Redis.from_url(private_redis.url)
    r.zadd(queue, {"m": time.time() + 600})
    r.zadd(f"{queue}-retry", {"later": time.time() + 60})
    r.lpush(cfg.transport_config.result_queue_name, "r1", "r2")
    transport = SortedSetTransport(cfg.transport_config, TransportContext())
    try:
        await transport.retain()  # the results are dated: status could tell their age
    finally:
        await transport.aclose()

    r.config_resetstat()
    lean = CollectorRegistry()
    await Exporter(cfg, lean).refresh()
    assert "cmdstat_get" not in r.info("commandstats")  # no counter read

    async def with_ages(config: AppConfig, **_: bool) -> status_table.Status:
        return await status.collect(config, per_queue_retries=False, result_ages=True)

    monkeypatch.setattr(exporter, "collect", with_ages)
    full = CollectorRegistry()
    await Exporter(cfg, full).refresh()
    assert generate_latest(lean) == generate_latest(full)
    text = generate_latest(lean).decode()
    assert f'{P}result_list_length{{result_list="result-list"}} 2.0' in text
    assert f"{P}unanswered_requests 2.0" in text


def test_interval_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"url": "redis://127.0.0.1:9/0",
                                "queues": [{"queue_name": "q", "igw_base_url": GW}]}))  # fmt: skip
    argv = ["exporter", "--transport", "redis-sortedset", "--transport-config-file", str(path)]
    assert main([*argv, "--interval", "0"]) == 2
    assert "--interval must be > 0" in capsys.readouterr().err


@pytest.mark.anyio
async def test_the_deprecated_names_can_be_turned_off(
    tmp_path: Path, private_redis: RedisServer, unique: str
) -> None:
    queue = f"{unique}-q"
    redis.Redis.from_url(private_redis.url).zadd(queue, {"m": time.time() + 600})
    cfg = config(tmp_path, private_redis.url, queue)
    kept, dropped = CollectorRegistry(), CollectorRegistry()
    await Exporter(cfg, kept).refresh()
    await Exporter(cfg, dropped, legacy_names=False).refresh()
    names = {s.name for f in text_string_to_metric_families(generate_latest(kept).decode())
             for s in f.samples}  # fmt: skip
    assert {n for n in names if n.startswith(OLD)} == set(exporter.LEGACY)
    only = generate_latest(dropped).decode()
    assert OLD not in only
    assert f"{P}broker_backlog{{" in only
    assert set(exporter.LEGACY.values()) <= names  # each old name's successor is served


def test_the_flag_and_its_variable_turn_the_deprecated_names_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    async def fake_serve(config: AppConfig, interval: float, *, legacy_names: bool) -> None:
        seen.append(legacy_names)

    monkeypatch.setattr(exporter, "serve", fake_serve)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"url": "redis://127.0.0.1:9/0",
                                "queues": [{"queue_name": "q", "igw_base_url": GW}]}))  # fmt: skip
    argv = ["exporter", "--transport", "redis-sortedset", "--transport-config-file", str(path)]
    assert main(argv) == 0
    assert main([*argv, "--no-legacy-metric-names"]) == 0
    monkeypatch.setenv("ASYNC_PROCESSOR_EXPORTER_NO_LEGACY_METRIC_NAMES", "true")
    assert main(argv) == 0
    assert seen == [True, False, False]
