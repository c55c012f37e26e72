"""The Batch API on Redis Cluster: the API, the daemon and the simulator on a real
three-primary cluster, one batch end to end with the real ``openai`` SDK (every script
on one object's slot, the result list in the queue's slot), its results stream, and a
retry of its failed lines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_batch_api import file_lines, line, run_batch, wait_for
from tests.e2e.test_batch_api_results import failing, results
from tests.fixtures.api import BatchStack, running_stack
from tests.fixtures.daemon import DaemonFactory
from tests.fixtures.redis_cluster import RedisClusterNodes
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
    results_list = f"{{{unique}:q}}:results"  # in the queue's slot
    with running_stack(
        tmp_path, redis_cluster.url, unique, simulator, daemon_factory, results_list,
        mode="cluster",
    ) as stack:  # fmt: skip
        yield stack


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
