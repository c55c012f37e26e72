"""Worker, N per pool: admit, transform, send, classify, then settle. One message at a time.

Input: ``Work`` items from the pool's merged stream. Output: one outcome per message,
given to the ``Settler`` (a result or a hand-back on the result writer's stream, the
slot and gate permits back). The HTTP side (building and sending the request) is
``dispatch``; the retry policy is ``retry``.
"""

from __future__ import annotations

import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
import structlog
from anyio.abc import ObjectReceiveStream

from async_processor.errors import InvalidMessage, PayloadUnavailable, TransportError
from async_processor.gates.base import Observes
from async_processor.httpclients.base import HttpClient
from async_processor.messages import CANCELLED_TEXT, Envelope, ErrorCode, Result
from async_processor.pipeline import tracing
from async_processor.pipeline.admission import PoolGate, admit
from async_processor.pipeline.cancels import CancelWatch
from async_processor.pipeline.capacity import ShedPause
from async_processor.pipeline.dispatch import (
    DispatchSettings,
    attempt_timeout,
    build_request,
    send,
    stamp_inference_ttl,
)
from async_processor.pipeline.held import HeldWork
from async_processor.pipeline.settle import Settler
from async_processor.pipeline.usage import TokenAccounting
from async_processor.retry import (
    Attempt,
    Counter,
    Final,
    HandBack,
    Outcome,
    Retry,
    decide,
    expired,
    last_answer,
    remember_answer,
)
from async_processor.transforms import TransformChain
from async_processor.transforms.base import Outgoing
from async_processor.transports.base import LetsGo, LimitsResults, Transport
from async_processor.work import Work, take

log = structlog.get_logger(__name__)

CANCEL_RECHECK = 1.0  # s since fetch after which the worker asks the broker again
# A message's scope ends this long after its deadline: the HTTP attempt's own timeout ends
# at the deadline, so a call cut there is reported (and told to gates that learn) as any
# timeout; the scope bounds every other wait (pool gate, transforms, shed pause).
DEADLINE_GRACE = 0.2


class Aborter:
    """The in-flight work of every worker, so the drain timeout can cut exactly that."""

    def __init__(self) -> None:
        self._scopes: set[anyio.CancelScope] = set()
        self.aborted = False

    def open(self, deadline: float = math.inf) -> anyio.CancelScope:
        """A scope for one message's work, until ``deadline`` (``anyio.current_time``),
        cancelled at once when aborted already; give it to ``close`` when done."""
        scope = anyio.CancelScope(deadline=deadline)
        if self.aborted:
            scope.cancel()
        self._scopes.add(scope)
        return scope

    def close(self, scope: anyio.CancelScope) -> None:
        self._scopes.discard(scope)

    def abort(self) -> None:
        self.aborted = True
        for scope in list(self._scopes):
            scope.cancel()

    def __len__(self) -> int:
        return len(self._scopes)


@dataclass(slots=True, kw_only=True)
class Worker:
    """A pool's workers: admit, transform, send, classify, settle. Each of the pool's N
    tasks (``run``) handles one message at a time; what they share lives here."""

    pool: str
    settings: DispatchSettings
    http: HttpClient
    transport: Transport
    settler: Settler  # the pool's: its sender of the writer closes after the last task
    transforms: TransformChain
    stopping: anyio.Event
    aborter: Aborter
    held: HeldWork | None = None  # the pool's: answers at its deadline what waits for us
    pool_gate: PoolGate | None = None
    shed_pause: ShedPause | None = None  # shared by the pool's workers
    cancels: CancelWatch | None = None  # None: a cancel is honoured before dispatch only
    tokens: TokenAccounting | None = None  # None: answers' usage is not counted
    # Asked once: isinstance on a runtime-checkable Protocol costs ~8 us per message.
    observer: Observes | None = field(init=False, default=None)
    lets_go: LetsGo | None = field(init=False, default=None)
    result_limit: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        gate = self.pool_gate.gate if self.pool_gate else None
        self.observer = gate if isinstance(gate, Observes) else None
        self.lets_go = self.transport if isinstance(self.transport, LetsGo) else None
        if isinstance(self.transport, LimitsResults):
            self.result_limit = self.transport.max_result_bytes

    async def serve(self, tasks: int, stream: ObjectReceiveStream[Work]) -> None:
        """The pool's ``tasks`` worker tasks, all taking from one stream with this worker
        and its settler, and the expiry of what waits for them (``held``), until the last
        task ends. A stream clone, a settler and a Worker per task were ~0.9 KB each, 9 MB
        at 10,000 workers (issue 13). The stream, and the settler's sender of the result
        writer, close once every task has ended, as each task's own did before."""
        async with stream, aclosing(self.settler), anyio.create_task_group() as pool:
            if self.held is not None:
                pool.start_soon(self.held.run)
            async with anyio.create_task_group() as tg:
                for _ in range(tasks):
                    tg.start_soon(self.run, stream)
            pool.cancel_scope.cancel()

    async def run(self, stream: ObjectReceiveStream[Work]) -> None:
        """One worker task: a message at a time until the stream ends. A pool's tasks share
        this object and the stream; ``processor._serve`` closes both once they are done."""
        while True:
            try:
                work = await take(stream)
            except anyio.EndOfStream:
                return
            if self.held is not None and not self.held.take(work):
                work.metrics.queue_depth.dec()  # answered at its deadline while it waited
                continue
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
                with tracing.process_request(work) as span:
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
            await self._settle(work, outcome)

    async def _settle(self, work: Work, outcome: Outcome) -> None:
        """Shielded; a write that must wait is bounded (``Settler.settle_within``). Most
        writes find room at once and start no timer (a timed scope per message was ~4 % of
        its instructions: issue 13); the gate's permits come back under a shield, as the
        poller gives back those of a message it does not send."""
        if self.settler.hand_over(work, outcome):
            with anyio.CancelScope(shield=True):
                await self.settler.give_back(work)
            return
        await self.settler.settle_within(work, outcome)

    async def _watched(self, work: Work) -> Outcome:
        """``_process`` in the message's one cancel scope (docs/architecture.md G7), which
        ends at its deadline (answered as expired), at the pool gate's wait limit while it
        is admitted (handed back), at the drain timeout (handed back at once) or at the
        producer's cancel (``CANCELLED``). Every wait inside is bounded by it, not by each
        step's goodwill. One scope serves all: a scope costs ~0.7 KB while its request is
        in flight, and its entry and exit ~2 µs (issue 13)."""
        request = work.envelope.request
        ends = anyio.current_time() + (request.deadline - time.time()) + DEADLINE_GRACE
        scope = self.aborter.open(ends)
        if self.cancels is not None:
            self.cancels.add(work.delivery, scope)
        try:
            with scope:
                return await self._process(work, scope)
        finally:
            self.aborter.close(scope)
            if self.cancels is not None:
                self.cancels.discard(work.delivery)
        if self.aborter.aborted:
            return HandBack(0.0)
        if anyio.current_time() >= scope.deadline:
            if scope.deadline < ends:  # the pool gate's wait limit, set while admitting
                work.metrics.gate_wait_requeues_total.inc()
                return HandBack(0.0)
            return expired(request.id, last_answer(work.envelope.routing))
        return _failure(request.id, ErrorCode.CANCELLED, CANCELLED_TEXT, None)

    async def _process(self, work: Work, scope: anyio.CancelScope) -> Outcome:
        envelope = work.envelope
        request = envelope.request
        try:
            self.transforms.validate(envelope)
            if self.pool_gate is not None:
                verdict = await self._admit(work, self.pool_gate, scope)
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

    async def _admit(
        self, work: Work, gate: PoolGate, scope: anyio.CancelScope
    ) -> Final | HandBack | None:
        """The pool gate's verdict, its wait (a Wait, or a gate that blocks in ``apply``)
        bounded by ``--gate-wait-timeout`` on the message's scope, as well as by the
        deadline: one rule for every gate that can wait."""
        ends = scope.deadline
        scope.deadline = min(ends, anyio.current_time() + gate.wait_timeout)
        verdict = await admit(work, gate, work.releases, self.stopping)
        scope.deadline = ends  # admitted or ended: only the deadline bounds the rest
        return verdict

    async def _attempt(self, work: Work, out: Outgoing) -> Outcome:
        envelope = work.envelope
        request = envelope.request
        if self.shed_pause is not None:  # first: the attempt's budget starts after the pause
            await self.shed_pause.wait()
        timeout = attempt_timeout(request.deadline, self.settings.request_timeout)
        if timeout <= 0:
            return expired(request.id, last_answer(envelope.routing))
        limit = self.result_limit
        if self.lets_go is not None:  # its bytes wait in the broker, not here (issue 13)
            self.lets_go.let_go(work.delivery)
        if self.settings.inference_ttl:
            stamp_inference_ttl(out, time.time())
        work.metrics.dispatched_total.inc()
        started = time.monotonic()
        with tracing.http_request(out) as span:
            attempt = await send(self.http, out, timeout=timeout, limit=limit)
            span.answered(attempt)
        latency = time.monotonic() - started
        if self.tokens is not None and 200 <= attempt.status < 300:  # count() never raises
            self.tokens.count(work.metrics.labels, request.metadata, attempt.body)
        self._observe(work, attempt, latency)
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

    def _observe(self, work: Work, attempt: Attempt, latency: float) -> None:
        """The attempt's metrics, the shed pause and the learning gates."""
        work.metrics.inference_latency.observe(latency * 1000)
        if attempt.reason:
            work.metrics.no_answer(attempt.reason)
        if attempt.shed:
            work.metrics.shedded_total.inc()
            if self.shed_pause is not None:
                self.shed_pause.shed(attempt.retry_after)
        self._feedback(work.envelope, attempt, latency)

    def _feedback(self, envelope: Envelope, attempt: Attempt, latency: float) -> None:
        """Gates that learn from outcomes (adaptive-concurrency, pool-headroom) get every
        attempt."""
        if self.observer is not None:
            self.observer.observe(envelope, attempt.status or None, latency, attempt.dropped_reason)

    async def _cancelled(self, work: Work) -> bool:
        """The poller checked at fetch; a message that waited since (for a worker, or at
        the pool gate) is asked again before it is sent. Not redundant with ``cancels``:
        the watch sees a message only once a worker holds it, and the worker sends at once,
        before the watch's next round, so a quick answer would beat a cancel made while it
        waited (tests/integration/test_cancel_inflight.py)."""
        if time.time() - work.delivery.received_at < CANCEL_RECHECK:
            return False
        try:
            return await self.transport.is_cancelled(work.delivery)
        except TransportError:
            return False


def _failure(request_id: str, code: ErrorCode, text: str, counter: Counter | None) -> Final:
    return Final(Result.failure(request_id, code, text), counter)
