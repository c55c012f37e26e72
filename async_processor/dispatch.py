"""HTTP dispatch: build the gateway request for one message and send one attempt.

Input: a ``Work`` item (admitted) and the settings that shape requests. Output: an
``Outgoing`` request (URL, headers, verbatim body) and, after sending, a ``retry.Attempt``.
The attempt is cut at min(deadline, now + request timeout); the deadline also reaches
the gateway as a header (docs/architecture.md G7), and so does the trace context when tracing is on.
"""

from __future__ import annotations

import posixpath
import ssl
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp
import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from async_processor import tracing
from async_processor.admission import HandBack, PoolGate, admit
from async_processor.cancels import CancelWatch
from async_processor.config import TLSConfig
from async_processor.errors import ConfigError, InvalidMessage, PayloadUnavailable, TransportError
from async_processor.gates.base import Observes
from async_processor.merge.headers import (
    DEFAULT_FAIRNESS_HEADER,
    apply_stamped,
    is_valid_header_name,
    is_valid_header_value,
)
from async_processor.merge.tier_priority import DEFAULT_OBJECTIVE_HEADER, DEFAULT_PRIORITY_HEADER
from async_processor.messages import (
    CANCELLED_TEXT,
    Envelope,
    ErrorCode,
    Result,
)
from async_processor.results import Completion, Op
from async_processor.retry import (
    DROPPED_REASON_HEADER,
    Attempt,
    Counter,
    Final,
    Retry,
    decide,
    expired,
    last_answer,
    parse_retry_after,
    remember_answer,
)
from async_processor.transforms.base import Outgoing
from async_processor.transports.base import Deferral, Transport, abandon
from async_processor.usage import TokenAccounting
from async_processor.work import PoolCapacity, ShedPause, Work, put, take

log = structlog.get_logger(__name__)

OBJECTIVE_HEADER = "x-gateway-inference-objective"
# Never from a message (docs/architecture.md G10): framing and routing headers, and the daemon's own
# (objective, fairness, priority; the deadline header and stamped names are added per
# request). ``Proxy-*`` is refused by prefix.
RESERVED_HEADERS = frozenset(
    (
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        OBJECTIVE_HEADER,
        DEFAULT_FAIRNESS_HEADER,
        DEFAULT_PRIORITY_HEADER,
        DEFAULT_OBJECTIVE_HEADER,
    )
)


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    request_timeout: float = 300.0
    deadline_header: str = "x-request-deadline"
    # Header names the merge policy is configured to stamp (its ``*_header`` parameters),
    # refused from messages like the default names even when not stamped on one.
    stamped_names: frozenset[str] = frozenset()


def stamped_header_names(merge_parameters: Mapping[str, object]) -> frozenset[str]:
    """The lower-cased names of a merge policy's ``*_header`` parameters."""
    return frozenset(
        value.lower()
        for key, value in merge_parameters.items()
        if key.endswith("_header") and isinstance(value, str) and value
    )


def build_request(work: Work, settings: DispatchSettings) -> Outgoing:
    """URL + headers in the reference's order + the payload bytes as sent by the producer.

    Raises ``InvalidMessage`` for an endpoint that is not a path or an illegal header.
    """
    request = work.envelope.request
    queue = work.queue
    url = join_url(queue.igw_base_url, request.endpoint or queue.request_path_url)
    headers = {"Content-Type": "application/json"}
    if queue.inference_objective:
        headers[OBJECTIVE_HEADER] = queue.inference_objective
    _check_caller_headers(work, settings)
    # Caller headers may override Content-Type (as in the reference), in any letter case.
    apply_stamped(headers, list(request.headers.items()))
    apply_stamped(headers, work.stamped_headers)
    if settings.deadline_header:
        apply_stamped(headers, [(settings.deadline_header, str(request.deadline))])
    content_type = next(v for k, v in headers.items() if k.lower() == "content-type")
    return Outgoing(
        url=url,
        body=request.payload,
        headers=headers,
        content_type=content_type,
        deadline=request.deadline,
    )


def _check_caller_headers(work: Work, settings: DispatchSettings) -> None:
    """The message's headers are legal and leave framing, routing and ours alone.

    Framing headers would desynchronise the connection (``Content-Length: 2`` made every
    attempt fail until the deadline), ``Host`` would reach another virtual host, and the
    deadline, objective, priority and fairness headers are the daemon's to set.
    """
    request = work.envelope.request
    reserved = RESERVED_HEADERS | settings.stamped_names
    reserved |= {name.lower() for name, _ in work.stamped_headers}
    if settings.deadline_header:
        reserved |= {settings.deadline_header.lower()}
    for name, value in request.headers.items():
        if not is_valid_header_name(name) or not is_valid_header_value(value):
            raise InvalidMessage(
                f"header {name!r} is not a legal HTTP header",
                reason="bad_header",
                request_id=request.id,
            )
        folded = name.lower()
        if folded in reserved or folded.startswith("proxy-"):
            raise InvalidMessage(
                f"header {name!r} is set by the daemon, not by the message",
                reason="reserved_header",
                request_id=request.id,
            )


@lru_cache(maxsize=1024)
def join_url(base: str, path: str) -> str:
    """``base`` + ``path`` like Go's url.JoinPath; ``path`` must not change the host, nor
    climb out of the base URL's path (``..``, also percent-encoded)."""
    parts = urlsplit(base)
    if "://" in path or path.startswith("//") or "?" in path or "#" in path:
        raise InvalidMessage(f"endpoint {path!r} must be a path, not a URL", reason="bad_endpoint")
    root = "/" + parts.path.strip("/") if parts.path.strip("/") else ""
    joined = _normalized(root, path)
    # The gateway (or a proxy before it) may decode %2e%2e and %2f before resolving dots.
    if not _within(root, _normalized(root, _fully_unquoted(path))):
        raise InvalidMessage(
            f"endpoint {path!r} leaves the base path {root or '/'!r}", reason="bad_endpoint"
        )
    return urlunsplit((parts.scheme, parts.netloc, joined, parts.query, ""))


def _normalized(root: str, path: str) -> str:
    segments = "/".join(s for s in (root.strip("/"), path.strip("/")) if s)
    joined = posixpath.normpath("/" + segments) if segments else "/"
    if path.endswith("/") and not joined.endswith("/"):
        joined += "/"
    return joined.replace("//", "/")  # normpath keeps a leading "//"


def _within(root: str, joined: str) -> bool:
    return not root or joined == root or joined.startswith(root + "/")


def _fully_unquoted(path: str) -> str:
    """``path`` percent-decoded until it stops changing (``%252e`` is ``.`` decoded twice)."""
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    return path


async def send(
    session: aiohttp.ClientSession, out: Outgoing, *, timeout: float, limit: int | None = None
) -> Attempt:
    """One POST; any failure to get a complete answer becomes a no-response ``Attempt``.

    An answer over ``limit`` bytes (default ``MAX_RESPONSE_BYTES``) is a fatal attempt."""
    headers = out.headers
    if out.body_claimed:  # a transform rewrote the body, and its content type goes with it
        headers = dict(headers)
        apply_stamped(headers, [("Content-Type", out.content_type)])
    try:
        async with session.post(
            out.url,
            data=out.body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=max(0.001, timeout)),
            allow_redirects=False,  # a 3xx is the result; never resend body and headers
        ) as response:
            body = await _read_capped(response, limit or MAX_RESPONSE_BYTES)
            return Attempt(
                status=response.status,
                body=body,
                retry_after=parse_retry_after(response.headers.get("Retry-After")),
                dropped_reason=response.headers.get(DROPPED_REASON_HEADER, ""),
            )
    except TimeoutError:
        return Attempt(error=f"attempt timed out after {timeout:.3g}s")
    except ResponseTooLarge as exc:
        return Attempt(error=str(exc), fatal=True)
    except aiohttp.InvalidURL as exc:
        return Attempt(error=f"invalid URL {exc}", fatal=True)
    except (aiohttp.ClientError, OSError) as exc:
        return Attempt(error=f"{type(exc).__name__}: {exc}")


class ResponseTooLarge(Exception):
    pass


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, refusing one larger than ``limit`` (the reference read without a bound)."""
    length = response.content_length
    if length is not None and length <= limit:
        return await response.read()
    if length is not None:
        raise ResponseTooLarge(f"gateway answer of {length} bytes is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ResponseTooLarge(f"gateway answer larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def attempt_timeout(deadline: float, request_timeout: float) -> float:
    """Seconds this attempt may take: min(deadline, now + request timeout)."""
    return min(deadline - time.time(), request_timeout)


def make_session(tls: TLSConfig, workers: int) -> aiohttp.ClientSession:
    """One session for all workers: keep-alive connections, no global cap beyond the workers."""
    connector = aiohttp.TCPConnector(
        limit=max(100, workers),
        limit_per_host=0,
        ssl=ssl_context(tls),
        keepalive_timeout=90,
        enable_cleanup_closed=True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        skip_auto_headers=("User-Agent",),
    )


def ssl_context(tls: TLSConfig) -> ssl.SSLContext | bool:
    if not (tls.ca_cert or tls.cert or tls.insecure_skip_verify):
        return True
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if tls.ca_cert:
            ctx.load_verify_locations(cafile=tls.ca_cert)
        if tls.cert:
            ctx.load_cert_chain(tls.cert, tls.key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-*: cannot load certificates: {exc}") from exc
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class TransformChain(Protocol):
    def validate(self, envelope: Envelope) -> None: ...

    async def apply(self, envelope: Envelope, out: Outgoing) -> None: ...


Outcome = Final | Retry | HandBack
CANCEL_RECHECK = 1.0  # s since fetch after which the worker asks the broker again
SETTLE_TIMEOUT = 10.0
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# The largest encoded result a transport can carry, where that is less than the above.
# Pub/Sub refuses publish requests over 10 MB (10^7 bytes); the headroom is for the
# request's own fields. A bigger answer becomes an INFERENCE_ERROR naming its size
# instead of a publish that fails on every retry until the deadline.
RESULT_LIMITS = {"gcp-pubsub": 10_000_000 - 64 * 1024}


class Aborter:
    """The in-flight work of every worker, so the drain timeout can cut exactly that."""

    def __init__(self) -> None:
        self._scopes: set[anyio.CancelScope] = set()
        self.aborted = False

    @contextmanager
    def scope(self) -> Iterator[None]:
        scope = anyio.CancelScope()
        if self.aborted:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)

    def abort(self) -> None:
        self.aborted = True
        for scope in list(self._scopes):
            scope.cancel()

    def __len__(self) -> int:
        return len(self._scopes)


@dataclass(slots=True)
class Worker:
    """One of a pool's N workers: admit, transform, send, classify, settle. One at a time."""

    pool: str
    settings: DispatchSettings
    session: aiohttp.ClientSession
    transport: Transport
    writer: ObjectSendStream[Op]
    capacity: PoolCapacity
    transforms: TransformChain
    stopping: anyio.Event
    aborter: Aborter
    pool_gate: PoolGate | None = None
    shed_pause: ShedPause | None = None  # shared by the pool's workers
    cancels: CancelWatch | None = None  # None: a cancel is honoured before dispatch only
    tokens: TokenAccounting | None = None  # None: answers' usage is not counted
    # Asked once: isinstance on a runtime-checkable Protocol costs ~0.05 ms per message.
    observer: Observes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        gate = self.pool_gate.gate if self.pool_gate else None
        self.observer = gate if isinstance(gate, Observes) else None

    async def run(self, stream: ObjectReceiveStream[Work]) -> None:
        async with stream, self.writer:
            while True:
                try:
                    work = await take(stream)
                except anyio.EndOfStream:
                    return
                await self.handle(work)

    async def handle(self, work: Work) -> None:
        metrics = work.metrics
        metrics.queue_depth.dec()
        metrics.queue_residence.observe(max(0.0, time.time() - work.delivery.received_at) * 1000)
        if work.envelope.routing.retry_count == 0:
            metrics.request_total.inc()
        outcome: Outcome = HandBack(0.0)  # what a cut (drain timeout) leaves: back at once
        try:
            if not self.stopping.is_set():
                with self.aborter.scope(), tracing.process_request(work) as span:
                    outcome = await self._watched(work)
                    span.settled(outcome)
        except Exception as exc:  # a bug here must not take every worker down with it
            log.exception("worker_error", request_id=work.envelope.id)
            outcome = _failure(
                work.envelope.id,
                ErrorCode.INFERENCE_ERROR,
                f"internal error: {type(exc).__name__}: {exc}",
                Counter.FAILED,
            )
        finally:
            # Shielded, but bounded: a writer that cannot take it in time gets the message
            # abandoned (lease no longer renewed, logged and counted), so it comes back.
            with anyio.move_on_after(SETTLE_TIMEOUT, shield=True) as settling:
                await self._settle(work, outcome)
            if settling.cancelled_caught:
                log.error("settle_timed_out", request_id=work.envelope.id)
                abandon(self.transport, work.delivery, "settle_timeout")

    async def _watched(self, work: Work) -> Outcome:
        """``_process``, cut short (HTTP call aborted) when the producer cancels it."""
        if self.cancels is None:
            return await self._process(work)
        with self.cancels.watch(work.delivery):
            return await self._process(work)
        return _failure(work.envelope.id, ErrorCode.CANCELLED, CANCELLED_TEXT, None)

    async def _process(self, work: Work) -> Outcome:
        envelope = work.envelope
        request = envelope.request
        if request.deadline < time.time():
            return expired(request.id, last_answer(envelope.routing))
        try:
            self.transforms.validate(envelope)
            if self.pool_gate is not None:
                verdict = await admit(work, self.pool_gate, work.releases, self.stopping)
                if verdict is not None:
                    return verdict
            if await self._cancelled(work):
                return _failure(request.id, ErrorCode.CANCELLED, CANCELLED_TEXT, None)
            out = build_request(work, self.settings)
            await self.transforms.apply(envelope, out)
        except (InvalidMessage, ValueError) as exc:
            return _failure(request.id, ErrorCode.INVALID_REQUEST, str(exc), Counter.FAILED)
        except PayloadUnavailable as exc:
            return _failure(request.id, ErrorCode.PAYLOAD_UNAVAILABLE, str(exc), Counter.FAILED)
        work.metrics.inflight.inc()
        try:
            return await self._attempt(work, out)
        finally:
            work.metrics.inflight.dec()

    async def _attempt(self, work: Work, out: Outgoing) -> Outcome:
        envelope = work.envelope
        request = envelope.request
        timeout = attempt_timeout(request.deadline, self.settings.request_timeout)
        if timeout <= 0:
            return expired(request.id, last_answer(envelope.routing))
        limit = RESULT_LIMITS.get(self.transport.kind)
        if self.shed_pause is not None:
            await self.shed_pause.wait()
        started = time.monotonic()
        with tracing.http_request(out) as span:
            attempt = await send(self.session, out, timeout=timeout, limit=limit)
            span.answered(attempt)
        latency = time.monotonic() - started
        if self.tokens is not None and 200 <= attempt.status < 300:
            self.tokens.count(work.queue.name, self.pool, request.metadata, attempt.body)
        work.metrics.inference_latency.observe(latency * 1000)
        if attempt.shed:
            work.metrics.shedded_total.inc()
            if self.shed_pause is not None:
                self.shed_pause.shed(attempt.retry_after)
        self._feedback(envelope, attempt, latency)
        decision = decide(
            request.id,
            attempt,
            deadline=request.deadline,
            retry_count=envelope.routing.retry_count,
            last_http=last_answer(envelope.routing),
        )
        if isinstance(decision, Retry):
            envelope.routing.retry_count += 1
            remember_answer(envelope.routing, attempt)
            work.metrics.retries_total.inc()
            log.debug(
                "request_retry",
                request_id=request.id,
                queue=work.queue.name,
                retry_count=envelope.routing.retry_count,
                delay=round(decision.delay, 3),
                cause=attempt.describe(),
            )
            return decision
        if limit is not None:
            decision = self._fitting(decision, limit)
        if attempt.status == 0 or attempt.status >= 400 or decision.result.error_code:
            log.info(
                "request_failed",
                request_id=request.id,
                queue=work.queue.name,
                cause=decision.result.error_message or attempt.describe(),
            )
        return decision

    def _fitting(self, final: Final, limit: int) -> Final:
        """``final``, or an INFERENCE_ERROR naming the size when the transport can't carry it
        (a gateway answer that JSON escaping made larger than ``limit``)."""
        size = len(final.result.encode())
        if size <= limit:
            return final
        text = (
            f"result of {size} bytes is larger than the {limit} bytes "
            f"a {self.transport.kind} result can carry"
        )
        return _failure(final.result.id, ErrorCode.INFERENCE_ERROR, text, Counter.FAILED)

    def _feedback(self, envelope: Envelope, attempt: Attempt, latency: float) -> None:
        """Gates that learn from outcomes (adaptive-concurrency) get every attempt."""
        if self.observer is not None:
            self.observer.observe(envelope, attempt.status or None, latency, attempt.dropped_reason)

    async def _cancelled(self, work: Work) -> bool:
        # The poller checked at fetch; check again only for messages that waited a while.
        if time.time() - work.delivery.received_at < CANCEL_RECHECK:
            return False
        try:
            return await self.transport.is_cancelled(work.delivery)
        except TransportError:
            return False

    async def _settle(self, work: Work, outcome: Outcome) -> None:
        try:
            if isinstance(outcome, Final):
                _count(work, outcome)
                await put(self.writer, Completion(work.delivery, outcome.result))
            else:
                await put(self.writer, Deferral(work.delivery, outcome.delay))
        finally:
            self.capacity.release()
            await work.releases.release_all()


def _failure(request_id: str, code: ErrorCode, text: str, counter: Counter | None) -> Final:
    return Final(Result.failure(request_id, code, text), counter)


def _count(work: Work, final: Final) -> None:
    m = work.metrics
    if final.counter is Counter.SUCCESS:
        m.successful_total.inc()
    elif final.counter is Counter.FAILED:
        m.failed_total.inc()
    elif final.counter is Counter.DEADLINE:
        m.exceeded_deadline_total.inc()
