"""``check-config --probe``, the gates' own sources: their Redis, and what a blind metric
gate is missing.

Stage: outside the pipeline (the first check after ``helm install``). Input: a built gate
(a leaf of a queue's or pool's gate tree) and the config's ``--prometheus-url``. Output:

- for a Redis-backed gate (``redis``, ``redis-quota``, ``redis-leased-rate``), a ``Check``
  of its own Redis, which need not be the broker's: the ``redis`` gate's budget key
  (missing: budget 1, as the Go daemon), the leased-rate control record, else a PING;
- for a metric gate that read no series, what is missing in plain words: each metric its
  PromQL reads that Prometheus has no series of at all, or none with the gate's labels
  (``missing_series``); for ``endpoint-scrape``, the same about the scraped page.

Each look gets ``TIMEOUT`` seconds; nothing is written, no metric is registered.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable

import aiohttp
from redis.asyncio import Redis

from async_processor.errors import GateError, plain
from async_processor.gates.base import GateContext, GateOwner
from async_processor.gates.leased_rate import LeasedRateGate, check_lease
from async_processor.gates.metric import MetricGate, Reading
from async_processor.gates.redis import RedisBudgetGate, RedisQuotaGate
from async_processor.gates.scrape import ScrapeSource, fetch_page
from async_processor.ops.targets import TIMEOUT, Check, ping, redis_check, redis_where

# A selector with matchers (``name{a="b"}``), or a bare metric name: an identifier not
# called as a function, once strings, grouping label lists and ranges are taken out.
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^{}]*\})")
_CUT = re.compile(
    r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|\[[^\]]*\]'
    r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
)
_NAME = re.compile(r"(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)\b(?!\s*\()")
_KEYWORDS = frozenset(("and", "or", "unless", "bool", "offset", "by", "without", "on",
                      "ignoring", "group_left", "group_right", "inf", "nan"))  # fmt: skip


async def redis_gate_check(where: str, gate: object) -> Check | None:
    """The check of a Redis-backed gate's source; None for any other gate."""
    if isinstance(gate, RedisBudgetGate):
        name, read = "redis", _budget_key(gate.params.budget_key)
    elif isinstance(gate, RedisQuotaGate):
        name, read = "redis-quota", ping
    elif isinstance(gate, LeasedRateGate):
        name, read = "redis-leased-rate", _lease(gate)
    else:
        return None
    conn = gate.params.redis_connection()
    return await redis_check(f"{where} {name}: redis at {redis_where(conn)}", conn, read)


def _budget_key(key: str) -> Callable[[Redis], Awaitable[str]]:
    async def read(client: Redis) -> str:
        raw = await client.get(key)
        if raw is None:
            return f"key {key!r} not set: budget 1 (open)"
        text = _text(raw)
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if value != value:
            return f"key {key!r} holds {text[:40]!r}, not a number: budget 1 (open)"
        return f"key {key!r} = {value:g}: budget {min(1.0, max(0.0, value)):g}"

    return read


def _lease(gate: LeasedRateGate) -> Callable[[Redis], Awaitable[str]]:
    key = gate.params.control_key

    async def read(client: Redis) -> str:
        record = await client.hgetall(key)
        text = {_text(k): _text(v) for k, v in record.items()}
        lease = check_lease(text, gate.pool_id, int(time.time() * 1000))
        if not lease.valid:
            return f"no valid lease for pool {gate.pool_id!r} in {key!r}: it admits nothing"
        left = lease.valid_until_ms / 1000 - time.time()
        return f"lease in {key!r}: {lease.rps:g} req/s for {left:.0f}s more"

    return read


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# -- what a metric gate is missing ----------------------------------------------------


async def missing_series(gate: MetricGate, reading: Reading, prometheus_url: str) -> list[str]:
    """Why ``gate`` read no series, one plain line per missing metric ([] when it read a
    value or failed otherwise: the reading's reason says that already)."""
    if reading.value is not None or "no series" not in (reading.fallback_reason or ""):
        return []
    try:
        if isinstance(gate.source, ScrapeSource):
            return await _missing_on_page(gate.source)
        if gate.name.startswith("prometheus-") and prometheus_url:
            return await _missing_in_prometheus(prometheus_url, gate.queries)
    except (GateError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return [f"(could not look further: {plain(exc)})"]
    return []


def selectors(query: str) -> list[str]:
    """The series selectors a PromQL query reads (``name{…}`` and bare names), in order."""
    found = [m[1] + m[2] for m in _SELECTOR.finditer(query)]
    rest = _CUT.sub(" ", _SELECTOR.sub(" ", query))
    found += [n for n in _NAME.findall(rest) if n.lower() not in _KEYWORDS]
    return list(dict.fromkeys(found))


async def _missing_in_prometheus(url: str, queries: list[str]) -> list[str]:
    read = list(dict.fromkeys(s for q in queries for s in selectors(q)))
    if not read:
        return ["the expression reads no metric and gives no series"]
    lines = []
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for selector in read:
            if await _has_series(session, url, selector):
                continue
            name = selector.partition("{")[0]
            if name == selector or not await _has_series(session, url, f'{{__name__="{name}"}}'):
                lines.append(f"Prometheus has no series of {name} (is it scraping its source?)")
            else:
                lines.append(f"{name} has series, none matching {selector[len(name) :]}")
    return lines or ["each metric it reads has series; the expression still gives none"]


async def _has_series(session: aiohttp.ClientSession, url: str, selector: str) -> bool:
    query = {"query": f"count({selector})"}
    async with session.get(url.rstrip("/") + "/api/v1/query", params=query) as response:
        body = await response.json(content_type=None)
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        raise GateError(f"prometheus could not count {selector}: {error or response.status}")
    return bool(body["data"]["result"])


async def _missing_on_page(source: ScrapeSource) -> list[str]:
    p = source.params
    ctx = GateContext(owner=GateOwner())  # a session of its own, closed here
    try:
        families = await fetch_page(ctx, p.url)
    finally:
        for close in ctx.closers:
            await close()
    kinds = {s.name: family.type for family in families for s in family.samples}
    present = [m for m in p.metric if m in kinds]
    if not present:
        return [f"the page at {p.url} has no {' or '.join(p.metric)}"]
    if not p.labels:  # there, but a histogram or summary: nothing a gate can read
        return [f"the page at {p.url} has {present[0]} as a {kinds[present[0]]}, not a gauge"]
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(p.labels.items()))
    return [f"the page at {p.url} has {present[0]}, none with {{{labels}}}"]
