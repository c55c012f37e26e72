"""``check-config --probe``: run each gate's source once and say what it would use.

Stage: outside the pipeline (the first check after ``helm install``). Input: a validated
``AppConfig``. Output on stdout: first whether the broker, each gateway and (gcp-pubsub)
the Cloud Monitoring backlog answer (``ops.targets``); then each Redis-backed gate's own
Redis (``ops.gate_sources``); then one entry per metric gate (``prometheus-*`` and
``endpoint-scrape``, also inside ``composite`` / ``wait-on-refuse`` /
``tier-priority-admission``) of every queue and pool, with the budget it would use and the
value it read, or its fallback budget and why it would fall back (naming each metric that
has no series), and the queries it runs. Exit code 0, or 1 when a target or gate source
is unreachable or any gate would fall back (a blind gate). Nothing is dispatched and no
metric is registered; gates without a source are not probed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio

from async_processor.config import AppConfig
from async_processor.gates.base import GateContext, GateOwner, build_gate
from async_processor.gates.basic import CompositeGate
from async_processor.gates.metric import CascadeSource, MetricGate, Reading
from async_processor.gates.shared import InnerGate
from async_processor.ops.gate_sources import missing_series, redis_gate_check
from async_processor.ops.targets import Check, check_targets

BLIND_EXIT = 1


@dataclass(frozen=True, slots=True)
class Probe:
    where: str  # e.g. "queue 'q1'", "pool 'gpu' > composite[1]"
    gate: MetricGate
    reading: Reading
    source_index: int = -1  # which prometheus-budget source answered
    missing: tuple[str, ...] = ()  # what a gate that read no series lacks, in plain words


def main(config: AppConfig) -> int:
    """Print the report for ``config``; 1 when a target or gate source is unreachable or
    any metric gate would fall back."""
    checks, probes = anyio.run(_everything, config)
    print("\n".join([*(check.line() for check in checks), report(probes)]))
    failed = any(c.problem for c in checks) or any(p.reading.value is None for p in probes)
    return BLIND_EXIT if failed else 0


async def _everything(config: AppConfig) -> tuple[list[Check], list[Probe]]:
    """The targets, then the gates' sources: one event loop for both."""
    checks = await check_targets(config)
    sources, probes = await probe(config)
    return checks + sources, probes


async def probe(config: AppConfig) -> tuple[list[Check], list[Probe]]:
    """The Redis-backed gates' sources, then each metric gate's reading."""
    rt = config.runtime
    # No cache: one fresh answer each. No metrics: a probe must not register gauges.
    ctx = GateContext(owner=GateOwner(), prometheus_url=rt.prometheus_url, prometheus_cache_ttl=0.0)
    checks, probes = [], []
    try:
        for where, gate_type, params, owner in _gate_entries(config):
            gate = build_gate(gate_type, params, ctx.for_owner(owner))
            for path, leaf in _leaves(gate, where):
                if isinstance(leaf, MetricGate):
                    probes.append(await _read(path, leaf, rt.prometheus_url))
                elif (check := await redis_gate_check(path, leaf)) is not None:
                    checks.append(check)
    finally:
        for close in ctx.closers:
            await close()
    return checks, probes


async def _read(where: str, gate: MetricGate, prometheus_url: str) -> Probe:
    reading = await gate.read()
    source = gate.source
    index = source.active if isinstance(source, CascadeSource) else -1
    missing = await missing_series(gate, reading, prometheus_url)
    return Probe(where, gate, reading, index, tuple(missing))


def _gate_entries(config: AppConfig) -> Iterator[tuple[str, str, dict[str, Any], GateOwner]]:
    for queue in config.queue_specs():
        if queue.gate_type:
            owner = GateOwner(queue.id, queue.name, queue.pool)
            yield f"queue {queue.name!r}", queue.gate_type, dict(queue.gate_params), owner
    for pool in config.pools:
        if pool.gate_type:
            owner = GateOwner(pool=pool.id)
            yield f"pool {pool.id!r}", pool.gate_type, dict(pool.gate_params), owner


def _leaves(gate: object, where: str) -> Iterator[tuple[str, object]]:
    if isinstance(gate, CompositeGate):
        for index, inner in enumerate(gate.gates):
            yield from _leaves(inner, f"{where} > composite[{index}]")
    elif isinstance(gate, InnerGate):
        yield from _leaves(gate.inner, where)
    else:
        yield where, gate


def report(probes: list[Probe]) -> str:
    if not probes:
        return "probe: no metric gates (prometheus-* / endpoint-scrape) in this config"
    return "\n".join(_entry(p) for p in probes)


def _entry(p: Probe) -> str:
    gate, reading = p.gate, p.reading
    head = f"probe: {p.where} {gate.name}: "
    if reading.value is None:
        open_ = " (fails open)" if gate.fails_open else ""
        head += f"FALLBACK budget {reading.budget:g}{open_}: {reading.fallback_reason}"
    else:
        head += (
            f"budget {reading.budget:g} (read {reading.value:g}, closed at <= {gate.threshold:g})"
        )
        if p.source_index >= 0:
            head += f" from source [{p.source_index}]"
    missing = (f"    missing: {line}" for line in p.missing)
    return "\n".join([head, *missing, *(f"    {query}" for query in gate.queries)])
