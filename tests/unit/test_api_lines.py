"""Batch lines as untrusted input (api/lines.py, api/auth.py, api/caps.py): every bad
line named by its number, bodies kept byte for byte, results turned into file lines and
usage that a hostile gateway cannot inflate, keys and caps files checked."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from async_processor.api.auth import load_keys
from async_processor.api.caps import Caps, load_caps
from async_processor.api.lines import bodies, check_lines, result_line, split_lines
from async_processor.errors import ConfigError
from async_processor.messages import ErrorCode, Result

pytestmark = pytest.mark.anyio
ENDPOINT = "/v1/chat/completions"


async def chunks(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):  # lines split across chunks on purpose
        yield data[start : start + size]


def good(custom_id: str, body: str = '{"model": "m", "n": 1}') -> bytes:
    return (
        f'{{"custom_id": "{custom_id}", "method": "POST", "url": "{ENDPOINT}", "body": {body}}}'
    ).encode()


async def test_lines_split_across_chunks_keep_their_numbers() -> None:
    data = b"a\n\n  \nb\r\nc"
    assert [(n, x) async for n, x in split_lines(chunks(data, 2))] == [
        (1, b"a"),
        (4, b"b\r"),
        (5, b"c"),
    ]


async def test_every_bad_line_is_reported_with_its_number() -> None:
    lines = [
        good("a"),
        b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": [1]}',
        good("c", '{"model": ""}'),
        good("d", '{"model": "m", "stream": true}'),
        b'{"custom_id": 7, "method": "POST", "url": "/v1/chat/completions", "body": {}}',
        "\u00ff".encode("latin-1"),  # not UTF-8
        b"[" * 100_000,  # nested too deep for any parser
        good("a"),
    ]
    checked = await check_lines(chunks(b"\n".join(lines), 64), ENDPOINT)
    assert [(b.line, b.code) for b in checked.bad] == [
        (2, "invalid_body"),
        (3, "missing_model"),
        (4, "stream_unsupported"),
        (5, "missing_custom_id"),
        (6, "invalid_json_line"),
        (7, "invalid_json_line"),
        (8, "duplicate_custom_id"),
    ]


async def test_an_empty_file_is_a_bad_file() -> None:
    checked = await check_lines(chunks(b"\n \n"), ENDPOINT)
    assert [b.code for b in checked.bad] == ["empty_file"]


async def test_bodies_are_the_exact_bytes_from_any_line_on() -> None:
    body = '{"model": "m", "big": 123456789012345678901234567890, "s": "\\ud83d\\ude00"}'
    data = b"\n".join([good("a"), good("b", body), good("c")])
    assert [x async for x in bodies(chunks(data), 1)][:1] == [(1, body.encode())]


def test_a_result_becomes_one_line_and_usage_cannot_be_inflated() -> None:
    usage = {"prompt_tokens": 2**60, "completion_tokens": -5, "total_tokens": "9"}
    ok = result_line(Result.http("b:0", 200, json.dumps({"usage": usage}).encode()), 0, "x")
    assert ok.ok and ok.usage == (0, 0, 0, 0, 0)
    failed = result_line(Result.failure("b:1", ErrorCode.DEADLINE_EXCEEDED, "late"), 1, "y")
    line = json.loads(failed.text)
    assert not failed.ok and line["response"] is None
    assert line["error"] == {"code": "DEADLINE_EXCEEDED", "message": "late"}
    not_json = json.loads(result_line(Result.http("b:2", 502, b"<html>"), 2, "z").text)
    assert not_json["response"]["body"] == "<html>"


def test_keys_file_maps_keys_and_digests_to_tenants(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"second").hexdigest()
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"acme": ["first", f"sha256:{digest}"]}))
    assert load_keys(path) == {hashlib.sha256(b"first").hexdigest(): "acme", digest: "acme"}
    for bad in ({"a b": ["k"]}, {"acme": "k"}, {"acme": [""]}, {}, {"a": ["k"], "b": ["k"]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            load_keys(path)


def test_caps_file_overrides_only_the_caps_it_names(tmp_path: Path) -> None:
    default = Caps(open_batches=3, queued_lines=100, stored_bytes=1000)
    assert load_caps("", default).of("anyone") == default
    path = tmp_path / "caps.json"
    path.write_text(json.dumps({"acme": {"open_batches": 1}, "globex": {"stored_bytes": 0}}))
    book = load_caps(str(path), default)
    assert book.of("acme") == Caps(1, 100, 1000)
    assert book.of("globex") == Caps(3, 100, 0)
    assert book.of("initech") == default
    for bad in ([], {"a": 1}, {"a": {"open": 1}}, {"a": {"open_batches": -1}},
                {"a": {"queued_lines": True}}, {"a": {"stored_bytes": "1"}}):  # fmt: skip
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            load_caps(str(path), default)
