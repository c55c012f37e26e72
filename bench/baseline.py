"""Baseline consumer: the least code that does the daemon's job, to compare overheads.

N workers each loop ZPOPMIN -> aiohttp POST of the payload -> LPUSH a result, with the
same libraries as the daemon (redis-py asyncio + hiredis, aiohttp, anyio) and none of
its features (no leases, gates, retries, deadlines, metrics). Exits after ``--count``
results. Run by ``bench.overhead`` side by side with the daemon.
"""

from __future__ import annotations

import argparse
import json
from typing import cast

import aiohttp
import anyio
from redis.asyncio import BlockingConnectionPool, Redis

IDLE_SLEEP = 0.005
MAX_CONNECTIONS = 256


async def consume(args: argparse.Namespace) -> None:
    # One connection per worker at most, waiting (without a time limit) instead of failing;
    # no more than MAX_CONNECTIONS (10,000 workers, then 1,024 connections opened at once
    # timed out connecting under load).
    connections = min(args.workers, MAX_CONNECTIONS)
    pool = BlockingConnectionPool.from_url(
        args.redis_url, max_connections=connections, timeout=None
    )
    redis = Redis(connection_pool=pool)
    connector = aiohttp.TCPConnector(limit=args.workers)
    remaining = args.count
    url = args.gateway_url + "/v1/completions"

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            popped = await redis.zpopmin(args.queue, 1)
            if not popped:
                await anyio.sleep(IDLE_SLEEP)
                continue
            member = cast(bytes, popped[0][0])
            data = json.loads(member)["data"]
            body = json.dumps(data["payload"]).encode()
            headers = {"content-type": "application/json"}
            async with session.post(url, data=body, headers=headers) as response:
                text = await response.text()
            result = {"id": data["id"], "status_code": response.status, "payload": text}
            await redis.lpush(args.result_list, json.dumps(result))
            remaining -= 1

    async with (
        aiohttp.ClientSession(connector=connector) as session,
        anyio.create_task_group() as tg,
    ):
        for _ in range(args.workers):
            tg.start_soon(worker, session)
    await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.baseline")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--result-list", required=True)
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--count", type=int, required=True)
    anyio.run(consume, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
