"""Many tenants on one pool: 200 queues, weighted-fair merge; is any tenant starved?

Every queue is one tenant; a quarter of them have weight ``--heavy`` (3). All queues are
loaded before the daemons start (so all stay backlogged during the window);
``--replicas`` daemons in this process (default 1; three did not finish on a 2-core
machine) share them through one Redis; the first ``--window`` results are counted per
queue against its weighted fair share. Target: every queue ≥ 0.8 of its share.
Run alone: ``python -m bench.tenants [--quick]``.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections import Counter
from contextlib import AsyncExitStack, ExitStack

import anyio

from async_processor.client import SortedSetClient
from async_processor.config import AppConfig, MergePolicyConfig, PoolConfig, SortedSetConfig
from bench.common import redis, simulator, table, verdict
from tests.fixtures.inprocess import running, runtime_config
from tests.fixtures.servers import free_port

TARGET = 0.8


def tenant_config(
    url: str, gateway: str, tag: str, weights: dict[str, float], workers: int
) -> AppConfig:
    transport = SortedSetConfig.model_validate(
        {"url": url, "result_queue_name": f"{tag}:results", "retry_queue_name": f"{tag}:retry",
         "poll_interval_ms": 100, "batch_size": 1,
         "queues": [{"queue_name": name, "igw_base_url": gateway, "worker_pool_id": "p",
                     "labels": {"weight": str(weight)}} for name, weight in weights.items()]}
    )  # fmt: skip
    return AppConfig(
        transport="redis-sortedset",
        transport_config=transport,
        runtime=runtime_config(health_port=free_port(), metrics_port=free_port()),
        pools=[PoolConfig(id="p", workers=workers)],
        merge_policy=MergePolicyConfig(type="weighted-fair"),
    )


async def measure(
    queues: int, replicas: int, workers: int, window: int, mix: list[float]
) -> list[tuple[str, str]]:
    tag = f"tenants-{secrets.token_hex(3)}"
    weights = {f"{tag}-t{i:03d}": mix[i % len(mix)] for i in range(queues)}
    per_queue = int(window * max(mix) / sum(weights.values()) * 2) + 5  # backlogged all along
    deadline = int(time.time()) + 3600
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack, "--latency", "0.05")
        async with SortedSetClient(url, result_queue=f"{tag}:results") as client:
            for name in weights:
                await client.submit_many(
                    [{"id": f"{name}/{n}", "deadline": deadline, "payload": {}}
                     for n in range(per_queue)], queue=name)  # fmt: skip
            async with AsyncExitStack() as daemons:
                for _ in range(replicas):
                    config = tenant_config(url, sim.url, tag, weights, workers)
                    await daemons.enter_async_context(running(config))
                started = time.monotonic()
                results = await client.drain_results(window, 600)
                seconds = time.monotonic() - started
    got = Counter(r.id.split("/")[0] for r in results)
    total = sum(weights.values())
    ratios = {q: got[q] / (len(results) * w / total) for q, w in weights.items()}
    worst = min(ratios, key=ratios.__getitem__)
    classes = sorted(set(weights.values()))
    by_class = "; ".join(
        f"w{w:g} {min(r for q, r in ratios.items() if weights[q] == w):.2f}…"
        f"{max(r for q, r in ratios.items() if weights[q] == w):.2f}"
        for w in classes
    )
    return [
        ("setup", f"{queues} queues (weights {','.join(f'{w:g}' for w in mix)}), "
                  f"{replicas} replicas × "
                  f"{workers} workers, gateway 50 ms, {per_queue} messages per queue"),
        ("window", f"first {len(results)} results in {seconds:.1f} s"),
        ("share range", f"{min(ratios.values()):.2f} … {max(ratios.values()):.2f} of fair"),
        ("by weight", by_class),
        ("worst queue", verdict(f"{ratios[worst]:.2f} ({worst.rsplit('-', 1)[1]})",
                                ratios[worst] >= TARGET, f"≥ {TARGET}")),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tenants")
    p.add_argument("--queues", type=int, default=200)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--window", type=int, default=6000)
    p.add_argument("--weights", default="1,2,4", help="weights given to the queues in turn")
    p.add_argument("--quick", action="store_true", help="a 2,000-result window")
    args = p.parse_args(argv)
    window = 2000 if args.quick else args.window
    mix = [float(w) for w in args.weights.split(",")]
    rows = anyio.run(measure, args.queues, args.replicas, args.workers, window, mix)
    table("many tenants: weighted fair share", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
