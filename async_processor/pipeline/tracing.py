"""Tracing (optional OpenTelemetry): spans around one message's dispatch in a worker.

Input: the ``OTEL_*`` environment at start-up, then each ``Work`` a worker processes and
each ``Outgoing`` request it sends. Output: spans ``process-request`` (parent = the W3C
context in the message ``metadata``), its child ``http-request`` around the POST, and a
detached ``re-enqueue`` span linked to ``process-request`` when the message goes back to
the broker; W3C ``traceparent``/``tracestate``/``baggage`` headers on the outgoing request.

Tracing is on only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and the ``[otel]`` extra is
installed. Otherwise every call returns a shared no-op object and opentelemetry is never
imported, so the daemon runs without the extra and pays ~nothing per message. The SDK
itself reads ``OTEL_EXPORTER_OTLP_INSECURE``, ``OTEL_TRACES_SAMPLER(_ARG)`` and
``OTEL_RESOURCE_ATTRIBUTES``; the service name defaults to ``llm-d-async``.

Attribute names are upstream's (``gen_ai.request.id``, ``gen_ai.request.model``,
``llm_d.async.queue.id`` / ``.queue.name`` / ``.retry_count`` / ``.error.category``); the
names of before (``request.id``, ``queue.id``, ``queue.name``, ``retry.count``,
``error.category``) are set beside them for one more release (``LEGACY_NAMES``), as
upstream does, so trace queries can move over.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec
import structlog

from async_processor.logs import mask_url
from async_processor.messages import ErrorCode
from async_processor.retry import Attempt, Final, HandBack, Retry

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from async_processor.transforms.base import Outgoing
    from async_processor.work import Work

log = structlog.get_logger(__name__)

REQUEST_ID = "gen_ai.request.id"
REQUEST_MODEL = "gen_ai.request.model"
QUEUE_ID = "llm_d.async.queue.id"
QUEUE_NAME = "llm_d.async.queue.name"
RETRY_COUNT = "llm_d.async.retry_count"
ERROR_CATEGORY = "llm_d.async.error.category"
# Set beside the current names until the next release (deprecated; CHANGELOG).
LEGACY_NAMES = {
    REQUEST_ID: "request.id",
    QUEUE_ID: "queue.id",
    QUEUE_NAME: "queue.name",
    RETRY_COUNT: "retry.count",
    ERROR_CATEGORY: "error.category",
}


def _named(attributes: dict[str, str | int]) -> dict[str, str | int]:
    """``attributes`` under their current names and, where there is one, the old too."""
    return attributes | {LEGACY_NAMES[k]: v for k, v in attributes.items() if k in LEGACY_NAMES}


class _Model(msgspec.Struct):
    model: str = ""


def request_model(work: Work) -> str:
    """The request's ``model`` field, else its payload's (upstream's fallback); "" when
    neither says. Read only while a span records: the payload is parsed for one key."""
    request = work.envelope.request
    model = request.extra.get("model")
    if isinstance(model, str) and model:
        return model
    try:
        return msgspec.json.decode(request.payload, type=_Model).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""  # not an object, or a model that is no string: said nowhere


ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
DEFAULT_SERVICE_NAME = "llm-d-async"
TRACER_NAME = "llm-d-async"
CARRIER_KEYS = ("traceparent", "tracestate", "baggage")

# Result error codes that mean "the request itself is wrong" (the reference's INVALID_REQ).
_INVALID_CODES = frozenset((ErrorCode.INVALID_REQUEST.value, ErrorCode.PAYLOAD_UNAVAILABLE.value))


class _Tracing:
    """The enabled state: one tracer, one propagator, the provider to flush at exit."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.baggage.propagation import W3CBaggagePropagator
        from opentelemetry.propagators.composite import CompositePropagator
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(TRACER_NAME)
        self.propagator: TextMapPropagator = CompositePropagator(
            [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
        )


_state: _Tracing | None = None


def enabled() -> bool:
    return _state is not None


def setup(env: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on from the environment (the daemon's start); True if it is on."""
    endpoint = env.get(ENDPOINT_ENV, "")
    if not endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing_unavailable", reason="install the [otel] extra", endpoint=endpoint)
        return False
    # The exporter reads the endpoint, OTEL_EXPORTER_OTLP_INSECURE, headers and timeouts.
    install(_provider(env), BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing_enabled", endpoint=mask_url(endpoint))
    return True


def _provider(env: Mapping[str, str]) -> TracerProvider:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; the sampler
    # comes from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG inside TracerProvider.
    resource = Resource.create()
    if not env.get(SERVICE_NAME_ENV) and str(resource.attributes.get(SERVICE_NAME, "")).startswith(
        "unknown_service"
    ):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return TracerProvider(resource=resource)


def install(provider: TracerProvider, processor: SpanProcessor | None = None) -> None:
    """Use ``provider`` for every span (tests pass one with an in-memory exporter).

    ``processor`` (a span processor) is added to the provider first when given.
    """
    global _state
    if processor is not None:
        provider.add_span_processor(processor)
    _state = _Tracing(provider)


def install_exporter(exporter: SpanExporter) -> TracerProvider:
    """A fresh provider exporting each span synchronously to ``exporter`` (tests)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    install(provider, SimpleSpanProcessor(exporter))
    return provider


def shutdown() -> None:
    """Flush pending spans and turn tracing off (the daemon's exit; idempotent)."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


def process_request(work: Work) -> NoSpan:
    """The ``process-request`` span for one message (a context manager)."""
    return NO_SPAN if _state is None else _ProcessSpan(_state, work)


def http_request(out: Outgoing) -> NoSpan:
    """The ``http-request`` span around one POST; injects trace headers into ``out``."""
    return NO_SPAN if _state is None else _HttpSpan(_state, out)


class NoSpan:
    """Disabled tracing: every hook does nothing (one shared instance)."""

    __slots__ = ()

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(exc)

    def _close(self, exc: BaseException | None) -> None:
        """End the span (a live one); ``exc`` is what the body raised, if anything."""

    def settled(self, outcome: Final | Retry | HandBack) -> None:
        """The message's outcome (process-request)."""

    def answered(self, attempt: Attempt) -> None:
        """The attempt's outcome (http-request)."""


NO_SPAN = NoSpan()


class _LiveSpan(NoSpan):
    """A started span made current until ``__exit__``, which records what the body raised."""

    __slots__ = ("_span", "_state", "_token")

    def __init__(self, state: _Tracing) -> None:
        self._state = state

    def _activate(self, span: Span, parent: Context | None = None) -> Context:
        """Make ``span`` (a child of ``parent``) current; the context it runs in."""
        from opentelemetry import context, trace

        self._span = span
        ctx = trace.set_span_in_context(span, parent)
        self._token = context.attach(ctx)
        return ctx

    def _close(self, exc: BaseException | None) -> None:
        from opentelemetry import context

        context.detach(self._token)
        if isinstance(exc, Exception):
            self._span.record_exception(exc)
        if exc is not None:
            self._failed(exc)
        self._span.end()

    def _failed(self, exc: BaseException) -> None:
        """The body raised (the exception is recorded; the span is not ended yet)."""


class _ProcessSpan(_LiveSpan):
    __slots__ = ("_work",)

    def __init__(self, state: _Tracing, work: Work) -> None:
        super().__init__(state)
        self._work = work

    def __enter__(self) -> NoSpan:
        request = self._work.envelope.request
        carrier = {k: request.metadata[k] for k in CARRIER_KEYS if request.metadata.get(k)}
        parent = self._state.propagator.extract(carrier) if carrier else None
        attributes: dict[str, str | int] = {
            REQUEST_ID: request.id,
            RETRY_COUNT: self._work.envelope.routing.retry_count,
        }
        model = request_model(self._work)
        if model:
            attributes[REQUEST_MODEL] = model
        queue = self._work.queue
        if queue.id:
            attributes[QUEUE_ID] = queue.id
        if queue.name:
            attributes[QUEUE_NAME] = queue.name
        span = self._state.tracer.start_span(
            "process-request", context=parent, attributes=_named(attributes)
        )
        self._activate(span, parent)
        return self

    def _failed(self, exc: BaseException) -> None:
        # The worker hands the message back whenever processing raises (the drain
        # timeout cancelling an in-flight call included).
        self._reenqueue()

    def settled(self, outcome: Final | Retry | HandBack) -> None:
        if isinstance(outcome, HandBack):
            self._reenqueue()
        elif isinstance(outcome, Retry):
            self._span.add_event("retry_scheduled", {"retry.delay": round(outcome.delay, 3)})
        elif outcome.result.error_code:
            code = outcome.result.error_code
            category = "INVALID_REQ" if code in _INVALID_CODES else "UNKNOWN"
            _fail(self._span, category, code)
        elif outcome.result.status_code >= 400:
            _fail(self._span, _category(outcome.result.status_code, False) or "UNKNOWN", "")

    def _reenqueue(self) -> None:
        from opentelemetry.context import Context
        from opentelemetry.trace import Link

        # A new root: the hand-back is not part of this attempt, only related to it.
        span = self._state.tracer.start_span(
            "re-enqueue",
            context=Context(),
            links=[Link(self._span.get_span_context())],
            attributes=_named({REQUEST_ID: self._work.envelope.request.id}),
        )
        span.end()


class _HttpSpan(_LiveSpan):
    __slots__ = ("_out", "_parent")

    def __init__(self, state: _Tracing, out: Outgoing) -> None:
        super().__init__(state)
        self._out = out

    def __enter__(self) -> NoSpan:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self._parent = trace.get_current_span()
        span = self._state.tracer.start_span(
            "http-request",
            kind=SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "url.full": mask_url(self._out.url)},
        )
        ctx = self._activate(span)
        # A copy: the caller's headers stay as built (retries rebuild them anyway).
        headers = dict(self._out.headers)
        self._state.propagator.inject(headers, context=ctx)
        self._out.headers = headers
        return self

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, Exception):
            _fail(self._span, "UNKNOWN", type(exc).__name__)

    def answered(self, attempt: Attempt) -> None:
        if attempt.status:
            self._span.set_attribute("http.response.status_code", attempt.status)
        category = _category(attempt.status, attempt.fatal)
        if category is not None:
            description = attempt.describe()
            _fail(self._span, category, description)
            # The parent shows why the message did not succeed without opening children.
            self._parent.set_attributes(_named({ERROR_CATEGORY: category}))


def _category(status: int, fatal: bool) -> str | None:
    """The reference's error category of one attempt; None for a success."""
    if status == 0:
        return "INVALID_REQ" if fatal else "UNKNOWN"
    if status == 429:
        return "RATE_LIMIT"
    if 400 <= status < 500:
        return "INVALID_REQ"
    if 500 <= status < 600:
        return "SERVER_ERROR"
    return None


def _fail(span: Span, category: str, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attributes(_named({ERROR_CATEGORY: category}))
    span.set_status(Status(StatusCode.ERROR, description or category))
