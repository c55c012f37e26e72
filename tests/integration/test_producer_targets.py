"""submit / cancel / results with the daemon's config file: its queue, or an error.

With ``--transport-config-file`` the commands wrote to the default ``request-sortedset``
(which nobody served) whatever the file's queues; a queue the config does not serve is
now refused unless ``--force``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from async_processor.cli.main import main
from async_processor.messages import Result, decode_envelope

GATEWAY = "http://gateway:8000"


def _config(tmp_path: Path, redis_url: str, **fields: Any) -> str:
    path = tmp_path / "transport.json"
    path.write_text(json.dumps({"url": redis_url, **fields}))
    return str(path)


def _queue(name: str, **extra: str) -> dict[str, str]:
    return {"queue_name": name, "igw_base_url": GATEWAY, **extra}


def _jsonl(tmp_path: Path, *ids: str) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "payload": {}}) + "\n" for i in ids))
    return str(src)


def test_submit_and_cancel_use_the_config_files_one_queue(
    tmp_path: Path, redis_url: str, unique: str
) -> None:
    queue, results = f"{unique}:q", f"{unique}:results"
    config = _config(tmp_path, redis_url, queues=[_queue(queue, result_queue_name=results)])
    assert main(["submit", _jsonl(tmp_path, f"{unique}-a"), "--transport-config-file", config]) == 0
    r = redis.Redis.from_url(redis_url)
    assert r.zcard("request-sortedset") == 0
    [member] = r.zrange(queue, 0, -1)
    envelope = decode_envelope(member)
    assert envelope.routing.result_queue_name == results
    assert main(["cancel", f"{unique}-a", "--transport-config-file", config]) == 0
    assert r.get(f"request-cancel:{unique}-a") == envelope.routing.request_token.encode()


def test_results_read_the_config_files_result_list(
    tmp_path: Path, redis_url: str, unique: str
) -> None:
    results = f"{unique}:results"
    config = _config(tmp_path, redis_url, result_queue_name=results, queues=[_queue("q")])
    redis.Redis.from_url(redis_url).lpush(results, Result.http("r1", 200, b"ok").encode())
    out = tmp_path / "out.jsonl"
    args = ["--transport-config-file", config, "-o", str(out), "--timeout", "100ms"]
    assert main(["results", *args]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["r1"]


def test_several_queues_need_queue_named_in_the_error(
    tmp_path: Path, redis_url: str, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, redis_url, queues=[_queue(f"{unique}:a"), _queue(f"{unique}:b")])
    for command in (["submit", _jsonl(tmp_path, "x")], ["cancel", "x"]):
        assert main([*command, "--transport-config-file", config]) == 1
        err = capsys.readouterr().err
        assert f"serves several queues ({unique}:a, {unique}:b): pass --queue NAME" in err
    assert main(["submit", _jsonl(tmp_path, "x"), "--transport-config-file", config,
                 "--queue", f"{unique}:b"]) == 0  # fmt: skip
    assert redis.Redis.from_url(redis_url).zcard(f"{unique}:b") == 1


def test_a_queue_the_config_does_not_serve_is_refused_unless_forced(
    tmp_path: Path, redis_url: str, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, redis_url, queues=[_queue(f"{unique}:served")])
    stray = f"{unique}:stray"
    for command in (["submit", _jsonl(tmp_path, "x")], ["cancel", "x"]):
        assert main([*command, "--transport-config-file", config, "--queue", stray]) == 1
        err = capsys.readouterr().err
        assert f"queue '{stray}' is not served by --transport-config-file {config}" in err
        assert f"it serves {unique}:served" in err and "--force" in err
    r = redis.Redis.from_url(redis_url)
    assert r.zcard(stray) == 0
    argv = ["submit", _jsonl(tmp_path, "x"), "--transport-config-file", config, "--queue", stray]
    assert main([*argv, "--force"]) == 0
    assert r.zcard(stray) == 1


def test_discovered_queues_are_served_by_set_membership_or_prefix(
    tmp_path: Path, redis_url: str, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    r = redis.Redis.from_url(redis_url)
    tenants = f"{unique}:tenants"
    r.sadd(tenants, f"{unique}:t1")
    template = {"igw_base_url": GATEWAY, "result_queue_name": "{<queue>}:results"}
    by_set = _config(tmp_path, redis_url, queue_discovery={"set_key": tenants,
                                                           "template": template})  # fmt: skip
    src = _jsonl(tmp_path, "x")
    assert main(["submit", src, "--transport-config-file", by_set]) == 1
    assert f"those listed in the Redis set '{tenants}'): pass --queue" in capsys.readouterr().err
    assert main(["submit", src, "--transport-config-file", by_set, "--queue", f"{unique}:t1"]) == 0
    [member] = r.zrange(f"{unique}:t1", 0, -1)
    assert decode_envelope(member).routing.result_queue_name == f"{{{unique}:t1}}:results"
    assert main(["submit", src, "--transport-config-file", by_set, "--queue", f"{unique}:t2"]) == 1
    assert "is not served" in capsys.readouterr().err
    by_prefix = _config(tmp_path, redis_url, queue_discovery={"key_prefix": f"{unique}:p-",
                                                              "template": template})  # fmt: skip
    argv = ["submit", src, "--transport-config-file", by_prefix, "--queue"]
    assert main([*argv, f"{unique}:p-1"]) == 0
    assert main([*argv, f"{unique}:x-1"]) == 1


def test_a_pod_of_another_transport_is_told_so(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    config = _config(tmp_path, redis_url, queues=[_queue("q")])
    monkeypatch.setenv("ASYNC_PROCESSOR_TRANSPORT", "redis-pubsub")
    assert main(["submit", _jsonl(tmp_path, "x"), "--transport-config-file", config]) == 1
    err = capsys.readouterr().err
    assert "the daemon's transport is redis-pubsub: submit, results and cancel work on" in err
