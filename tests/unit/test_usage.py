"""Token accounting: the bounded ``usage`` scan and the tenant cap."""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter

from async_processor.usage import USAGE_WINDOW, TokenAccounting, parse_usage


def answer(usage: object, text: str = "hello", pad: int = 0) -> bytes:
    body = {"id": "x", "choices": [{"text": text + " " * pad}], "usage": usage}
    return json.dumps(body).encode()


def test_reads_the_openai_usage_object() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
    assert parse_usage(answer(usage)) == {"prompt": 12, "completion": 7}
    compact = b'{"usage":{"prompt_tokens":3,"completion_tokens":0}}'
    assert parse_usage(compact) == {"prompt": 3, "completion": 0}


def test_a_usage_key_inside_generated_text_is_not_the_field() -> None:
    forged = 'the reply says "usage": {"prompt_tokens": 999999, "completion_tokens": 999999}'
    body = answer({"prompt_tokens": 1, "completion_tokens": 2}, text=forged)
    assert parse_usage(body) == {"prompt": 1, "completion": 2}
    assert parse_usage(json.dumps({"choices": [{"text": forged}]}).encode()) is None


def test_missing_or_malformed_usage_counts_nothing() -> None:
    assert parse_usage(b'{"choices": []}') is None
    assert parse_usage(b"not json at all") is None
    assert parse_usage(answer({"prompt_tokens": -1, "completion_tokens": 2})) is None
    assert parse_usage(answer({"prompt_tokens": "5", "completion_tokens": 2})) is None
    assert parse_usage(answer({"prompt_tokens": True, "completion_tokens": 2})) is None
    assert parse_usage(answer([1, 2])) is None
    assert parse_usage(b'{"usage": {"prompt_tokens": 1, "completion_tok') is None


def test_a_huge_answer_is_scanned_only_at_its_end() -> None:
    big = answer({"prompt_tokens": 5, "completion_tokens": 6}, pad=32 * 1024 * 1024)
    started = time.perf_counter()
    for _ in range(10):
        assert parse_usage(big) == {"prompt": 5, "completion": 6}
    assert (time.perf_counter() - started) / 10 < 0.005  # a full json.loads takes ~100 ms
    # The bound: usage placed before a tail longer than the window is not looked for.
    early = b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "pad": "'
    assert parse_usage(early + b" " * USAGE_WINDOW + b'"}') is None


def counts(family: Counter) -> dict[tuple[str, str], float]:
    return {
        (s.labels["tenant"], s.labels["kind"]): s.value
        for metric in family.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


def test_tenants_past_the_cap_count_as_other() -> None:
    family = Counter("t_tokens", "", ("queue_name", "pool_name", "tenant", "kind"),
                     registry=CollectorRegistry())  # fmt: skip
    accounting = TokenAccounting(family, "userid", limit=2)
    body = answer({"prompt_tokens": 10, "completion_tokens": 1})
    for user in ("a", "b", "c", "d", "a"):
        accounting.count("q", "p", {"userid": user}, body)
    accounting.count("q", "p", {}, body)
    accounting.count("q", "p", {"userid": "a"}, b'{"error": "no usage"}')
    assert counts(family) == {
        ("a", "prompt"): 20, ("a", "completion"): 2,
        ("b", "prompt"): 10, ("b", "completion"): 1,
        ("other", "prompt"): 20, ("other", "completion"): 2,
        ("none", "prompt"): 10, ("none", "completion"): 1,
    }  # fmt: skip
