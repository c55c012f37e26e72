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


def test_build_info_and_the_process_and_python_collectors() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.set_build_info("1.2.3", "redis-sortedset")
    sample = metrics.registry.get_sample_value
    assert (
        sample("llm_d_async_build_info", {"version": "1.2.3", "transport": "redis-sortedset"}) == 1
    )
    assert sample("process_resident_memory_bytes") > 0
    assert sample("process_open_fds") > 0
    assert "python_info" in generate_latest(metrics.registry).decode()
    assert sample("python_gc_collections_total", {"generation": "0"}) is not None


def test_failed_requests_keep_the_reference_labels() -> None:
    """The error code is a separate family: failed_requests_total's series stay as they were."""
    metrics = Metrics(CollectorRegistry())
    metrics.queue("q", "q", "default").failed_total.inc()
    [family] = [
        f for f in metrics.registry.collect() if f.name == "llm_d_async_async_failed_requests"
    ]
    assert set(family.samples[0].labels) == {"queue_id", "queue_name", "pool_name"}


def test_loop_gauges_export_their_count_and_start_again_at_zero_when_forgotten() -> None:
    """queue_depth and inflight are plain counts (no lock per change), read when scraped."""
    metrics = Metrics(CollectorRegistry())
    queue = metrics.queue("q", "q", "default")
    labels = {"queue_id": "q", "queue_name": "q", "pool_name": "default"}
    sample = metrics.registry.get_sample_value
    queue.inflight.inc()
    queue.inflight.inc()
    queue.queue_depth.inc()
    queue.inflight.dec()
    assert sample("llm_d_async_async_inflight_requests", labels) == 1
    assert sample("llm_d_async_async_queue_depth", labels) == 1
    metrics.forget_queue("q")
    assert sample("llm_d_async_async_inflight_requests", labels) is None
    # A late result of the forgotten queue binds none of its series again.
    metrics.queue("q", "q", "default").failed_total.inc()
    assert sample("llm_d_async_async_inflight_requests", labels) is None
    assert sample("llm_d_async_async_failed_requests_total", labels) is None
    metrics.rebind(("q", "q", "default"))  # served again
    metrics.queue("q", "q", "default").inflight.inc()
    assert sample("llm_d_async_async_inflight_requests", labels) == 1
