"""Config typos are caught and named: a close key or plug-in type is suggested, and a
number or boolean written as text is an error (it was silently converted: "10" -> 10).

Gate, merge and transform *parameters* still take text (the Go daemon's configs write
them as strings, and Helm renders them so); only the config files' own fields are typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from async_processor.config import load_config
from async_processor.errors import ConfigError
from async_processor.pipeline import validate_plugins
from tests.unit.test_config import QUEUE, SORTEDSET, error_of, sortedset_args, write


def pools_args(tmp_path: Path, pools: Any) -> list[str]:
    return [*sortedset_args(tmp_path), "--pool-config-file", write(tmp_path, "p.json", pools)]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**SORTEDSET, "batch_sise": 10},
         "batch_sise: Extra inputs are not permitted (did you mean 'batch_size'?)"),
        ({**SORTEDSET, "queues": [{**QUEUE, "worker_pool": "p"}]},
         "queues.0.worker_pool: Extra inputs are not permitted (did you mean 'worker_pool_id'?)"),
        ({"url": "redis://h", "queue_discovery": {"set_key": "s", "refresh_second": 1,
                                                  "template": {"igw_base_url": "http://g"}}},
         "queue_discovery.refresh_second: Extra inputs are not permitted "
         "(did you mean 'refresh_seconds'?)"),
        ({**SORTEDSET, "completely_else": 1}, "completely_else: Extra inputs are not permitted"),
        ({**SORTEDSET, "queues": [{**QUEUE, "gate_type": "prometheus-saturaton"}]},
         "unknown gate type 'prometheus-saturaton' (did you mean 'prometheus-saturation'?)"),
        ({**SORTEDSET, "queues": [{**QUEUE, "gate_type": "redis-quota",
                                   "gate_params": {"adress": "h:1", "limit": 2}}]},
         "adress: Extra inputs are not permitted (did you mean 'address'?)"),
    ],
    ids=["top-key", "queue-key", "nested-key", "no-close-key", "gate-type", "gate-param"],
)  # fmt: skip
def test_a_typo_names_the_closest_key_or_type(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    argv = sortedset_args(tmp_path, config)
    if any(q.get("gate_type") for q in config.get("queues", [])):  # plug-ins: at startup
        with pytest.raises(ConfigError) as caught:
            validate_plugins(load_config(argv, {}))
        error = str(caught.value)
    else:
        error = error_of(argv)
    assert message in error
    if "did you mean" not in message:
        assert "did you mean" not in error


def test_a_pool_or_transform_file_typo_is_named(tmp_path: Path) -> None:
    pools = [{"id": "default", "worker": 2}]
    assert "0.worker: Extra inputs are not permitted (did you mean 'workers'?)" in error_of(
        pools_args(tmp_path, pools)
    )
    transforms = write(tmp_path, "t.json", {"requestTransform": []})
    error = error_of([*sortedset_args(tmp_path), "--transform-config-file", transforms])
    assert "(did you mean 'requestTransforms'?)" in error


def test_unknown_merge_policy_type_suggests_one(tmp_path: Path) -> None:
    merge = write(tmp_path, "m.json", {"type": "tier-priorty"})
    config = load_config([*sortedset_args(tmp_path), "--request-merge-policy-config-file",
                          merge], {})  # fmt: skip
    with pytest.raises(ConfigError, match=r"did you mean 'tier-priority'\?"):
        validate_plugins(config)


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [("batch_size", "10", "a number"), ("lease_seconds", "30", "a number"),
     ("enable_tracing", "true", "a boolean")],
)  # fmt: skip
def test_a_number_or_boolean_written_as_text_is_an_error(
    tmp_path: Path, field: str, value: str, kind: str
) -> None:
    error = error_of(sortedset_args(tmp_path, {**SORTEDSET, field: value}))
    assert error.endswith(f"{field}: '{value}' is text, not {kind}: write it without quotes")


def test_text_numbers_in_queue_entries_and_pools_are_errors_too(tmp_path: Path) -> None:
    queue = {**QUEUE, "result_ttl_seconds": "60"}
    error = error_of(sortedset_args(tmp_path, {**SORTEDSET, "queues": [queue]}))
    assert "queues.0: result_ttl_seconds: '60' is text, not a number" in error
    error = error_of(pools_args(tmp_path, [{"id": "default", "workers": "4"}]))
    assert "workers: '4' is text, not a number" in error


def test_gate_params_and_flags_still_take_text(tmp_path: Path) -> None:
    """Go-style configs give gate parameters as strings; flags are text by nature."""
    queue = {**QUEUE, "gate_type": "prometheus-saturation",
             "gate_params": {"pool": "p", "threshold": "0.8"}}  # fmt: skip
    argv = [*sortedset_args(tmp_path, {**SORTEDSET, "queues": [queue]}),
            "--prometheus-url", "http://prom:9090", "--concurrency", "8"]  # fmt: skip
    config = load_config(argv, {"ASYNC_PROCESSOR_DRAIN_TIMEOUT": "30s"})
    assert config.runtime.concurrency == 8 and config.runtime.drain_timeout == 30.0
    validate_plugins(config)  # the gate takes threshold "0.8"
