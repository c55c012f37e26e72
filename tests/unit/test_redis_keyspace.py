"""Key names per mode: standalone exactly the Go daemon's; cluster in the queue's slot."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError
from redis.crc import key_slot

from async_processor.config import SortedSetConfig
from async_processor.config.redis import cluster_problem, hash_tag, slot
from async_processor.redis import keys
from async_processor.redis.keyspace import KeySpace

STANDALONE, CLUSTER = KeySpace(), KeySpace(cluster=True)


def _all_names(space: KeySpace, queue: str) -> list[str]:
    return [
        *space.claim_keys(queue),
        space.inflight(queue),
        space.inflight_meta(queue),
        space.dead_letter(queue),
        space.retry(queue, "retry-sortedset"),
        space.active(queue, "id:1"),
        space.cancel(queue, "id:1"),
        space.done(queue, "id:1", "tok"),
    ]


def test_standalone_names_are_the_go_daemons() -> None:
    assert _all_names(STANDALONE, "requests") == [
        "requests:claimed",
        "requests:claim-owners",
        "requests:claims-idx",
        "requests:inflight",
        "requests:inflight:meta",
        "requests:dead-letter",
        "retry-sortedset",
        "request-active:id:1",
        "request-cancel:id:1",
        keys.done_key("id:1", "tok"),
    ]


@pytest.mark.parametrize("queue", ["requests", "{tenant-a}requests", "x{t}y"])
def test_cluster_names_share_the_queues_slot(queue: str) -> None:
    names = _all_names(CLUSTER, queue)
    assert {slot(name) for name in names} == {slot(queue)}
    assert len(set(names)) == len(names)


def test_cluster_names_carry_the_queue_or_its_own_tag() -> None:
    assert CLUSTER.inflight("requests") == "{requests}:inflight"
    # Upstream's claim keys, named as upstream's cluster mode names them (#491).
    assert CLUSTER.claim_keys("requests") == [
        "{requests}:claimed",
        "{requests}:claim-owners",
        "{requests}:claims-idx",
    ]
    assert CLUSTER.claimed("{t}requests") == "{t}requests:claimed"
    assert CLUSTER.active("requests", "7") == "{requests}:request-active:7"
    assert CLUSTER.inflight("{t}requests") == "{t}requests:inflight"  # its own tag kept
    assert CLUSTER.cancel("{t}requests", "7") == "{t}:request-cancel:7"
    assert hash_tag("a{}b") == "a{}b"  # an empty tag is no tag (Redis's rule)


def test_a_cross_slot_result_list_names_a_working_one() -> None:
    problem = cluster_problem("requests", "result-list")
    assert problem is not None
    assert "'requests'" in problem and "'result-list'" in problem
    assert "'{requests}:results'" in problem
    assert cluster_problem("requests", "{requests}:results") is None
    assert "'{t}:results'" in (cluster_problem("{t}q", "results") or "")
    assert "hash tag" in (cluster_problem("a{}b", "{a{}b}:results") or "")


def test_a_result_list_whose_side_keys_hash_elsewhere_is_refused() -> None:
    """``x{N`` has a brace but no tag: Redis hashes all of it, and its counter key
    ``x{N:pushed`` too, into another slot; same slot for the list alone is not enough."""
    home = slot("requests")
    name = next(n for i in itertools.count() if slot(n := f"x{{{i}") == home)
    assert slot(keys.result_side_key(name, "pushed")) != home
    assert cluster_problem("requests", name) is not None
    assert not CLUSTER.routable("requests", name)
    assert CLUSTER.routable("requests", "{requests}:results")
    assert STANDALONE.routable("requests", name)


def test_cluster_config_checks_every_queue_at_startup() -> None:
    queue = {"queue_name": "requests", "igw_base_url": "http://gw"}
    base = {"url": "redis://h:1", "mode": "cluster", "queues": [queue]}
    with pytest.raises(ValidationError, match=r"e.g. '\{requests\}:results'"):
        SortedSetConfig.model_validate(base)
    ok = SortedSetConfig.model_validate({**base, "result_queue_name": "{requests}:results"})
    assert ok.mode == "cluster"
    with pytest.raises(ValidationError, match="wait_replicas"):
        SortedSetConfig.model_validate(
            {**base, "result_queue_name": "{requests}:r", "wait_replicas": 1}
        )
    # Standalone is unchanged: any result list.
    assert SortedSetConfig.model_validate({**base, "mode": "standalone"}).mode == "standalone"


def test_routed_result_lists_and_own_keys_in_cluster_mode() -> None:
    own = CLUSTER.own_keys(keys.own_keys(["requests"], "retry", []), ["requests"])
    assert own.rejection("{requests}:inflight") == "reserved_key"
    assert own.rejection("{requests}:claims-idx") == "reserved_key"
    assert own.rejection("{requests}:claim-batch:0123456789abcdef:1") == "reserved_key"
    assert own.rejection("{requests}:request-done:x:y") == "reserved_key"
    assert own.rejection("{requests}:results") is None
    assert CLUSTER.routable("requests", "{requests}:mine")
    assert not CLUSTER.routable("requests", "elsewhere")
    assert STANDALONE.routable("requests", "elsewhere")


@pytest.mark.parametrize("key", ["requests", "{t}x", "a{}b{c}", "{}", "x{y}z{w}", "ünï{cø}de", ""])
def test_slot_is_redis_pys(key: str) -> None:
    """Our CRC16 (config loading must not import redis-py) agrees with redis-py's."""
    assert slot(key) == key_slot(key.encode())
