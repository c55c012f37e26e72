"""Tracing: a real Worker against the in-process simulator, spans in the SDK's memory exporter.

Checks the span tree (process-request <- metadata traceparent, http-request child), the
attributes and error categories, the re-enqueue span at a drain-timeout abort, the trace
headers the gateway receives, and that disabled tracing sends none and never imports
opentelemetry. ``setup`` from the environment exports over real OTLP gRPC to a local
collector stub.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from async_processor.config import TransformConfig
from async_processor.config.queues import QueueSpec
from async_processor.httpclients.base import HttpClient
from async_processor.messages import decode_envelope
from async_processor.metrics import Metrics
from async_processor.pipeline import tracing
from async_processor.pipeline.capacity import PoolCapacity
from async_processor.pipeline.dispatch import DispatchSettings
from async_processor.pipeline.results import Op
from async_processor.pipeline.settle import Settler
from async_processor.pipeline.worker import Aborter, Worker
from async_processor.transforms import build_transform_chain
from async_processor.transforms.base import TransformContext
from async_processor.transports.base import Completion, Deferral, Delivery, Transport
from async_processor.work import Work
from tests.fixtures.inprocess import http_client
from tests.fixtures.otlp import OtlpCollector
from tests.fixtures.servers import free_port
from tests.fixtures.simulator import LocalSimulator

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    tracing.install_exporter(spans)
    yield spans
    tracing.shutdown()


class _NeverCancelled:
    kind = "redis-sortedset"  # the worker reads it for the result size limit

    async def is_cancelled(self, delivery: Delivery) -> bool:
        return False


def _work(gateway: str, request_id: str = "r1", **extra: Any) -> Work:
    queue = QueueSpec(id="qid", name="qname", igw_base_url=gateway)
    body = {"id": request_id, "deadline": int(time.time()) + 60, "payload": {"p": 1}, **extra}
    raw = json.dumps(body).encode()
    return Work(
        Delivery(queue=queue, raw=raw), decode_envelope(raw), Metrics().queue("q", "q", "p")
    )


def _worker(http: HttpClient, writer: MemoryObjectSendStream[Op]) -> Worker:
    transport: Transport = _NeverCancelled()  # type: ignore[assignment]
    return Worker(
        pool="p",
        settings=DispatchSettings(request_timeout=5.0),
        http=http,
        transport=transport,
        settler=Settler(transport=transport, writer=writer, capacity=PoolCapacity(1)),
        transforms=build_transform_chain(TransformConfig(), TransformContext()),
        stopping=anyio.Event(),
        aborter=Aborter(),
    )


async def _handle(work: Work) -> list[Op]:
    """One message through a real Worker; what it wrote to the result writer."""
    send, receive = anyio.create_memory_object_stream[Op](4)
    async with http_client() as http:
        await _worker(http, send).handle(work)
    send.close()
    async with receive:
        return [op async for op in receive]


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def _traceparent(headers: dict[str, str]) -> list[str]:
    value = next(v for k, v in headers.items() if k.lower() == "traceparent")
    return value.split("-")


@pytest.mark.anyio
async def test_spans_follow_metadata_traceparent_and_reach_the_gateway(
    exporter: InMemorySpanExporter, local_simulator: LocalSimulator
) -> None:
    metadata = {"traceparent": TRACEPARENT, "baggage": "tenant=acme"}
    ops = await _handle(_work(local_simulator.url, metadata=metadata))
    assert isinstance(ops[0], Completion)
    assert ops[0].result.status_code == 200

    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {"process-request", "http-request"}
    process, http = spans["process-request"], spans["http-request"]
    assert process.parent is not None
    assert f"{process.context.trace_id:032x}" == TRACE_ID
    assert f"{process.parent.span_id:016x}" == PARENT_SPAN
    assert dict(process.attributes or {}) == {
        # upstream's names, and the old ones beside them for one more release
        "gen_ai.request.id": "r1",
        "llm_d.async.retry_count": 0,
        "llm_d.async.queue.id": "qid",
        "llm_d.async.queue.name": "qname",
        "request.id": "r1",
        "retry.count": 0,
        "queue.id": "qid",
        "queue.name": "qname",
    }
    assert http.parent is not None and http.parent.span_id == process.context.span_id
    assert http.kind is SpanKind.CLIENT
    assert http.attributes is not None
    assert http.attributes["http.request.method"] == "POST"
    assert http.attributes["url.full"] == f"{local_simulator.url}/v1/completions"
    assert http.attributes["http.response.status_code"] == 200
    assert http.status.status_code is StatusCode.UNSET

    (received,) = local_simulator.requests()
    version, trace_id, parent_id, _flags = _traceparent(received["headers"])
    assert (version, trace_id) == ("00", TRACE_ID)
    assert parent_id == f"{http.context.span_id:016x}"  # the gateway's parent is the HTTP span
    baggage = next(v for k, v in received["headers"].items() if k.lower() == "baggage")
    assert "tenant=acme" in baggage


@pytest.mark.anyio
async def test_without_metadata_a_new_trace_starts_here(
    exporter: InMemorySpanExporter, local_simulator: LocalSimulator
) -> None:
    work = _work(local_simulator.url)
    work.envelope.routing.retry_count = 3
    await _handle(work)
    process = _by_name(exporter.get_finished_spans())["process-request"]
    assert process.parent is None
    assert process.attributes is not None and process.attributes["retry.count"] == 3
    assert process.attributes["llm_d.async.retry_count"] == 3
    (received,) = local_simulator.requests()
    assert _traceparent(received["headers"])[1] == f"{process.context.trace_id:032x}"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "category"), [(503, "SERVER_ERROR"), (429, "RATE_LIMIT"), (400, "INVALID_REQ")]
)
async def test_http_failures_carry_an_error_category(
    exporter: InMemorySpanExporter, local_simulator: LocalSimulator, status: int, category: str
) -> None:
    local_simulator.configure(error_rate=1.0, error_status=status)
    ops = await _handle(_work(local_simulator.url))
    retried = isinstance(ops[0], Deferral)
    assert retried == (status != 400)
    spans = _by_name(exporter.get_finished_spans())
    http, process = spans["http-request"], spans["process-request"]
    assert http.attributes is not None and process.attributes is not None
    assert http.attributes["http.response.status_code"] == status
    assert http.attributes["error.category"] == category
    assert http.attributes["llm_d.async.error.category"] == category
    assert http.status.status_code is StatusCode.ERROR
    assert process.attributes["error.category"] == category
    assert process.attributes["llm_d.async.error.category"] == category
    assert [e.name for e in process.events] == (["retry_scheduled"] if retried else [])


@pytest.mark.anyio
async def test_no_response_is_unknown(exporter: InMemorySpanExporter) -> None:
    await _handle(_work(f"http://127.0.0.1:{free_port()}"))  # nothing listens there
    http = _by_name(exporter.get_finished_spans())["http-request"]
    assert http.attributes is not None
    assert http.attributes["error.category"] == "UNKNOWN"
    assert "http.response.status_code" not in http.attributes
    assert http.status.status_code is StatusCode.ERROR


@pytest.mark.anyio
async def test_invalid_message_fails_the_process_span_without_http(
    exporter: InMemorySpanExporter, local_simulator: LocalSimulator
) -> None:
    await _handle(_work(local_simulator.url, endpoint="http://elsewhere/x"))
    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {"process-request"}
    process = spans["process-request"]
    assert process.status.status_code is StatusCode.ERROR
    assert process.attributes is not None
    assert process.attributes["error.category"] == "INVALID_REQ"
    assert process.attributes["llm_d.async.error.category"] == "INVALID_REQ"


@pytest.mark.anyio
async def test_abort_at_drain_timeout_records_a_linked_reenqueue_span(
    exporter: InMemorySpanExporter, local_simulator: LocalSimulator
) -> None:
    local_simulator.configure(hang_rate=1.0)
    send, receive = anyio.create_memory_object_stream[Op](4)
    async with http_client() as http:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_worker(http, send).handle, _work(local_simulator.url, "abort-me"))
                while local_simulator.stats()["running"] < 1:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()  # what the drain timeout does to in-flight calls
    op = receive.receive_nowait()
    assert isinstance(op, Deferral) and op.delay == 0.0

    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {"process-request", "http-request", "re-enqueue"}
    process, requeue = spans["process-request"], spans["re-enqueue"]
    assert requeue.parent is None  # detached: a root of its own
    assert requeue.context.trace_id != process.context.trace_id
    assert [link.context.span_id for link in requeue.links] == [process.context.span_id]
    assert dict(requeue.attributes or {}) == {
        "gen_ai.request.id": "abort-me",
        "request.id": "abort-me",
    }


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("extra", "model"),
    [
        ({"model": "from-request", "payload": {"model": "from-payload"}}, "from-request"),
        ({"payload": {"prompt": "p", "model": "from-payload"}}, "from-payload"),
        ({"payload": {"model": 7}}, None),  # not a string: said nowhere
        ({"payload": {"p": 1}}, None),
    ],
)
async def test_the_request_model_is_the_requests_else_its_payloads(
    exporter: InMemorySpanExporter,
    local_simulator: LocalSimulator,
    extra: dict[str, Any],
    model: str | None,
) -> None:
    await _handle(_work(local_simulator.url, **extra))
    process = _by_name(exporter.get_finished_spans())["process-request"]
    assert (process.attributes or {}).get("gen_ai.request.model") == model


@pytest.mark.anyio
async def test_disabled_tracing_adds_no_headers_and_no_spans(
    local_simulator: LocalSimulator,
) -> None:
    spans = InMemorySpanExporter()
    tracing.install_exporter(spans)
    tracing.shutdown()  # on, then off again: nothing may leak from the old provider
    assert not tracing.enabled()
    await _handle(_work(local_simulator.url, metadata={"traceparent": TRACEPARENT}))
    (received,) = local_simulator.requests()
    names = {k.lower() for k in received["headers"]}
    assert not names & {"traceparent", "tracestate", "baggage"}
    assert spans.get_finished_spans() == ()


def test_disabled_path_never_imports_opentelemetry() -> None:
    code = (
        "import sys, anyio\n"
        "from async_processor.pipeline import processor, tracing\n"
        "assert tracing.setup({}) is False\n"
        "with tracing.process_request(None) as s:\n"
        "    s.settled(None)\n"
        "    with tracing.http_request(None) as h: h.answered(None)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.strip() == "[]"


def test_endpoint_without_the_extra_stays_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    monkeypatch.setitem(sys.modules, name, None)
    assert tracing.setup({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}) is False
    assert not tracing.enabled()


@pytest.mark.anyio
async def test_setup_from_env_exports_over_otlp_grpc(
    monkeypatch: pytest.MonkeyPatch,
    otlp_collector: OtlpCollector,
    local_simulator: LocalSimulator,
) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"127.0.0.1:{otlp_collector.port}",  # INSECURE decides
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=pod-1",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "1.0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    try:
        assert tracing.setup()
        await _handle(_work(local_simulator.url, metadata={"traceparent": TRACEPARENT}))
    finally:
        tracing.shutdown()  # flushes the batch processor
    received = otlp_collector.spans()
    resource = received[0][0]
    assert resource["service.name"] == "llm-d-async"
    assert resource["k8s.pod.name"] == "pod-1"
    spans = [span for _, span in received]
    assert sorted(s.name for s in spans) == ["http-request", "process-request"]
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}


def test_service_name_and_sampler_come_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-async")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider: TracerProvider = tracing._provider({"OTEL_SERVICE_NAME": "my-async"})
    assert provider.resource.attributes["service.name"] == "my-async"
    assert "0.25" in provider.sampler.get_description()
    provider.shutdown()
