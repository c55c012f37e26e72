"""The daemon in-process over the in-memory transport, with the simulator as its gateway.

``daemon(...)`` yields (processor, transport, simulator): put messages on the transport,
read results and hand-backs off it, steer the simulator. No broker; real HTTP on loopback.
``before_run`` may change the processor between construction and start; ``transforms``
is the ``--transform-config-file`` chain.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from async_processor.config import AppConfig, PoolConfig, SortedSetConfig, TransformConfig
from async_processor.pipeline.processor import Processor
from async_processor.sim.app import Simulator
from async_processor.sim.config import SimConfig
from tests.doubles.memory_transport import MemoryTransport
from tests.fixtures.inprocess import runtime_config

QUEUE = "q"


def message(request_id: str, deadline: float, **fields: Any) -> bytes:
    return json.dumps(
        {"id": request_id, "deadline": int(deadline), "payload": {}, **fields}
    ).encode()


@asynccontextmanager
async def daemon(
    *,
    workers: int = 2,
    sim: SimConfig | None = None,
    before_run: Callable[[Processor], None] | None = None,
    transforms: TransformConfig | None = None,
    **runtime: Any,
) -> AsyncIterator[tuple[Processor, MemoryTransport, Simulator]]:
    simulator = Simulator(sim or SimConfig())
    async with anyio.create_task_group() as tg:
        port = await tg.start(simulator.serve)
        transport_config = SortedSetConfig.model_validate(
            {
                "url": "redis://unused:6379",  # never dialled: the transport is the double
                "queues": [{"queue_name": QUEUE, "igw_base_url": f"http://127.0.0.1:{port}"}],
            }
        )
        config = AppConfig(
            transport="redis-sortedset",
            transport_config=transport_config,
            runtime=runtime_config(**runtime),
            pools=[PoolConfig(id="default", workers=workers)],
            transforms=transforms or TransformConfig(),
        )
        transport = MemoryTransport(config.queue_specs())
        processor = Processor(config, transport=transport)
        if before_run is not None:  # e.g. swap in a test's own pool gate
            before_run(processor)
        async with anyio.create_task_group() as inner:
            await inner.start(processor.run)
            yield processor, transport, simulator
            processor.request_stop()
        tg.cancel_scope.cancel()
