"""Hot reload's config side: ``--transport-config-watch-interval`` (its env twin, where it
is refused), re-reading the transport file as startup reads it (REDIS_URL, pools, gate
groups; an empty queue list allowed), and a merge that follows a queue's new weight."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from async_processor.config import (
    ENV_PREFIX,
    AppConfig,
    SortedSetConfig,
    flag_parser,
    load_config,
    reread_transport_config,
)
from async_processor.config.queues import QueueSpec
from async_processor.errors import ConfigError
from async_processor.merge.weighted_fair import WeightedFair, WeightedFairParams
from async_processor.pipeline import reload as reload_module
from async_processor.pipeline.reload import QueueReload, ReloadMetrics

GW = "http://gw:8000"
ENV_NAME = f"{ENV_PREFIX}TRANSPORT_CONFIG_WATCH_INTERVAL"


def transport(*queues: str, **extra: Any) -> dict[str, Any]:
    entries = [{"queue_name": q, "igw_base_url": GW} for q in queues]
    return {"url": "redis://localhost:6379", "queues": entries, **extra}


def written(path: Path, content: Any) -> Path:
    path.write_text(json.dumps(content))
    return path


def daemon(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> AppConfig:
    path = written(tmp_path / "transport.json", transport("q1"))
    argv = ["--transport=redis-sortedset", f"--transport-config-file={path}", *flags]
    return load_config(argv, env or {})


def test_the_watch_is_off_by_default_and_takes_a_go_duration_or_its_env_twin(
    tmp_path: Path,
) -> None:
    config = daemon(tmp_path)
    assert config.runtime.transport_config_watch_interval == 0
    assert config.transport_config_file == str(tmp_path / "transport.json")
    flag = daemon(tmp_path, "--transport-config-watch-interval=1m30s")
    assert flag.runtime.transport_config_watch_interval == 90
    from_env = daemon(tmp_path, env={ENV_NAME: "10s"})
    assert from_env.runtime.transport_config_watch_interval == 10
    assert ENV_NAME in flag_parser().format_help().replace("\n", "").replace(" ", "")


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--transport-config-watch-interval=-1s"], "transport-config-watch-interval"),
        (["--transport-config-watch-interval=soon"], "transport-config-watch-interval"),
    ],
)
def test_a_bad_interval_is_refused(tmp_path: Path, argv: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        daemon(tmp_path, *argv)


def test_the_watch_needs_a_sorted_set_config_file(tmp_path: Path) -> None:
    inline = json.dumps(transport("q1"))
    watch = "--transport-config-watch-interval=10s"
    with pytest.raises(ConfigError, match="needs --transport redis-sortedset"):
        load_config(["--transport=redis-sortedset", f"--transport-config={inline}", watch], {})
    pubsub = written(tmp_path / "pubsub.json", transport("q1"))
    with pytest.raises(ConfigError, match="needs --transport redis-sortedset"):
        load_config(["--transport=redis-pubsub", f"--transport-config-file={pubsub}", watch], {})
    # Off, an inline config is fine as ever.
    load_config(["--transport=redis-sortedset", f"--transport-config={inline}"], {})


def test_a_reread_is_checked_as_startup_checks_the_file(tmp_path: Path) -> None:
    config = daemon(tmp_path)
    path = tmp_path / "transport.json"
    written(path, {**transport("q1", "q2"), "url": ""})
    again = reread_transport_config(config, {"REDIS_URL": "redis://elsewhere:6379"})
    assert isinstance(again.transport_config, SortedSetConfig)
    assert [q.queue_name for q in again.transport_config.queues] == ["q1", "q2"]
    assert again.transport_config.url == "redis://elsewhere:6379"  # REDIS_URL fills it
    assert again.runtime == config.runtime and again.pools == config.pools
    written(path, transport("q1", "q2", queues_extra=1))
    with pytest.raises(ConfigError, match="queues_extra"):
        reread_transport_config(config, {})
    unknown_pool = transport("q1")
    unknown_pool["queues"][0]["worker_pool_id"] = "elsewhere"
    written(path, unknown_pool)
    with pytest.raises(ConfigError, match="unknown worker_pool_id 'elsewhere'"):
        reread_transport_config(config, {})
    grouped = transport("q1", "q2")
    grouped["queues"][0].update(gate_group="g", gate_type="constant")
    grouped["queues"][1].update(gate_group="g")
    written(path, grouped)
    with pytest.raises(ConfigError, match="gate_group 'g'"):
        reread_transport_config(config, {})


def test_only_a_reload_may_empty_the_queue_list(tmp_path: Path) -> None:
    config = daemon(tmp_path)
    path = written(tmp_path / "transport.json", transport())
    again = reread_transport_config(config, {})
    assert isinstance(again.transport_config, SortedSetConfig)
    assert again.transport_config.queues == []
    with pytest.raises(ConfigError, match="at least one queue"):
        load_config(["--transport=redis-sortedset", f"--transport-config-file={path}"], {})


def test_weighted_fair_follows_a_queue_given_a_new_weight() -> None:
    """A reload that changes a queue's weight label makes a new spec of the same name."""
    policy = WeightedFair(WeightedFairParams())
    before = QueueSpec(id="q", name="q", pool="p", labels={"weight": "1"})
    after = QueueSpec(id="q", name="q", pool="p", labels={"weight": "4"})
    policy.served(before, -math.inf)
    assert policy.finish(before) == 1.0
    policy.served(after, policy.finish(after))
    assert policy.finish(after) == 1.25  # a step of 1/4 from the pool's time (1.0)


@pytest.mark.anyio
async def test_a_pass_over_unchanged_bytes_parses_nothing_but_a_failed_one_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing 1,000 queues costs ~90 ms on the event loop: not at every interval."""
    config = daemon(tmp_path, "--transport-config-watch-interval=1s")
    calls: list[AppConfig] = []

    def counted(config: AppConfig, env: Any) -> AppConfig:
        calls.append(config)
        return reread_transport_config(config, env)

    monkeypatch.setattr(reload_module, "reread_transport_config", counted)
    stub = cast(Any, None)  # a pass that changes nothing touches none of them
    watch = QueueReload(
        config,
        transport=stub,
        gates=stub,
        queues=stub,
        forget=stub,
        metrics=ReloadMetrics(CollectorRegistry()),
        applied=stub,
        env={},
    )
    path = tmp_path / "transport.json"
    assert await watch.reload() is None and len(calls) == 1  # the first pass reads it
    assert await watch.reload() is None and len(calls) == 1  # same bytes: not parsed
    path.write_text(path.read_text() + "\n")  # other bytes, same config
    assert await watch.reload() is None and len(calls) == 2
    path.write_text("{")
    assert await watch.reload() is False and len(calls) == 3
    assert await watch.reload() is False and len(calls) == 4  # a failure is tried again
