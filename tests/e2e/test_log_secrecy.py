"""Log secrecy end to end: the daemon at debug level never prints a secret or a payload.

A password-protected redis-server, messages carrying ``Authorization: Bearer ...`` and a
distinctive payload, 500s then success (retries), a message without an id (dead-letter)
and three rejected with INVALID_REQUEST (no deadline, a header that is not a string, a
header value with CR/LF). The daemon's stdout+stderr must name the request ids (so the
grep below sees real events) and never the Redis password, the Authorization value or
the payload text. With tracing on, the same holds for the spans the daemon exports.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from async_processor.messages import Result
from tests.fixtures.daemon import DaemonFactory, sortedset_config
from tests.fixtures.otlp import OtlpCollector
from tests.fixtures.servers import free_port, require_binary, stop_process, wait_for_port
from tests.fixtures.simulator import SimulatorProcess

pytestmark = [pytest.mark.slow]

PASSWORD = f"RedisPw{uuid.uuid4().hex}"
TOKEN = f"Bearer SECRET{uuid.uuid4().hex}"
PAYLOAD_TEXT = f"PayloadMarker{uuid.uuid4().hex}"


@pytest.fixture
def auth_redis_url(tmp_path: Path) -> Iterator[str]:
    """A private redis-server that requires ``PASSWORD``; its URL carries the password."""
    binary = require_binary("redis-server")
    port = free_port()
    args = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(tmp_path), "--daemonize", "no", "--requirepass", PASSWORD,
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=proc)
        yield f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    finally:
        stop_process(proc)


def _message(queue: str, results: str, data: dict[str, Any]) -> bytes:
    routing = {"request_queue_name": queue, "result_queue_name": results}
    return json.dumps({"internal": routing, "request_kind": "redis", "data": data}).encode()


def _data(request_id: str | None, **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "deadline": int(time.time()) + 120,
        "payload": {"model": "m", "prompt": f"{PAYLOAD_TEXT} {request_id}"},
        "headers": {"Authorization": TOKEN},
        **fields,
    }
    if request_id is not None:
        data["id"] = request_id
    return data


def _wait(condition: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_debug_logs_name_requests_but_no_password_token_or_payload(
    auth_redis_url: str,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> None:
    r = redis.Redis.from_url(auth_redis_url)
    queue, results = f"{unique}:q", f"{unique}:results"
    ids = [f"{unique}-ok{i}" for i in range(8)]
    no_deadline = f"{unique}-nodeadline"
    messages = [_message(queue, results, _data(i)) for i in ids]
    messages.append(_message(queue, results, _data(None)))  # no id: dead-letter
    bad = _data(no_deadline)
    del bad["deadline"]
    messages.append(_message(queue, results, bad))  # an id: INVALID_REQUEST result
    listed = f"{unique}-listed"  # rejected at decode, with the token inside the bad value
    messages.append(_message(queue, results, _data(listed, headers={"Authorization": [TOKEN]})))
    crlf = f"{unique}-crlf"  # rejected when the worker builds the request
    messages.append(
        _message(queue, results, _data(crlf, headers={"Authorization": f"{TOKEN}\r\nX: y"}))
    )
    r.zadd(queue, {m: time.time() + 60 for m in messages})

    simulator.configure(error_rate=1.0, error_status=500)
    config = sortedset_config(auth_redis_url, simulator.url, [queue], result_list=results)
    daemon = daemon_factory.start(config, "--log-level", "debug", "--concurrency", "4")
    retries = "llm_d_async_async_request_retries_total"
    _wait(lambda: daemon.metric(retries) >= len(ids), 20, "every request retried once")
    simulator.configure(error_rate=0.0)
    _wait(lambda: r.llen(results) >= len(ids) + 3, 30, "all results")
    assert daemon.terminate() == 0

    got = {x.id: x for x in (Result.decode(raw) for raw in r.lrange(results, 0, -1))}
    assert {got[i].status_code for i in ids} == {200}
    assert {got[i].error_code for i in (no_deadline, listed, crlf)} == {"INVALID_REQUEST"}
    assert r.llen(f"{queue}:dead-letter") == 1

    logs = daemon.logs()
    for request_id in [*ids, no_deadline, listed]:
        assert request_id in logs, f"{request_id} never logged: the grep below would prove nothing"
    assert "request_retry" in logs
    assert "message_rejected" in logs
    assert PASSWORD not in logs
    assert TOKEN.split()[1] not in logs
    assert PAYLOAD_TEXT not in logs


def test_traced_daemon_exports_spans_but_no_secrets(
    auth_redis_url: str,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
    otlp_collector: OtlpCollector,
) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, spans follow each message's traceparent to the
    collector (flushed at SIGTERM) and the gateway, and carry no token, password or payload."""
    r = redis.Redis.from_url(auth_redis_url)
    queue, results = f"{unique}:q", f"{unique}:results"
    trace_ids = {f"{unique}-t{i}": uuid.uuid4().hex for i in range(4)}
    r.zadd(
        queue,
        {
            _message(
                queue, results, _data(rid, metadata={"traceparent": f"00-{tid}-{'1' * 16}-01"})
            ): time.time() + 60
            for rid, tid in trace_ids.items()
        },
    )
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_collector.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": f"svc-{unique}",
    }
    config = sortedset_config(auth_redis_url, simulator.url, [queue], result_list=results)
    daemon = daemon_factory.start(config, "--log-level", "debug", env=env)
    _wait(lambda: r.llen(results) >= len(trace_ids), 20, "all results")
    assert daemon.terminate() == 0  # the batch processor flushes on the way out

    spans = otlp_collector.spans()
    assert {resource["service.name"] for resource, _ in spans} == {f"svc-{unique}"}
    process = {
        next(a.value.string_value for a in s.attributes if a.key == "request.id"): s.trace_id.hex()
        for _, s in spans
        if s.name == "process-request"
    }
    assert process == trace_ids
    sent = {req["headers"]["traceparent"].split("-")[1] for req in simulator.requests()}
    assert sent == set(trace_ids.values())
    exported = "".join(str(s) for _, s in spans) + daemon.logs()
    for secret in (PASSWORD, TOKEN.split()[1], PAYLOAD_TEXT):
        assert secret not in exported
