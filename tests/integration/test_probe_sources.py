"""``check-config --probe`` looks at each gate's own source, not only the broker's.

It never tried a ``redis`` / ``redis-quota`` / ``redis-leased-rate`` gate's Redis (often
another server than the broker's), so a gate that would close every message passed the
check; and a gcp-pubsub backlog that Cloud Monitoring refuses to give was only a warning in
the daemon's log. Real redis-servers here; Cloud Monitoring is a local HTTP server speaking
its REST API (none is reachable from a test), and an unreachable port.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from aiohttp import web

from async_processor.cli.main import main
from async_processor.config import GcpPubSubConfig
from async_processor.gates.leased_rate import API_VERSION
from async_processor.ops.targets import backlog_checks
from async_processor.transports.gcp_pubsub.backlog import BacklogReader
from tests.fixtures.monitoring import StaticToken, monitoring_api
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess

REPRS = ("Error(", "ConnectionKey", "Exception", "errno")


def gate(gate_type: str, **params: object) -> dict[str, object]:
    return {"gate_type": gate_type, "gate_params": params}


def probe_lines(out: str) -> list[str]:
    return out[out.index("probe: ") :].splitlines()


def test_each_redis_gate_source_is_reached_and_said_plainly(
    tmp_path: Path,
    redis_url: str,
    unique: str,
    simulator: SimulatorProcess,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(f"{unique}:budget", "0.4")
    client.hset(f"{unique}:ctl", mapping={
        "api_version": API_VERSION, "pool_id": "default", "decision_id": "d1",
        "max_admission_rps": "50", "valid_until_unix_ms": str(int(time.time() * 1000) + 60_000),
    })  # fmt: skip
    down = free_port()
    budget = {"igw_base_url": simulator.url, "gate_type": "redis"}
    queues = [
        {"queue_name": f"{unique}-a", **budget,
         "gate_params": {"address": redis_url, "budget_key": f"{unique}:budget"}},
        {"queue_name": f"{unique}-b", **budget,
         "gate_params": {"address": redis_url, "budget_key": f"{unique}:unset"}},
    ]  # fmt: skip
    pool_gate = gate("composite", gates=[
        gate("redis-quota", address=f"redis://:s3cret@127.0.0.1:{down}/0", limit=5),
        gate("redis-leased-rate", address=redis_url, control_key=f"{unique}:ctl"),
        gate("redis-leased-rate", address=redis_url, control_key=f"{unique}:none"),
    ])  # fmt: skip
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps([{"id": "default", "workers": 2, **pool_gate}]))
    argv = ["check-config", "--transport", "redis-sortedset", "--transport-config",
            json.dumps({"url": redis_url, "queues": queues}), "--pool-config-file", str(pools),
            "--probe"]  # fmt: skip
    assert main(argv, {}) == 1  # the quota gate's Redis is down
    lines = probe_lines(capsys.readouterr().out)
    # The lease's time left is read at the probe: under load a second or more has passed.
    lines = [re.sub(r"for \d+s more", "for <n>s more", line) for line in lines]
    at = f"redis at {redis_url.split('//')[1].rsplit('/', 1)[0]}"
    assert lines[2:] == [  # after the broker and the gateway
        f"probe: queue '{unique}-a' redis: {at}: ok (key '{unique}:budget' = 0.4: budget 0.4)",
        f"probe: queue '{unique}-b' redis: {at}: ok (key '{unique}:unset' not set: budget 1"
        " (open))",
        f"probe: pool 'default' > composite[0] redis-quota: redis at 127.0.0.1:{down}: FAILED: "
        f"cannot connect to 127.0.0.1:{down}: connection refused",
        f"probe: pool 'default' > composite[1] redis-leased-rate: {at}: ok (lease in "
        f"'{unique}:ctl': 50 req/s for <n>s more)",
        f"probe: pool 'default' > composite[2] redis-leased-rate: {at}: ok (no valid lease for "
        f"pool 'default' in '{unique}:none': it admits nothing)",
        "probe: no metric gates (prometheus-* / endpoint-scrape) in this config",
    ]
    text = "\n".join(lines)
    assert "s3cret" not in text
    assert not any(marker in text for marker in REPRS), text


@pytest.fixture
async def monitoring() -> AsyncIterator[str]:
    """Cloud Monitoring: a backlog of 7 for 'busy', no point for 'idle', and Google's 403
    body for 'denied'."""

    async def series(request: web.Request) -> web.Response:
        flt = request.query["filter"]
        if '"denied"' in flt:
            error = {"code": 403, "status": "PERMISSION_DENIED",
                     "message": "Permission monitoring.timeSeries.list denied"}  # fmt: skip
            return web.json_response({"error": error}, status=403)
        if '"idle"' in flt:
            return web.json_response({})
        point = {"interval": {"endTime": "2026-01-01T00:00:00Z"}, "value": {"int64Value": "7"}}
        return web.json_response({"timeSeries": [{"points": [point]}]})

    async with monitoring_api(series) as url:
        yield url


def pubsub_config(*subscriptions: str) -> GcpPubSubConfig:
    topics = [{"subscriber_id": s, "igw_base_url": "http://gw"} for s in subscriptions]
    return GcpPubSubConfig.model_validate(
        {"project_id": "p1", "result_topic_id": "results", "topics": topics}
    )


@pytest.mark.anyio
async def test_the_cloud_monitoring_backlog_is_read_or_its_refusal_said(
    monitoring: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    reader = BacklogReader("p1", base_url=monitoring, credentials=StaticToken())
    checks = await backlog_checks(pubsub_config("busy", "idle", "denied"), 15.0, reader)
    target = "probe: backlog from Cloud Monitoring of projects/p1/subscriptions"
    assert [c.line() for c in checks] == [
        f"{target}/busy: ok (7 undelivered)",
        f"{target}/idle: ok (no point in the last 5 minutes: the backlog is unknown)",
        f"{target}/denied: FAILED: Cloud Monitoring answered HTTP 403: "
        "Permission monitoring.timeSeries.list denied",
    ]


@pytest.mark.anyio
async def test_an_unreachable_cloud_monitoring_fails_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    port = free_port()
    reader = BacklogReader("p1", base_url=f"http://127.0.0.1:{port}/v3", credentials=StaticToken())
    [check] = await backlog_checks(pubsub_config("busy"), 15.0, reader)
    assert check.problem == f"cannot connect to 127.0.0.1:{port}: connection refused"


@pytest.mark.anyio
async def test_the_backlog_is_skipped_where_the_daemon_does_not_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    [check] = await backlog_checks(pubsub_config("busy"), 15.0)
    assert check.line() == (
        "probe: backlog from Cloud Monitoring: skipped (the emulator has none; broker_backlog"
        " stays unknown)"
    )
    [check] = await backlog_checks(pubsub_config("busy"), 0.0)
    assert check.line().endswith("skipped (--metrics-backlog-poll-interval 0)")
