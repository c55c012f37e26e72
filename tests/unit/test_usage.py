"""Token accounting: the bounded ``usage`` scan, hostile counts and the tenant cap."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry, Counter
from structlog.testing import capture_logs

from async_processor.pipeline.usage import (
    MAX_TOKENS,
    USAGE_WINDOW,
    TokenAccounting,
    Usage,
    parse_usage,
)


def answer(usage: object, text: str = "hello", pad: int = 0) -> bytes:
    body = {"id": "x", "choices": [{"text": text + " " * pad}], "usage": usage}
    return json.dumps(body).encode()


def valid(**counts: int) -> Usage:
    return Usage(counts, invalid=False)


def test_reads_the_openai_usage_object() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
    assert parse_usage(answer(usage)) == valid(prompt=12, completion=7, total=19)
    compact = b'{"usage":{"prompt_tokens":3,"completion_tokens":0}}'
    assert parse_usage(compact) == valid(prompt=3, completion=0, total=3)  # total derived


def test_embeddings_usage_counts_prompt_and_total() -> None:
    # OpenAI embeddings answers: no completion_tokens (the old code counted nothing).
    embeddings = {"object": "list", "data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}}
    assert parse_usage(json.dumps(embeddings).encode()) == valid(prompt=8, total=8)
    # Only one of prompt and completion: no total is made up.
    assert parse_usage(answer({"completion_tokens": 4})) == valid(completion=4)


def test_a_usage_key_inside_generated_text_is_not_the_field() -> None:
    forged = 'the reply says "usage": {"prompt_tokens": 999999, "completion_tokens": 999999}'
    body = answer({"prompt_tokens": 1, "completion_tokens": 2}, text=forged)
    assert parse_usage(body) == valid(prompt=1, completion=2, total=3)
    assert parse_usage(json.dumps({"choices": [{"text": forged}]}).encode()) is None


def test_missing_usage_counts_nothing() -> None:
    assert parse_usage(b'{"choices": []}') is None
    assert parse_usage(b"not json at all") is None
    assert parse_usage(answer(None)) is None  # streaming-style "usage": null


HOSTILE: list[object] = [
    int("9" * 401), 10**300, MAX_TOKENS + 1, -1, 5.0, 1e300, float("inf"), True, "5",
    None.__class__.__name__, [1], {"n": [[[1]]]},
]  # fmt: skip


@pytest.mark.parametrize("junk", HOSTILE, ids=lambda junk: type(junk).__name__)
def test_a_hostile_count_is_invalid_and_the_valid_ones_still_count(junk: object) -> None:
    usage = {"prompt_tokens": junk, "completion_tokens": 2, "total_tokens": 9}
    assert parse_usage(answer(usage)) == Usage({"completion": 2, "total": 9}, invalid=True)
    # An invalid total is not replaced by prompt + completion.
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": junk}
    assert parse_usage(answer(usage)) == Usage({"prompt": 1, "completion": 2}, invalid=True)


def test_the_bound_itself_is_a_valid_count() -> None:
    assert parse_usage(answer({"prompt_tokens": MAX_TOKENS})) == valid(prompt=MAX_TOKENS)


def test_a_malformed_usage_is_invalid() -> None:
    assert parse_usage(answer([1, 2])) == Usage({}, invalid=True)
    assert parse_usage(answer("lots")) == Usage({}, invalid=True)
    assert parse_usage(b'{"usage": {"prompt_tokens": 1, "completion_tok') == Usage({}, True)
    # Nested past the recursion limit: the old code raised RecursionError.
    assert parse_usage(b'{"usage": ' + b"[" * 4000) == Usage({}, invalid=True)


def test_a_huge_answer_is_scanned_only_at_its_end() -> None:
    big = answer({"prompt_tokens": 5, "completion_tokens": 6}, pad=32 * 1024 * 1024)
    started = time.perf_counter()
    for _ in range(10):
        assert parse_usage(big) == valid(prompt=5, completion=6, total=11)
    assert (time.perf_counter() - started) / 10 < 0.005  # a full json.loads takes ~100 ms
    # The bound: usage placed before a tail longer than the window is not looked for.
    early = b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "pad": "'
    assert parse_usage(early + b" " * USAGE_WINDOW + b'"}') is None


Q = ("qid", "q", "p")  # queue_id, queue_name, pool_name


def families() -> tuple[Counter, Counter]:
    registry = CollectorRegistry()
    labels = ("queue_id", "queue_name", "pool_name", "direction", "tenant", "kind")
    tokens = Counter("t_tokens", "", labels, registry=registry)
    invalid = Counter("t_invalid", "", ("queue_name", "pool_name"), registry=registry)
    return tokens, invalid


def counts(family: Counter) -> dict[tuple[str, str], float]:
    return {
        (s.labels["tenant"], s.labels["kind"]): s.value
        for metric in family.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def invalid_count(family: Counter) -> float:
    samples = [s for m in family.collect() for s in m.samples if s.name.endswith("_total")]
    return sum(s.value for s in samples)


def test_tenants_past_the_cap_count_as_other() -> None:
    tokens, invalid = families()
    accounting = TokenAccounting(tokens, invalid, "userid", limit=2)
    body = answer({"prompt_tokens": 10, "completion_tokens": 1})
    for user in ("a", "b", "c", "d", "a"):
        accounting.count(Q, {"userid": user}, body)
    accounting.count(Q, {}, body)
    accounting.count(Q, {"userid": "a"}, b'{"error": "no usage"}')
    assert counts(tokens) == {
        ("a", "prompt"): 20, ("a", "completion"): 2, ("a", "total"): 22,
        ("b", "prompt"): 10, ("b", "completion"): 1, ("b", "total"): 11,
        ("other", "prompt"): 20, ("other", "completion"): 2, ("other", "total"): 22,
        ("none", "prompt"): 10, ("none", "completion"): 1, ("none", "total"): 11,
    }  # fmt: skip
    assert invalid_count(invalid) == 0


def test_a_tenant_named_like_a_reserved_label_counts_as_other() -> None:
    tokens, invalid = families()
    accounting = TokenAccounting(tokens, invalid, "userid", limit=2)
    body = answer({"prompt_tokens": 10, "total_tokens": 10})
    for user in ("none", "other", "a"):  # reserved names take no place under the cap
        accounting.count(Q, {"userid": user}, body)
    accounting.count(Q, {}, body)
    assert counts(tokens) == {
        ("other", "prompt"): 20, ("other", "total"): 20,
        ("a", "prompt"): 10, ("a", "total"): 10,
        ("none", "prompt"): 10, ("none", "total"): 10,  # only the message without a tenant
    }  # fmt: skip


def test_hostile_usage_never_raises_nor_poisons_the_counters() -> None:
    tokens, invalid = families()
    accounting = TokenAccounting(tokens, invalid, "userid", limit=5)
    with capture_logs() as logs:
        for junk in HOSTILE:
            body = answer({"prompt_tokens": junk, "completion_tokens": 3})
            accounting.count(Q, {"userid": "a"}, body)  # old code: OverflowError
        accounting.count(Q, {"userid": "a"}, b'{"usage": ' + b"[" * 4000)
    assert counts(tokens) == {("a", "completion"): 3.0 * len(HOSTILE)}
    assert invalid_count(invalid) == len(HOSTILE) + 1
    # At most one warning a minute, and it carries neither the body nor the junk.
    assert logs == [{"event": "token_usage_invalid", "log_level": "warning", "queue": "q",
                     "pool": "p", "reason": "out_of_range"}]  # fmt: skip


def test_count_never_raises_into_the_result_path(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, invalid = families()
    accounting = TokenAccounting(tokens, invalid, "userid", limit=5)

    def broken(body: bytes) -> Usage:
        raise OverflowError("a bug")

    monkeypatch.setattr("async_processor.pipeline.usage.parse_usage", broken)
    accounting.count(Q, {"userid": "a"}, answer({"prompt_tokens": 1}))
    assert invalid_count(invalid) == 1


def directions(family: Counter) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["queue_id"], s.labels["direction"], s.labels["kind"]): s.value
        for metric in family.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


@pytest.mark.parametrize("total", [True, False])
def test_every_series_but_the_deprecated_total_has_upstreams_direction(total: bool) -> None:
    tokens, invalid = families()
    accounting = TokenAccounting(tokens, invalid, "userid", limit=2, total=total)
    accounting.count(Q, {"userid": "a"}, answer({"prompt_tokens": 10, "completion_tokens": 4}))
    expected = {("qid", "input", "prompt"): 10, ("qid", "output", "completion"): 4}
    if total:  # --tokens-kind-total (this release's default): no direction, so that
        expected[("qid", "", "total")] = 14  # sum by (direction) keeps input/output apart
    assert directions(tokens) == expected
