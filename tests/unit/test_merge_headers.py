"""Header legality, fairness stamping and the stamped-header application rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from async_processor.headers import (
    DEFAULT_FAIRNESS_HEADER,
    apply_stamped,
    fairness_id,
    is_valid_header_name,
    is_valid_header_value,
)
from async_processor.merge.base import MergeParams
from async_processor.messages import Envelope, Request


@pytest.mark.parametrize("name", ["x-a", "X_B", "a!#$%&'*+-.^_`|~9"])
def test_token_names_are_legal(name: str) -> None:
    assert is_valid_header_name(name)


@pytest.mark.parametrize("name", ["", "a b", "a:b", "a\r\nb", "é", "a(b)", 'a"b'])
def test_non_token_names_are_illegal(name: str) -> None:
    assert not is_valid_header_name(name)


@pytest.mark.parametrize("value", ["", "plain", "tab\there", "ünïcode", "a b; c=d"])
def test_values_without_controls_are_legal(value: str) -> None:
    assert is_valid_header_value(value)


@pytest.mark.parametrize("value", ["a\rb", "a\nb", "nul\x00", "del\x7f", "bell\x07"])
def test_control_characters_in_values_are_illegal(value: str) -> None:
    assert not is_valid_header_value(value)


def test_apply_stamped_replaces_every_case_variant_in_order() -> None:
    headers = {
        "Content-Type": "application/json",
        "X-LLM-D-Inference-Fairness-Id": "caller",
        "x-llm-d-inference-fairness-id": "caller2",
        "x-other": "kept",
    }
    apply_stamped(headers, [(DEFAULT_FAIRNESS_HEADER, "tenant-a"), ("x-gateway-priority", "3")])
    assert headers == {
        "Content-Type": "application/json",
        "x-other": "kept",
        DEFAULT_FAIRNESS_HEADER: "tenant-a",
        "x-gateway-priority": "3",
    }
    assert list(headers)[-2:] == [DEFAULT_FAIRNESS_HEADER, "x-gateway-priority"]


def test_later_stamp_of_same_name_wins() -> None:
    headers: dict[str, str] = {}
    apply_stamped(headers, [("x-a", "1"), ("X-A", "2")])
    assert headers == {"X-A": "2"}


def _env(metadata: dict[str, str]) -> Envelope:
    return Envelope(request=Request(id="r", deadline=1, metadata=metadata))


def test_fairness_defaults_to_userid_and_default_header() -> None:
    params = MergeParams()
    assert params.fairness_stamp(_env({"userid": "u1"})) == (DEFAULT_FAIRNESS_HEADER, "u1")
    assert MergeParams(fairness_header=None, fairness_attribute="").fairness_attribute == "userid"


def test_fairness_empty_header_disables_stamping() -> None:
    assert MergeParams(fairness_header="").fairness_stamp(_env({"userid": "u1"})) is None


def test_fairness_custom_attribute_and_header() -> None:
    params = MergeParams(fairness_header="x-tenant", fairness_attribute="tenant")
    assert params.fairness_stamp(_env({"tenant": "t", "userid": "u"})) == ("x-tenant", "t")


def test_illegal_fairness_header_name_is_rejected() -> None:
    with pytest.raises(ValidationError, match="not a legal HTTP header name"):
        MergeParams(fairness_header="bad header")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", None),
        ("a" * 256, "a" * 256),
        ("a" * 257, None),
        ("é" * 128, "é" * 128),  # 256 bytes in UTF-8
        ("é" * 129, None),  # 258 bytes
        ("evil\r\nx-admin: 1", None),
        ("tab\tok", "tab\tok"),
    ],
)
def test_fairness_id_limits(value: str, expected: str | None) -> None:
    assert fairness_id({"userid": value}, "userid") == expected


def test_missing_fairness_attribute_leaves_headers_alone() -> None:
    assert MergeParams().fairness_stamp(_env({})) is None


def test_a_lone_surrogate_userid_is_not_stamped_and_does_not_crash_the_merge() -> None:
    # JSON "\ud800" decodes to a lone surrogate; len(value.encode()) raised
    # UnicodeEncodeError inside the merge emitter, which took the daemon down.
    assert not is_valid_header_value("u\ud800")
    assert fairness_id({"userid": "u\ud800"}, "userid") is None
    assert fairness_id({"userid": "ok"}, "userid") == "ok"
