"""Readiness of gcp-pubsub: the last outcome of the RPCs on each subscription and topic.

Every RPC runs in ``rpc(resource, action)``, which records its outcome and turns a Google
API failure into ``TransportError``. ``/readyz`` fails while a resource's latest outcome is
a recent error, and a resource not heard from within ``HEALTH_WINDOW`` is probed first.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from google.api_core import exceptions as gexc
from google.auth.exceptions import GoogleAuthError

from async_processor.broker_errors import broker_error
from async_processor.errors import TransportError
from async_processor.transports.gcp_pubsub.leases import ACK_ID_ERRORS

HEALTH_WINDOW = 30.0  # a pull/publish outcome newer than this decides readiness


@dataclass(slots=True)
class _Status:
    ok_at: float = -math.inf
    error_at: float = -math.inf
    error: str = ""


class Readiness:
    def __init__(self) -> None:
        self._status: dict[str, _Status] = defaultdict(_Status)  # resource -> last outcome

    @contextmanager
    def rpc(self, resource: str, action: str) -> Iterator[None]:
        """Record the outcome for readiness; a Google API failure becomes TransportError."""
        try:
            yield
        except (gexc.GoogleAPIError, GoogleAuthError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            broker_error(action)
            if not isinstance(exc, ACK_ID_ERRORS):  # about some ack ids, not the resource
                status = self._status[resource]
                status.error_at, status.error = time.monotonic(), error
            raise TransportError(f"pubsub {action} on {resource} failed: {error}") from exc
        self.ok(resource)

    def ok(self, resource: str) -> None:
        self._status[resource].ok_at = time.monotonic()

    def needs_probe(self, resource: str) -> bool:
        """Raise TransportError on a recent error; True when nothing recent is known."""
        now = time.monotonic()
        status = self._status[resource]
        if status.error_at > status.ok_at and now - status.error_at < HEALTH_WINDOW:
            raise TransportError(f"pubsub {resource}: {status.error}")
        return now - status.ok_at >= HEALTH_WINDOW
