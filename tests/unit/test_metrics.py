"""Which families a transport exports: ``message_latency`` only where it is observed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from async_processor.metrics import Metrics

LATENCY = "llm_d_async_async_message_latency_time_millis"


def test_message_latency_is_not_exported_until_a_pubsub_ack_observes_it() -> None:
    metrics = Metrics(CollectorRegistry())
    queue = metrics.queue("q", "q", "default")
    queue.request_total.inc()  # what a Redis transport's queue does: never an ack latency
    assert "message_latency" not in generate_latest(metrics.registry).decode()
    queue.message_latency.observe(120)  # the Pub/Sub ack path
    text = generate_latest(metrics.registry).decode()
    assert f'{LATENCY}_count{{pool_name="default",queue_id="q",queue_name="q"}} 1.0' in text
