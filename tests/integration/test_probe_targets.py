"""``check-config --probe`` reaches the broker and each gateway, and says a failure plainly.

It exited 0 with Redis down and never tried the gateway; a gate source that failed was
reported as a library repr (``ClientConnectorError(ConnectionKey(...))``).
"""

from __future__ import annotations

import json
import uuid

import anyio
import pytest

from async_processor.cli.main import main
from tests.fixtures.pubsub import PROJECT, PubSubEmulator, pubsub_admin
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess

REPRS = ("Error(", "ConnectionKey", "Exception", "errno")


def probe(transport: str, config: dict[str, object], *flags: str) -> int:
    argv = ["check-config", "--transport", transport, "--transport-config", json.dumps(config)]
    return main([*argv, *flags, "--probe"], {})


def probe_lines(out: str) -> list[str]:
    return out[out.index("probe: ") :].splitlines()


def test_redis_and_gateway_down_fail_the_probe_in_plain_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_port, gateway_port, prometheus_port = free_port(), free_port(), free_port()
    queue = {"queue_name": "q", "igw_base_url": f"http://127.0.0.1:{gateway_port}",
             "gate_type": "prometheus-query", "gate_params": {"query": "vector(1)"}}  # fmt: skip
    config = {"url": f"redis://:s3cret@127.0.0.1:{redis_port}/0", "queues": [queue]}
    flags = ("--prometheus-url", f"http://127.0.0.1:{prometheus_port}")
    assert probe("redis-sortedset", config, *flags) == 1
    lines = probe_lines(capsys.readouterr().out)
    assert lines[:2] == [
        f"probe: broker redis-sortedset at 127.0.0.1:{redis_port}: FAILED: "
        f"cannot connect to 127.0.0.1:{redis_port}: connection refused",
        f"probe: gateway http://127.0.0.1:{gateway_port}: FAILED: "
        f"cannot connect to 127.0.0.1:{gateway_port}: connection refused",
    ]
    assert lines[2] == (
        "probe: queue 'q' prometheus-query: FALLBACK budget 0: prometheus at "
        f"http://127.0.0.1:{prometheus_port}/api/v1/query failed: "
        f"cannot connect to 127.0.0.1:{prometheus_port}: connection refused"
    )
    text = "\n".join(lines)
    assert "s3cret" not in text
    assert not any(marker in text for marker in REPRS), text


def test_an_unknown_gateway_host_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "url": "redis://127.0.0.1:1/0",
        "queues": [{"queue_name": "q", "igw_base_url": "http://no-such-gateway.invalid"}],
    }
    assert probe("redis-sortedset", config) == 1
    gateway = probe_lines(capsys.readouterr().out)[1]
    assert gateway.startswith(
        "probe: gateway http://no-such-gateway.invalid: FAILED: "
        "cannot connect to no-such-gateway.invalid:80: "
    )


def test_reachable_broker_and_gateway_pass(
    redis_url: str, simulator: SimulatorProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    queues = [{"queue_name": "a", "igw_base_url": simulator.url},
              {"queue_name": "b", "igw_base_url": simulator.url}]  # fmt: skip
    assert probe("redis-sortedset", {"url": redis_url, "queues": queues}) == 0
    lines = probe_lines(capsys.readouterr().out)
    assert lines[0].endswith(": ok (PING answered)")
    assert lines[1].startswith(f"probe: gateway {simulator.url}: ok (HTTP ")
    assert lines[2].startswith("probe: no metric gates")  # one line per distinct gateway


def test_pubsub_names_the_missing_subscription(
    pubsub_env: PubSubEmulator, simulator: SimulatorProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"probe-{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        async with pubsub_admin() as admin:
            await admin.create_subscription(f"{name}-sub", f"{name}-topic")
            await admin.create_topic(f"{name}-results")

    anyio.run(create)
    topics = [{"subscriber_id": f"{name}-sub", "igw_base_url": simulator.url},
              {"subscriber_id": f"{name}-gone", "igw_base_url": simulator.url}]  # fmt: skip
    config = {"project_id": PROJECT, "result_topic_id": f"{name}-results", "topics": topics}
    assert probe("gcp-pubsub", config) == 1
    lines = probe_lines(capsys.readouterr().out)
    where = f"at {pubsub_env.host}"
    subscription = f"probe: broker gcp-pubsub projects/{PROJECT}/subscriptions/{name}"
    assert lines[0] == f"{subscription}-sub {where}: ok (exists)"
    assert lines[1] == f"{subscription}-gone {where}: FAILED: Subscription does not exist"
    assert lines[2].endswith("ok (exists)")
