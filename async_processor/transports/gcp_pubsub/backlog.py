"""Pub/Sub backlog from Cloud Monitoring (the reference's broker-backlog source).

Stage: broker backlog for the gcp-pubsub transport. Input: a subscription path. Output:
the newest ``pubsub.googleapis.com/subscription/num_undelivered_messages`` point of the
last five minutes, or None when unknown (emulator, no credentials, no data, an error).
Unknown is not zero: the gauge is left alone rather than reporting an empty broker.

Uses Application Default Credentials (refreshed in a worker thread: google-auth's token
refresh is synchronous) and aiohttp for the REST call, so no extra client library.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
import anyio
import google.auth
import structlog
from google.auth.transport.requests import Request

log = structlog.get_logger(__name__)

MONITORING_URL = "https://monitoring.googleapis.com/v3"
METRIC = "pubsub.googleapis.com/subscription/num_undelivered_messages"
SCOPE = "https://www.googleapis.com/auth/monitoring.read"
WINDOW_SECONDS = 300
TIMEOUT = aiohttp.ClientTimeout(total=10)


class MonitoringError(Exception):
    """Cloud Monitoring refused the query; the message is its own, in one line."""

    def __init__(self, status: int, body: str) -> None:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body.strip().splitlines()[0][:200] if body.strip() else ""
        super().__init__(f"Cloud Monitoring answered HTTP {status}: {message}".rstrip(": "))


class BacklogReader:
    def __init__(
        self,
        project: str,
        *,
        enabled: bool = True,
        base_url: str = MONITORING_URL,
        credentials: Any = None,  # google.auth credentials; None = Application Default
    ) -> None:
        self._project = project
        self.enabled = enabled
        self._base_url = base_url
        self._credentials = credentials
        self._session: aiohttp.ClientSession | None = None
        self._warned = False

    async def undelivered(self, subscription: str) -> int | None:
        if not self.enabled:
            return None
        try:
            return await self.read(subscription)
        except Exception as exc:  # any failure means "unknown"; said once, not every poll
            if not self._warned:
                log.warning("backlog_unavailable", subscription=subscription, error=str(exc))
                self._warned = True
            return None

    async def read(self, subscription: str) -> int | None:
        """The newest point, None when there is none; raises what went wrong
        (``check-config --probe`` says it)."""
        project, _, short = subscription.removeprefix("projects/").partition("/subscriptions/")
        token = await self._token()
        return newest_point(await self._query(project or self._project, short, token))

    async def _token(self) -> str:
        if self._credentials is None:
            self._credentials, _ = await anyio.to_thread.run_sync(
                lambda: google.auth.default(scopes=[SCOPE])
            )
        if not self._credentials.valid:
            await anyio.to_thread.run_sync(self._credentials.refresh, Request())
        return str(self._credentials.token)

    async def _query(self, project: str, subscription_id: str, token: str) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=TIMEOUT)
        now = time.time()
        params = {
            "filter": f'metric.type = "{METRIC}" AND '
            f'resource.labels.subscription_id = "{subscription_id}"',
            "interval.startTime": _rfc3339(now - WINDOW_SECONDS),
            "interval.endTime": _rfc3339(now),
        }
        url = f"{self._base_url}/projects/{project}/timeSeries"
        headers = {"Authorization": f"Bearer {token}"}
        async with self._session.get(url, params=params, headers=headers) as response:
            if response.status >= 400:  # Google's error body says why (a missing permission)
                raise MonitoringError(response.status, await response.text())
            return await response.json()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def newest_point(body: Any) -> int | None:
    """The newest point's value (Cloud Monitoring lists points newest first)."""
    newest: tuple[str, int] | None = None
    for series in body.get("timeSeries", []) if isinstance(body, dict) else []:
        for point in series.get("points", [])[:1]:
            end = str(point.get("interval", {}).get("endTime", ""))
            value = int(point.get("value", {}).get("int64Value", 0))
            if newest is None or end > newest[0]:
                newest = (end, value)
    return None if newest is None else newest[1]


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
