"""Hot reload of the sorted-set queues (``--transport-config-watch-interval``, upstream #407):
the daemon started from its real flags re-reads its transport config file and applies its
queues: added ones served, removed ones stopped with nothing lost and their gauges gone,
a changed gate obeyed, any bad file or a change outside ``queues`` refused with the last
good config kept; beside queue discovery, and with two pools merged by tier-priority
(real redis-server, the simulator over HTTP)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from async_processor.client.redis_sortedset import SortedSetClient
from async_processor.config import AppConfig, SortedSetConfig, load_config
from async_processor.messages import Result, decode_envelope
from async_processor.pipeline.processor import Processor
from async_processor.redis import keys as redis_keys
from async_processor.redis.keys import REMOVED_QUEUES_KEY
from tests.fixtures.inprocess import HTTP_CLIENT, metric, running
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_queue_discovery import results

pytestmark = pytest.mark.anyio
RELOADS = "llm_d_async_async_queue_config_reloads_total"
LAST_SUCCESS = "llm_d_async_async_queue_config_last_success_timestamp_seconds"
GAUGES = (
    "llm_d_async_async_queue_depth",
    "llm_d_async_async_inflight_requests",
    "llm_d_async_async_broker_backlog",
    "llm_d_async_async_dispatch_budget",
)


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


class Files:
    """The daemon's config files in ``tmp_path``; ``write`` swaps one in at once (as the
    kubelet swaps a ConfigMap's files)."""

    def __init__(self, tmp_path: Path, redis_url: str, unique: str, gateway: str) -> None:
        self.dir, self.redis_url, self.unique, self.gateway = tmp_path, redis_url, unique, gateway
        self.transport = tmp_path / "transport.json"

    def queue(self, name: str, **extra: Any) -> dict[str, Any]:
        return {"queue_name": f"{self.unique}-{name}", "igw_base_url": self.gateway, **extra}

    def config(self, *queues: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {
            "url": self.redis_url,
            "result_queue_name": f"{self.unique}:results",
            "retry_queue_name": f"{self.unique}:retry-set",
            "poll_interval_ms": 50,
            "lease_seconds": 5,
            "queues": list(queues),
            **extra,
        }

    def write(self, content: Any, path: Path | None = None) -> None:
        target = path or self.transport
        text = content if isinstance(content, str) else json.dumps(content)
        staged = target.with_suffix(".tmp")
        staged.write_text(text)
        os.replace(staged, target)

    def daemon(self, *flags: str) -> AppConfig:
        """The daemon's config from its command line, as ``async-processor run`` reads it."""
        argv = [
            "--transport=redis-sortedset",
            f"--transport-config-file={self.transport}",
            "--transport-config-watch-interval=100ms",
            f"--health-port={free_port()}",
            f"--metrics-port={free_port()}",
            "--bind-address=127.0.0.1",
            "--metrics-backlog-poll-interval=0s",
            f"--http-client={HTTP_CLIENT}",
            *flags,
        ]
        return load_config(argv, {})


@pytest.fixture
def files(tmp_path: Path, redis_url: str, unique: str, simulator: SimulatorProcess) -> Files:
    return Files(tmp_path, redis_url, unique, simulator.url)


async def submit(files: Files, queue: str, *ids: str) -> None:
    deadline = int(time.time()) + 120
    name = f"{files.unique}-{queue}"
    async with SortedSetClient(files.redis_url, name, f"{files.unique}:results") as client:
        await client.submit_many(
            [{"id": i, "deadline": deadline, "payload": {"prompt": i}} for i in ids]
        )


async def until(condition: Callable[[], bool], timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.05)


async def reloaded(processor: Processor, result: str, count: int) -> None:
    """Until ``count`` reloads ended with ``result``."""
    await until(lambda: metric(processor, RELOADS, result=result) >= count)


def series(processor: Processor, name: str, queue: str = "", **labels: str) -> bool:
    """Whether a sample ``name`` with these labels (``queue``: its queue_name) exists."""
    wanted = {"queue_name": queue, **labels} if queue else labels
    return any(
        sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items())
        for family in processor.metrics.registry.collect()
        for sample in family.samples
    )


def poller_of(processor: Processor, queue_id: str) -> object:
    assert processor._queues is not None
    return processor._queues._running[("configured", queue_id)].poller


async def test_an_added_queue_is_served_and_an_unchanged_one_keeps_its_poller_and_gate(
    files: Files, r: Redis
) -> None:
    unique = files.unique
    a = files.queue("a", gate_type="local-max-concurrency", gate_params={"limit": 8})
    files.write(files.config(a))
    async with running(files.daemon()) as processor:
        # Both families are there, every result at 0, before any reload happened.
        assert series(processor, RELOADS, result="success")
        assert series(processor, RELOADS, result="error")
        assert metric(processor, RELOADS) == 0
        assert series(processor, LAST_SUCCESS)
        poller, gate = poller_of(processor, f"{unique}-a"), processor.queue_gates[f"{unique}-a"]
        await submit(files, "b", "b1")  # not served yet
        before = time.time()
        files.write(files.config(a, files.queue("b")))
        await reloaded(processor, "success", 1)
        assert metric(processor, LAST_SUCCESS) >= before
        await submit(files, "a", "a1")
        assert sorted(await results(r, unique, 2)) == ["a1", "b1"]
        assert poller_of(processor, f"{unique}-a") is poller  # unchanged: kept as it was
        assert processor.queue_gates[f"{unique}-a"] is gate
        assert isinstance(processor.config.transport_config, SortedSetConfig)
        assert [q.queue_name for q in processor.config.transport_config.queues] == [
            f"{unique}-a",
            f"{unique}-b",
        ]
        files.write(files.config(a, files.queue("b")))  # the same again: nothing to do
        await anyio.sleep(0.5)
        assert metric(processor, RELOADS, result="success") == 1
        assert metric(processor, RELOADS, result="error") == 0


def kubelet_update(directory: Path, name: str, text: str, generation: int) -> None:
    """What the kubelet's atomic writer does to a mounted ConfigMap: the files in a new
    timestamped directory, the ``..data`` symlink swapped to it in one rename, the old
    directory deleted; each file is a symlink through ``..data`` (no subPath mount)."""
    fresh = directory / f"..2026_12_06_{generation}"
    fresh.mkdir()
    (fresh / name).write_text(text)
    data, staged = directory / "..data", directory / "..data_tmp"
    old = data.resolve() if data.is_symlink() else None
    staged.symlink_to(fresh.name)
    os.replace(staged, data)
    if old is not None:
        shutil.rmtree(old)
    if not (directory / name).is_symlink():
        (directory / name).symlink_to(Path("..data") / name)


async def test_a_configmap_updated_in_place_by_the_kubelet_is_applied(
    files: Files, r: Redis
) -> None:
    mounted = files.dir / "config"
    mounted.mkdir()
    files.transport = mounted / "transport-config.json"
    kubelet_update(mounted, files.transport.name, json.dumps(files.config(files.queue("a"))), 1)
    async with running(files.daemon()) as processor:
        text = json.dumps(files.config(files.queue("a"), files.queue("b")))
        kubelet_update(mounted, files.transport.name, text, 2)
        await reloaded(processor, "success", 1)
        await submit(files, "b", "b1")
        assert await results(r, files.unique, 1) == ["b1"]


async def test_a_removed_queue_answers_or_returns_each_message_once_and_its_gauges_go(
    files: Files, r: Redis, simulator: SimulatorProcess
) -> None:
    simulator.configure(latency=0.2)
    name, answers = f"{files.unique}-b", f"{files.unique}:results"
    ids = [f"m{n}" for n in range(60)]
    await submit(files, "b", *ids)
    files.write(files.config(files.queue("a"), files.queue("b")))
    async with running(files.daemon("--concurrency=4")) as processor:
        with anyio.fail_after(30):
            while await r.llen(answers) < 4:  # under way: some answered, some in flight
                await anyio.sleep(0.05)
        assert all(series(processor, gauge, name) for gauge in GAUGES)
        files.write(files.config(files.queue("a")))
        await reloaded(processor, "success", 1)
        # Named removed in Redis and kept in upkeep: a kill while it drains strands no
        # claim (the next daemon, whatever its config, reaps it: test_removed_queues).
        assert await r.sismember(REMOVED_QUEUES_KEY, name)
        assert name in [q.name for q in processor.transport.queues]
        # Drained: what was in flight answered, the rest handed back, then the gauges go.
        await until(lambda: not any(series(processor, gauge, name) for gauge in GAUGES))
        with anyio.fail_after(30):
            while await r.zcard(redis_keys.inflight_key(name)):
                await anyio.sleep(0.05)
        # Its counters stay (as upstream): a rate over the removal stays right.
        assert metric(processor, "llm_d_async_async_successful_requests_total", queue_name=name)
        queued = await r.zcard(name)
        await submit(files, "b", "late")  # nobody polls it now
        await submit(files, "a", "a1")
        with anyio.fail_after(30):
            while "a1" not in [Result.decode(x).id for x in await r.lrange(answers, 0, -1)]:
                await anyio.sleep(0.05)
        assert await r.zcard(name) == queued + 1  # nothing taken from it any more
        # Late results of the removed queue bound none of its gauges again.
        assert not any(series(processor, gauge, name) for gauge in GAUGES)
    answered = [Result.decode(raw).id for raw in await r.lrange(answers, 0, -1)]
    left = [decode_envelope(cast(bytes, raw)).id for raw in await r.zrange(name, 0, -1)]
    assert await r.zcard(redis_keys.inflight_key(name)) == 0  # no claim left behind
    answered.remove("a1")
    left.remove("late")
    assert left, "the removal came while the queue still held messages"
    assert sorted(answered + left) == sorted(ids)  # each answered once or back in its queue


async def test_a_changed_gate_is_obeyed_and_the_queue_gets_a_new_poller(
    files: Files, r: Redis
) -> None:
    unique = files.unique
    closed = files.queue("a", gate_type="constant", gate_params={"value": 0})
    files.write(files.config(closed))
    async with running(files.daemon()) as processor:
        poller = poller_of(processor, f"{unique}-a")
        await submit(files, "a", "a1", "a2")
        await anyio.sleep(0.5)
        assert await r.zcard(f"{unique}-a") == 2  # the gate holds them
        opened = files.queue("a", gate_type="constant", gate_params={"value": 1})
        files.write(files.config(opened))
        await reloaded(processor, "success", 1)
        assert sorted(await results(r, unique, 2)) == ["a1", "a2"]
        assert poller_of(processor, f"{unique}-a") is not poller
        assert processor.queue_gates[f"{unique}-a"] is not None
        assert series(processor, "llm_d_async_async_dispatch_budget", f"{unique}-a")


async def test_a_bad_file_keeps_the_last_good_config_and_counts_an_error(
    files: Files, r: Redis
) -> None:
    unique = files.unique
    files.write(files.config(files.queue("a")))
    minus_one = {"gate_type": "local-max-concurrency", "gate_params": {"limit": -1}}
    bad: list[tuple[Any, str]] = [
        ('{"queues": [', "malformed JSON"),
        (files.config(files.queue("a"), files.queue("b", worker_pool_id="no")), "worker_pool_id"),
        (files.config(files.queue("a"), files.queue("b", igw_base_url="ftp://x")), "igw_base_url"),
        (files.config(files.queue("a"), files.queue("b", gate_type="no-such")), "no-such"),
        (files.config(files.queue("a"), files.queue("b", **minus_one)), "limit"),  # its params
        (files.config(files.queue("a"), files.queue("a")), "duplicate"),  # one queue twice
        (None, "cannot read"),  # gone (a ConfigMap swap caught mid-way)
    ]
    with capture_logs() as logs:
        async with running(files.daemon()) as processor:
            for content, why in bad:
                before = metric(processor, RELOADS, result="error")
                if content is None:
                    files.transport.unlink()
                else:
                    files.write(content)
                # Two more: at least one pass read this file whole. Each pass counts.
                await reloaded(processor, "error", int(before) + 2)
                failures = [e for e in logs if e["event"] == "queue_config_reload_failed"]
                assert why in failures[-1]["error"], failures[-1]
            assert metric(processor, RELOADS, result="success") == 0
            assert metric(processor, LAST_SUCCESS) == 0
            await submit(files, "a", "a1")  # the last good config is served all along
            await submit(files, "b", "b1")
            assert await results(r, unique, 1) == ["a1"]
            assert await r.zcard(f"{unique}-b") == 1
            files.write(files.config(files.queue("a"), files.queue("b")))  # fixed: applied
            await reloaded(processor, "success", 1)
            assert await results(r, unique, 1) == ["b1"]
    # Logged once per failure, not at every pass.
    assert len([e for e in logs if e["event"] == "queue_config_reload_failed"]) == len(bad)


async def test_a_change_outside_queues_is_refused_whole(files: Files, r: Redis) -> None:
    unique = files.unique
    files.write(files.config(files.queue("a")))
    async with running(files.daemon()) as processor:
        files.write(files.config(files.queue("a"), files.queue("b"), batch_size=50))
        await reloaded(processor, "error", 1)
        await submit(files, "b", "b1")
        await anyio.sleep(0.5)
        assert await r.zcard(f"{unique}-b") == 1  # the queue beside the refused change too
        assert isinstance(processor.config.transport_config, SortedSetConfig)
        assert processor.config.transport_config.batch_size == 10
        files.write(files.config(files.queue("a"), files.queue("b")))
        await reloaded(processor, "success", 1)
        assert await results(r, unique, 1) == ["b1"]


async def test_every_queue_removed_then_one_added(files: Files, r: Redis) -> None:
    """Upstream allows an empty list on reload (every queue stopped, no restart)."""
    unique = files.unique
    files.write(files.config(files.queue("a")))
    async with running(files.daemon()) as processor:
        files.write(files.config())
        await reloaded(processor, "success", 1)
        await submit(files, "a", "a1")
        await anyio.sleep(0.5)
        assert await r.zcard(f"{unique}-a") == 1
        await until(lambda: not series(processor, GAUGES[3], f"{unique}-a"))
        files.write(files.config(files.queue("a"), files.queue("b")))  # a served again
        await reloaded(processor, "success", 2)
        await submit(files, "b", "b1")
        assert sorted(await results(r, unique, 2)) == ["a1", "b1"]
        # Its gauges are bound afresh (not the ones its removal detached).
        assert all(series(processor, gauge, f"{unique}-a") for gauge in GAUGES)


async def test_with_queue_discovery_a_queue_moves_between_listed_and_configured(
    files: Files, r: Redis
) -> None:
    unique, listed = files.unique, f"{files.unique}:tenants"
    d = f"{unique}-d"
    discovery = {
        "set_key": listed,
        "refresh_seconds": 0.2,
        "template": {"igw_base_url": files.gateway},
    }
    await r.sadd(listed, d)
    files.write(files.config(files.queue("a"), queue_discovery=discovery))
    async with running(files.daemon()) as processor:
        assert processor._discovery is not None
        await until(lambda: d in processor._discovery.running)  # type: ignore[union-attr]
        await submit(files, "d", *[f"d{n}" for n in range(10)])
        # Configured now: served as such, no longer as a discovered queue.
        files.write(files.config(files.queue("a"), files.queue("d"), queue_discovery=discovery))
        await reloaded(processor, "success", 1)
        await submit(files, "d", *[f"d{n}" for n in range(10, 20)])
        got = await results(r, unique, 20)
        assert sorted(got) == sorted(f"d{n}" for n in range(20))  # each once
        await until(lambda: d not in processor._discovery.running)  # type: ignore[union-attr]
        assert series(processor, "llm_d_async_async_dispatch_budget", d)  # still served
        # Taken out of the config, still listed: discovered again.
        files.write(files.config(files.queue("a"), queue_discovery=discovery))
        await reloaded(processor, "success", 2)
        await until(lambda: d in processor._discovery.running)  # type: ignore[union-attr]
        await submit(files, "d", "again")
        assert await results(r, unique, 1) == ["again"]
        # The discovery template's own settings are outside queues: refused.
        other = {**discovery, "refresh_seconds": 5}
        files.write(files.config(files.queue("a"), queue_discovery=other))
        await reloaded(processor, "error", 1)


async def test_two_pools_with_tier_priority_lanes_gain_and_lose_queues(
    files: Files, r: Redis, simulator: SimulatorProcess
) -> None:
    unique = files.unique
    pools = files.dir / "pools.json"
    files.write([{"id": "p1", "workers": 2}, {"id": "p2", "workers": 2}], pools)
    merge = files.dir / "merge.json"
    files.write({"type": "tier-priority", "parameters": {"priority_header": "x-lane"}}, merge)

    def queue(name: str, pool: str, tier: str) -> dict[str, Any]:
        return files.queue(name, worker_pool_id=pool, labels={"tier": tier})

    files.write(files.config(queue("a", "p1", "interactive"), queue("b", "p2", "batch")))
    flags = (f"--pool-config-file={pools}", f"--request-merge-policy-config-file={merge}")
    async with running(files.daemon(*flags)) as processor:
        await submit(files, "a", "a1")
        await submit(files, "b", "b1")
        assert sorted(await results(r, unique, 2)) == ["a1", "b1"]
        # p1 loses its only queue and gets another; p2 gets a second, more urgent lane.
        files.write(
            files.config(
                queue("b", "p2", "batch"),
                queue("c", "p1", "async"),
                queue("d", "p2", "interactive"),
            )
        )
        await reloaded(processor, "success", 1)
        await submit(files, "a", "a2")
        await submit(files, "c", *[f"c{n}" for n in range(5)])
        await submit(files, "d", *[f"d{n}" for n in range(5)])
        await submit(files, "b", "b2")
        got = await results(r, unique, 11)
        assert sorted(got) == sorted(["b2", *(f"{q}{n}" for q in "cd" for n in range(5))])
        assert await r.zcard(f"{unique}-a") == 1  # a2 waits: a is no longer served
    lanes: dict[str, list[str]] = {}
    for request in simulator.requests():
        lane = [v for k, v in request["headers"].items() if k.lower() == "x-lane"]
        lanes[json.loads(request["body"])["prompt"]] = lane
    # Lane index = class x 3 + tier: unclassified (1) x 3 + interactive 0 / async 1 / batch 2.
    assert lanes["a1"] == ["3"] and lanes["b1"] == lanes["b2"] == ["5"]
    assert all(lanes[f"c{n}"] == ["4"] and lanes[f"d{n}"] == ["3"] for n in range(5))


async def test_a_queue_moved_to_another_pool_mid_run_answers_each_message_once(
    files: Files, r: Redis, simulator: SimulatorProcess
) -> None:
    """A changed queue (its pool) gets a new poller in the other pool while its old one
    drains: both polling one sorted set for a moment, each message is answered once."""
    simulator.configure(latency=0.05)
    unique, name = files.unique, f"{files.unique}-a"
    pools = files.dir / "pools.json"
    files.write([{"id": "p1", "workers": 2}, {"id": "p2", "workers": 2}], pools)
    files.write(
        files.config(files.queue("a", worker_pool_id="p1"), files.queue("b", worker_pool_id="p2"))
    )
    ids = [f"m{n}" for n in range(60)]
    await submit(files, "a", *ids)
    async with running(files.daemon(f"--pool-config-file={pools}")) as processor:
        got = await results(r, unique, 5)
        files.write(
            files.config(
                files.queue("a", worker_pool_id="p2"), files.queue("b", worker_pool_id="p2")
            )
        )
        await reloaded(processor, "success", 1)
        got += await results(r, unique, len(ids) - 5)
        moved = {"queue_name": name, "pool_name": "p2"}
        await until(lambda: not series(processor, GAUGES[3], name, pool_name="p1"))
        assert series(processor, GAUGES[3], **moved)  # the new pool's series stay
    assert sorted(got) == sorted(ids)  # each answered once
    assert await r.llen(f"{unique}:results") == 0 and await r.zcard(name) == 0


async def test_weighted_fair_lanes_join_and_leave_with_their_weights(
    files: Files, r: Redis
) -> None:
    unique = files.unique
    merge = files.dir / "merge.json"
    files.write({"type": "weighted-fair", "parameters": {}}, merge)
    files.write(files.config(files.queue("a"), files.queue("b")))
    async with running(files.daemon(f"--request-merge-policy-config-file={merge}")) as processor:
        await submit(files, "a", "a1")
        assert await results(r, unique, 1) == ["a1"]
        heavy = files.queue("c", labels={"weight": "4"})
        files.write(files.config(files.queue("b"), heavy))
        await reloaded(processor, "success", 1)
        await submit(files, "a", "a2")
        await submit(files, "b", *[f"b{n}" for n in range(10)])
        await submit(files, "c", *[f"c{n}" for n in range(10)])
        got = await results(r, unique, 20)
        assert sorted(got) == sorted([*(f"b{n}" for n in range(10)), *(f"c{n}" for n in range(10))])
        assert await r.zcard(f"{unique}-a") == 1  # a2: its lane left the merge


async def test_a_removed_discovered_queue_binds_no_series_again_for_late_results(
    files: Files, r: Redis, simulator: SimulatorProcess
) -> None:
    """Results of its in-flight messages land after its poller drained: they bound every
    series of the queue again (a dispatch_budget of 0 for a queue nobody serves)."""
    simulator.configure(latency=0.3)
    unique, listed = files.unique, f"{files.unique}:tenants"
    name = f"{unique}-d"
    discovery = {
        "set_key": listed,
        "refresh_seconds": 0.2,
        "template": {"igw_base_url": files.gateway},
    }
    ids = [f"d{n}" for n in range(40)]
    await submit(files, "d", *ids)
    await r.sadd(listed, name)
    files.write(files.config(files.queue("a"), queue_discovery=discovery))
    async with running(files.daemon("--concurrency=4")) as processor:
        with anyio.fail_after(30):
            while await r.llen(f"{unique}:results") < 4:
                await anyio.sleep(0.05)
        await r.srem(listed, name)
        await until(lambda: not series(processor, GAUGES[3], name))
        with anyio.fail_after(30):  # what was in flight is answered after the drain
            while await r.zcard(redis_keys.inflight_key(name)):
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)  # the result writer's batch observed
        assert not any(series(processor, gauge, name) for gauge in GAUGES)
        await r.sadd(listed, name)  # listed again: served, its series bound afresh
        await until(lambda: all(series(processor, gauge, name) for gauge in GAUGES))
