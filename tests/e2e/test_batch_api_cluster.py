"""The Batch API on Redis Cluster: the API, the daemon and the simulator on a real
three-primary cluster, one batch end to end with the real ``openai`` SDK (every script
on one object's slot, the result list in the queue's slot), its results stream, and a
retry of its failed lines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_batch_api import file_lines, line, run_batch, wait_for
from tests.e2e.test_batch_api_results import failing, results
from tests.fixtures.api import BatchStack
from tests.fixtures.daemon import DaemonFactory, sortedset_config
from tests.fixtures.redis_cluster import RedisClusterNodes
from tests.fixtures.servers import stop_process
from tests.fixtures.simulator import SimulatorProcess

pytestmark = [pytest.mark.slow]


@pytest.fixture
def cluster_stack(
    tmp_path: Path,
    redis_cluster: RedisClusterNodes,
    unique: str,
    simulator: SimulatorProcess,
    daemon_factory: DaemonFactory,
) -> Iterator[BatchStack]:
    queue = f"{unique}:q"
    config = sortedset_config(
        redis_cluster.url, simulator.url, [queue],
        result_list=f"{{{queue}}}:results", lease_seconds=2, mode="cluster",
    )  # fmt: skip
    config_path = tmp_path / "transport.json"
    config_path.write_text(json.dumps(config))
    daemon = daemon_factory.start(config, "--concurrency", "16")
    stack = BatchStack(
        tmp_path, redis_cluster.url, queue, config_path, daemon, simulator, unique, daemon_factory
    )
    stack.start_api()
    yield stack
    for api in stack.apis:
        stop_process(api.proc, timeout=10)


def test_a_batch_end_to_end_on_redis_cluster(cluster_stack: BatchStack) -> None:
    client = cluster_stack.client(max_retries=0)
    lines = [failing(f"c{i}") if i % 7 == 0 else line(f"c{i}", max_tokens=2) for i in range(60)]
    done = wait_for(client, run_batch(client, lines).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (51, 9)
    output = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in output + errors) == sorted(f"c{i}" for i in range(60))
    assert done.usage.output_tokens == 51 * 2
    code, status, streamed = results(cluster_stack, done.id)
    assert (code, status, len(streamed)) == (200, "completed", 60)
    retry = client.post(f"/batches/{done.id}/retry_failed", cast_to=object)
    retried = wait_for(client, retry["id"])
    assert retried.request_counts.total == retried.request_counts.failed == 9
    assert [b.id for b in client.batches.list()] == [retried.id, done.id]
