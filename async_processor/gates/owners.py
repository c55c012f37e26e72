"""Gates by owner: each queue's gate (a ``gate_group``'s queues share one) and a pool's.

Stage: wiring (admission control). Input: queue specs and pool configs with their gate
type and params. Output: built gates, with a config error naming the queue or pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from async_processor.config import PoolConfig
from async_processor.config.queues import QueueSpec
from async_processor.errors import ConfigError
from async_processor.gates.base import Gate, GateContext, GateOwner, build_gate


class QueueGates:
    """Queue name -> its gate, built on first use (at startup, or when a queue is found)."""

    def __init__(self, ctx: GateContext) -> None:
        self._ctx = ctx
        self._by_queue: dict[str, Gate] = {}
        self._by_group: dict[str, Gate] = {}

    def __getitem__(self, name: str) -> Gate:
        return self._by_queue[name]

    def of(self, queue: QueueSpec) -> Gate:
        """The queue's gate; the queues of a ``gate_group`` share the first one built, so
        its counts and readings cover the whole endpoint."""
        gate = self._by_queue.get(queue.name) or self._by_group.get(queue.gate_group)
        if gate is None:
            gate = self.build(queue)
        self.install(queue, gate)
        return gate

    def install(self, queue: QueueSpec, gate: Gate) -> None:
        """``gate`` is ``queue``'s from now on (and its group's): a hot reload's, built
        (``build``) before anything changed, so a gate that fails keeps the last config."""
        self._by_queue[queue.name] = gate
        if queue.gate_group:
            self._by_group[queue.gate_group] = gate

    def forget(self, name: str) -> None:
        """A removed queue, drained: its entry goes (a group's gate stays with the group;
        Redis clients are shared per address and closed at shutdown)."""
        self._by_queue.pop(name, None)

    def build(self, queue: QueueSpec) -> Gate:
        # A shared gate's own series (metric gate gauges) carry the group as queue_name.
        if queue.gate_group:
            owner = GateOwner("", queue.gate_group, queue.pool)
        else:
            owner = GateOwner(queue.id, queue.name, queue.pool)
        with naming(f"queue {queue.name!r}"):
            return build_gate(queue.gate_type, dict(queue.gate_params), self._ctx.for_owner(owner))


def pool_gate(config: PoolConfig, ctx: GateContext) -> Gate:
    with naming(f"pool {config.id!r}"):
        owner = GateOwner(pool=config.id)
        return build_gate(config.gate_type, dict(config.gate_params), ctx.for_owner(owner))


@contextmanager
def naming(owner: str) -> Iterator[None]:
    """Say which queue or pool a plugin config error belongs to."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{owner}: {exc}") from exc
