"""``QueueSpec``: one configured queue as the pipeline sees it, whatever its broker.

Built by ``config.models`` from a transport's queue entries; read by the poller, the
gates' owners, the merge policies and the transports. Pure data: no broker code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One configured queue (sorted set, channel or subscription), transport-neutral."""

    id: str
    name: str
    pool: str = "default"
    igw_base_url: str = ""
    request_path_url: str = "/v1/completions"
    inference_objective: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    gate_type: str = ""
    gate_params: Mapping[str, Any] = field(default_factory=dict)
    gate_group: str = ""  # queues of one group share one queue gate
    result_queue_name: str = ""
    # redis-sortedset: the queue's own result_ttl_seconds (0: none), frozen into a
    # message's routing at its first fetch as upstream does (the result list's EXPIRE).
    result_ttl_seconds: int = 0
    batch_size: int = 10
    poll_interval: float = 1.0
    # 0: a fetch asks for at most min(free slots, batch_size x budget) (the Redis
    # transports). n > 0: it asks for the free slots x budget, at most n (gcp-pubsub:
    # Pub/Sub's 1,000 per pull), and the queue's lane holds a whole fetch.
    max_fetch: int = 0
    # Fetches of this queue that may be in flight at once (each sized as above): a broker
    # that answers a fetch with fewer messages than asked (Pub/Sub) needs several.
    fetches_in_flight: int = 1
