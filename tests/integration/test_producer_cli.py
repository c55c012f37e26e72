"""submit / results / cancel commands against a real redis-server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from async_processor.cli.main import main
from async_processor.client.commands import CHUNK, request_from_line
from async_processor.messages import Result, decode_envelope


def test_openai_batch_line_becomes_a_request() -> None:
    line = json.dumps(
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": []},
        }
    )
    req = request_from_line(line, deadline=123)
    assert abs(req.created - time.time()) < 30  # for the submit-to-result histogram
    assert (req.id, req.deadline, req.endpoint) == ("c1", 123, "/v1/chat/completions")
    assert bytes(req.payload) == b'{"model": "m", "messages": []}'
    assert req.extra == {}


@pytest.mark.parametrize("shape", ["ours", "openai-batch"])
def test_submit_keeps_the_payload_text_as_written(
    tmp_path: Path, redis_url: str, unique: str, shape: str
) -> None:
    # Parsed and written again, 1.10 became 1.1, 1e2 became 100.0, an escape its character
    # and the spacing changed: the gateway got other bytes than the file held.
    payload = '{"temperature": 1.10, "max_tokens":1e2 , "prompt": "caf\\u00e9 \\ud83d\\ude00"}'
    if shape == "ours":
        line = f'{{"id": "{unique}", "payload": {payload}, "body": {{"kept": 1.50}}}}'
    else:
        line = f'{{"custom_id": "{unique}", "url": "/v1/completions", "body": {payload}}}'
    src = tmp_path / "in.jsonl"
    src.write_text(line + "\n")
    queue = f"{unique}:q"
    assert main(["submit", str(src), "--redis-url", redis_url, "--queue", queue]) == 0
    [member] = redis.Redis.from_url(redis_url).zrange(queue, 0, -1)
    request = decode_envelope(member).request
    assert bytes(request.payload) == payload.encode()
    if shape == "ours":  # another field is kept too (its value, not its text)
        assert request.extra["body"] == {"kept": 1.5}


def test_submit_jsonl_then_cancel(tmp_path: Path, redis_url: str, unique: str) -> None:
    lines = [
        json.dumps({"id": "a", "payload": {"n": 12345678901234567890}}),
        json.dumps(
            {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
        ),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    queue = f"{unique}:q"
    code = main(
        ["submit", str(src), "--redis-url", redis_url, "--queue", queue, "--deadline-in", "10m"]
    )
    assert code == 0
    r = redis.Redis.from_url(redis_url)
    members = r.zrange(queue, 0, -1, withscores=True)
    envelopes = {decode_envelope(m).id: (decode_envelope(m), score) for m, score in members}
    assert set(envelopes) == {"a", "b"}
    env_a, score_a = envelopes["a"]
    assert env_a.request.payload == b'{"n": 12345678901234567890}'
    assert abs(score_a - (time.time() + 600)) < 30
    assert envelopes["b"][0].request.endpoint == "/v1/completions"
    assert main(["cancel", "a", "--redis-url", redis_url]) == 0  # another queue's "a"
    assert r.get("request-cancel:a") is None
    assert main(["cancel", "a", "--redis-url", redis_url, "--queue", queue]) == 0
    assert r.get("request-cancel:a") == env_a.routing.request_token.encode()


def test_submit_with_payload_keys_stores_each_payload_apart(
    tmp_path: Path, redis_url: str, unique: str
) -> None:
    """Upstream's WithPayloadKeys() shape: payload_ref, no data.payload, the body in its key."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": f"{unique}-k", "payload": {"n": 12345678901234567890}}) + "\n")
    queue = f"{unique}:q"
    assert (
        main(["submit", str(src), "--redis-url", redis_url, "--queue", queue, "--payload-keys"])
        == 0
    )
    r = redis.Redis.from_url(redis_url)
    [member] = r.zrange(queue, 0, -1)
    envelope = decode_envelope(member)
    key = f"request-payload:{unique}-k:{envelope.routing.request_token}"
    assert envelope.routing.payload_ref == key
    assert b'"payload":' not in member
    assert r.get(key) == b'{"n": 12345678901234567890}'


def test_submit_names_a_bad_line_and_submits_nothing(
    tmp_path: Path, redis_url: str, unique: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A line nested too deep raised RecursionError out of the command (a traceback); any
    # bad line stopped the run after the chunks before it were queued, naming no line.
    src = tmp_path / "in.jsonl"
    good = json.dumps({"id": "a", "payload": {}})
    src.write_text(f"{good}\n\n" + '{"id": "b", "payload": ' + "[" * 100_000 + "\n")
    queue = f"{unique}:q"
    assert main(["submit", str(src), "--redis-url", redis_url, "--queue", queue]) == 1
    assert f"{src}:3: " in capsys.readouterr().err
    assert redis.Redis.from_url(redis_url).zcard(queue) == 0


@pytest.mark.parametrize(
    "bad",
    [{"payload": {}}, {"id": "x", "deadline": "soon"}, {"id": "x", "metadata": {"k": 1}}],
    ids=["missing-id", "bad-deadline", "wrong-type"],
)
def test_submit_names_an_invalid_request_line_and_submits_nothing(
    tmp_path: Path,
    redis_url: str,
    unique: str,
    capsys: pytest.CaptureFixture[str],
    bad: dict[str, object],
) -> None:
    # Valid JSON but an invalid request: the client refused it only when its chunk came
    # up, after the chunks before it were queued, and the message named no line.
    src = tmp_path / "in.jsonl"
    good = [json.dumps({"id": f"g{i}", "payload": {}}) for i in range(CHUNK + 1)]
    src.write_text("\n".join([*good, json.dumps(bad)]) + "\n")
    queue = f"{unique}:q"
    assert main(["submit", str(src), "--redis-url", redis_url, "--queue", queue]) == 1
    assert f"{src}:{CHUNK + 2}: invalid request" in capsys.readouterr().err
    assert redis.Redis.from_url(redis_url).zcard(queue) == 0


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity"])
def test_submit_refuses_a_number_json_cannot_hold(
    tmp_path: Path,
    redis_url: str,
    unique: str,
    capsys: pytest.CaptureFixture[str],
    number: str,
) -> None:
    # Python's json reads 1e999 as inf (and the NaN/Infinity literals) and wrote it back
    # as a bare Infinity token: the queued payload was not JSON any more.
    src = tmp_path / "in.jsonl"
    good = json.dumps({"id": "a", "payload": {"x": 1.5e308}})
    src.write_text(f'{good}\n{{"id": "b", "payload": {{"x": {number}}}}}\n')
    queue = f"{unique}:q"
    assert main(["submit", str(src), "--redis-url", redis_url, "--queue", queue]) == 1
    assert f"{src}:2: invalid request: a number out of JSON's range" in capsys.readouterr().err
    assert redis.Redis.from_url(redis_url).zcard(queue) == 0


def test_results_drains_to_jsonl(tmp_path: Path, redis_url: str, unique: str) -> None:
    r = redis.Redis.from_url(redis_url)
    results = f"{unique}:results"
    for i in range(3):
        r.lpush(results, Result.http(f"id{i}", 200, b"ok").encode())
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "results",
            "--redis-url",
            redis_url,
            "--result-queue",
            results,
            "--output",
            str(out),
            "--timeout",
            "200ms",
        ]
    )
    assert code == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["id0", "id1", "id2"]
    assert r.llen(results) == 0


def test_submit_reads_async_processor_env_like_run(
    tmp_path: Path, redis_url: str, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ASYNC_PROCESSOR_<FLAG> sets a producer flag (plain seconds work too); flags win."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "e1", "payload": {}}) + "\n")
    monkeypatch.setenv("ASYNC_PROCESSOR_REDIS_URL", redis_url)
    monkeypatch.setenv("ASYNC_PROCESSOR_QUEUE", f"{unique}:env-q")
    monkeypatch.setenv("ASYNC_PROCESSOR_DEADLINE_IN", "120")
    assert main(["submit", str(src)]) == 0
    r = redis.Redis.from_url(redis_url)
    [(_, score)] = r.zrange(f"{unique}:env-q", 0, -1, withscores=True)
    assert abs(score - (time.time() + 120)) < 30
    assert main(["submit", str(src), "--queue", f"{unique}:flag-q"]) == 0
    assert r.zcard(f"{unique}:flag-q") == 1
