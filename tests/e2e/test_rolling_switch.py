"""A rolling switch from the Go daemon (v0.9.1+) to ours on one queue, as teams replace a
daemon pod by pod: three Go-shaped workers (tests/interop/go_worker.py, upstream's claim
protocol, each its own process) and two of our daemons (real processes) share one
redis-sortedset queue of 2,000 Go-producer envelopes, on a real redis-server, with the
simulator over real HTTP as our gateway. Each side is killed with SIGKILL in turn, with
claims held; a new daemon of ours replaces the last one killed.

Expected: every message answered; none answered twice by ours (the dedup marker, and our
fenced ack). A Go-shaped duplicate could only come from a retry parked while its claim is
held (upstream's "one extra pending copy"), which the Go-shaped worker never makes (it
answers everything): every ack on both sides is fenced and atomic, so a message's claim
key answers once per owner and a reclaimed owner answers nothing. So duplicates are
counted per side and must be zero; any other number fails the test with the ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest
import redis

from tests.fixtures.daemon import Daemon, DaemonFactory, sortedset_config
from tests.fixtures.servers import stop_process
from tests.fixtures.simulator import SimulatorProcess
from tests.integration.test_upstream_wire import go_envelope
from tests.interop.go_worker import claim_keys

pytestmark = [pytest.mark.slow]
MESSAGES = 2000
LEASE = 2  # seconds, both sides: a killed side's claims come back quickly
TOKEN = "5a5a5a5a5a5a5a5a"


def go_worker(redis_url: str, queue: str, results: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.interop.go_worker", "--url", redis_url, "--queue", queue,
         "--results", results, "--batch", "10", "--lease", str(LEASE),
         "--reclaim-interval", "0.5", "--work", "0.05"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def wait_results(r: redis.Redis, results: str, at_least: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while r.llen(results) < at_least:
        assert time.monotonic() < end, f"{r.llen(results)} results, waiting for {at_least}"
        time.sleep(0.05)


def kill9(proc: subprocess.Popen[bytes] | Daemon) -> None:
    if isinstance(proc, Daemon):
        proc.kill9()
    else:
        proc.kill()
        proc.wait()


def test_go_and_ours_on_one_queue_killed_in_turn_answer_every_message(
    redis_url: str, unique: str, simulator: SimulatorProcess, daemon_factory: DaemonFactory
) -> None:
    simulator.configure(latency=0.05)
    r = redis.Redis.from_url(redis_url)
    queue, results = f"{unique}:q", f"{unique}:results"
    deadline = int(time.time()) + 900
    ids = [f"{unique}/{i}" for i in range(MESSAGES)]
    members = {
        go_envelope(request_id, deadline, token=f"{TOKEN}{i:04x}"): deadline + (i + 1) / 2097152
        for i, request_id in enumerate(ids)
    }
    r.zadd(queue, members)
    config = sortedset_config(redis_url, simulator.url, [queue], result_list=results,
                              lease_seconds=LEASE)  # fmt: skip
    go = [go_worker(redis_url, queue, results) for _ in range(3)]
    ours = [daemon_factory.start(config, "--concurrency", "16") for _ in range(2)]
    try:
        # Each side in turn, claims held; the switch ends with a new daemon of ours.
        for at_least, victim in ((300, go[0]), (700, ours[0]), (1100, go[1]), (1500, ours[1])):
            wait_results(r, results, at_least)
            kill9(victim)
        ours.append(daemon_factory.start(config, "--concurrency", "16"))
        wait_results(r, results, MESSAGES, timeout=180)
        end = time.monotonic() + 3 * LEASE  # any late duplicate would show up by now
        while time.monotonic() < end and (r.zcard(queue) or r.hlen(claim_keys(queue)[0])):
            time.sleep(0.1)
        time.sleep(1.0)
        raw = r.lrange(results, 0, -1)
    finally:
        for proc in go:
            stop_process(proc)
    answers = [json.loads(x) for x in raw]
    by_go = Counter(a["id"] for a in answers if "answered_by" in str(a.get("payload")))
    by_ours = Counter(a["id"] for a in answers if "answered_by" not in str(a.get("payload")))
    print(f"answered by Go-shaped workers: {sum(by_go.values())}, by ours: {sum(by_ours.values())}")
    assert set(by_go) | set(by_ours) == set(ids)  # every message answered
    twice_by_ours = [i for i, n in by_ours.items() if n > 1]
    assert not twice_by_ours, twice_by_ours[:5]
    twice_by_go = [i for i, n in by_go.items() if n > 1]
    both = sorted(set(by_go) & set(by_ours))
    assert not twice_by_go and not both, (twice_by_go[:5], both[:5])
    assert all(a.get("request_token", "").startswith(TOKEN) for a in answers)
    assert sum(by_go.values()) > 0 and sum(by_ours.values()) > 0  # both sides worked
    assert r.zcard(queue) == 0 and not r.exists(*claim_keys(queue))
