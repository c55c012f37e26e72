"""A "Go-shaped" redis-sortedset worker: upstream llm-d-async's claim protocol (v0.9.1+,
#412; docs/migrating-from-go.md, /work/shared/reference/upstream-v0.10.md §1), written from
the spec in Python so tests can put a Go daemon's behaviour on a queue without a Go
toolchain.

Stage: a test double (a Go daemon's broker side). Input: a Redis URL, a request queue and
a default result list. Output: results on the lists, claims in upstream's three keys.

What it does, step by step as upstream's daemon does:

- one owner token per process (16 hex characters, 8 random bytes);
- poll: ``ZRANGEBYSCORE Q -inf +inf WITHSCORES LIMIT 0 n`` (nothing removed); an unparsable
  member, one without ``data`` or with ``deadline <= 0`` is ``ZREM``'d (no result);
- claim, one member per script: ``ZREM Q member`` (0 = another consumer won: skipped),
  then ``Q:claimed[key] = member``, ``Q:claim-owners[key] = owner``, ``Q:claims-idx``
  scores ``key`` by the lease expiry ``min(now + lease, deadline + 300)`` in Unix seconds
  of this process's clock; key = ``id`` NUL ``request_token`` (``id`` alone without a
  token); an existing claim under the key is overwritten;
- a claimed member past its deadline is answered ``DEADLINE_EXCEEDED``, one whose cancel
  marker holds its token ``CANCELLED``, the others with a made-up 200 answer that names
  this worker (``payload`` = ``{"answered_by": "go:<owner>"}``) after ``work`` seconds;
- fenced ack: only while ``Q:claim-owners[key]`` is this owner (and the owner is not
  empty): ``LPUSH`` the result (with ``request_token``), ``EXPIRE`` the list when the
  routing asks for a TTL, delete the three claim entries and the payload key; otherwise
  nothing is pushed. Then ``request-active:<id>`` and ``request-cancel:<id>`` are each
  deleted only while they hold the token;
- heartbeat every ``clamp(lease / 3, 1 s, 30 s)``: a fenced renew per held claim (-1 owned
  by someone else, 0 gone: the handle is dropped);
- reclaim every ``reclaim_interval``: up to 100 keys of ``Q:claims-idx`` scored <= now;
  each, atomically, if still expired and its member present, goes back to ``Q`` at its
  queue score (``deadline + min(seq, 2^21 - 1) / 2^21``) and its claim is deleted; an
  index entry without a member is removed;
- SIGTERM: the claims not answered yet are released (fenced: back to ``Q``, claim
  deleted). ``kill -9`` leaves them to any reclaimer, Go-shaped or ours.

No retries (every message is answered), no gates, no payload fetch: the parts of the
upstream daemon that do not touch the claim keys are left out.

Run: ``python -m tests.interop.go_worker --url redis://... --queue Q --results R``.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import redis

RECLAIM_BATCH = 100
DEADLINE_GRACE = 300  # a lease never outlives its request's deadline by more than this

CLAIM = """
if redis.call('ZREM', KEYS[1], ARGV[2]) == 0 then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
return 1
"""
# KEYS claimed, owners, idx, result list[, payload key]; ARGV key, owner, result, list TTL
ACK = """
if ARGV[2] == '' or redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('LPUSH', KEYS[4], ARGV[3])
if tonumber(ARGV[4]) > 0 then
  redis.call('EXPIRE', KEYS[4], ARGV[4])
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if KEYS[5] then
  redis.call('DEL', KEYS[5])
end
return 1
"""
# KEYS claimed, owners, idx; ARGV key, owner, new expiry
RENEW = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
    return -1
  end
  return 0
end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return 1
"""
# KEYS pending, claimed, owners, idx; ARGV key, score, now
RECLAIM = """
local expiry = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not expiry or tonumber(expiry) > tonumber(ARGV[3]) then
  return 0
end
local member = redis.call('HGET', KEYS[2], ARGV[1])
if not member then
  redis.call('ZREM', KEYS[4], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], member)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""
# KEYS pending, claimed, owners, idx; ARGV key, owner, score, member
RELEASE = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def claim_keys(queue: str, cluster: bool = False) -> tuple[str, str, str]:
    """Upstream's claim keys of ``queue``: ``Q:claimed``, ``Q:claim-owners``,
    ``Q:claims-idx``; in cluster mode under the queue's hash tag (``{Q}:…``, or the tag the
    name already carries) so they share the queue's slot."""
    base = queue
    if cluster and not _has_tag(queue):
        base = "{" + queue + "}"
    return f"{base}:claimed", f"{base}:claim-owners", f"{base}:claims-idx"


def _has_tag(key: str) -> bool:
    start = key.find("{")
    return start >= 0 and key.find("}", start + 1) > start + 1


def claim_key(request_id: str, token: str) -> str:
    return f"{request_id}\x00{token}" if token else request_id


def queue_score(envelope: dict[str, Any]) -> float:
    """Upstream's score (#463): deadline + min(seq, 2^21 - 1) / 2^21; bare deadline unstamped."""
    deadline = float(envelope.get("data", {}).get("deadline", 0))
    seq = envelope.get("internal", {}).get("enqueue_seq", 0)
    if isinstance(seq, int) and seq > 0:
        return deadline + min(seq, 2097151) / 2097152
    return deadline


@dataclass
class Held:
    """A claim this worker holds: its key, the member claimed and what answers it."""

    key: str
    member: str
    envelope: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.envelope["data"]["id"])

    @property
    def token(self) -> str:
        return str(self.envelope.get("internal", {}).get("request_token", ""))

    @property
    def deadline(self) -> float:
        return float(self.envelope["data"]["deadline"])


@dataclass
class GoShapedWorker:
    """One Go-shaped daemon on one queue (see the module docstring)."""

    client: redis.Redis
    queue: str
    results: str
    lease: float = 300.0
    reclaim_interval: float = 15.0
    work: float = 0.0
    cluster: bool = False
    owner: str = field(default_factory=lambda: secrets.token_hex(8))
    held: dict[str, Held] = field(default_factory=dict)
    answered: int = 0
    fenced: int = 0

    def __post_init__(self) -> None:
        self.claimed, self.owners, self.idx = claim_keys(self.queue, self.cluster)
        self._scripts = {
            name: self.client.register_script(source)
            for name, source in {
                "claim": CLAIM,
                "ack": ACK,
                "renew": RENEW,
                "reclaim": RECLAIM,
                "release": RELEASE,
                "cad": COMPARE_AND_DELETE,
            }.items()
        }

    def expiry(self, deadline: float) -> float:
        return float(min(math.floor(time.time()) + self.lease, deadline + DEADLINE_GRACE))

    def poll(self, count: int) -> list[Held]:
        """Peek up to ``count`` members and claim each one that parses (upstream's poll)."""
        peeked = self.client.zrangebyscore(self.queue, "-inf", "+inf", 0, count, withscores=True)
        claimed = []
        for raw, _ in peeked:
            member = raw.decode()
            envelope = _parse(member)
            if envelope is None:
                self.client.zrem(self.queue, member)
                continue
            if (held := self.claim(member, envelope)) is not None:
                claimed.append(held)
        return claimed

    def claim(self, member: str, envelope: dict[str, Any]) -> Held | None:
        held = Held("", member, envelope)
        held.key = claim_key(held.id, held.token)
        won = self._scripts["claim"](
            keys=[self.queue, self.claimed, self.owners, self.idx],
            args=[held.key, member, self.owner, self.expiry(held.deadline)],
        )
        if not won:
            return None  # another consumer claimed it first
        self.held[held.key] = held
        return held

    def result_of(self, held: Held) -> dict[str, Any]:
        result: dict[str, Any] = {"id": held.id}
        cancel = self.client.get(f"request-cancel:{held.id}")
        if held.deadline < time.time():
            result |= {"error_code": "DEADLINE_EXCEEDED", "error_message": "deadline exceeded"}
        elif held.token and cancel is not None and cancel.decode() == held.token:
            result |= {"error_code": "CANCELLED", "error_message": "request cancelled"}
        else:
            answer = json.dumps({"answered_by": f"go:{self.owner}"})
            result |= {"status_code": 200, "payload": answer}
        if held.token:
            result["request_token"] = held.token
        return result

    def ack(self, held: Held, result: dict[str, Any], owner: str | None = None) -> bool:
        """The fenced ack; ``owner`` overrides the token (a test's stale owner)."""
        internal = held.envelope.get("internal", {})
        target = internal.get("result_queue_name") or self.results
        ttl = int(internal.get("result_ttl_seconds") or 0)
        script_keys = [self.claimed, self.owners, self.idx, target]
        if ref := internal.get("payload_ref"):
            script_keys.append(str(ref))
        token = self.owner if owner is None else owner
        pushed = bool(
            self._scripts["ack"](keys=script_keys, args=[held.key, token, json.dumps(result), ttl])
        )
        if owner is None:
            self.held.pop(held.key, None)
        if not pushed:
            self.fenced += 1
            return False
        self.answered += 1
        for marker in (f"request-active:{held.id}", f"request-cancel:{held.id}"):
            self._scripts["cad"](keys=[marker], args=[held.token])
        return True

    def heartbeat(self) -> int:
        """Renew every held claim; returns how many were lost (and forgotten)."""
        lost = 0
        for held in list(self.held.values()):
            renewed = self._scripts["renew"](
                keys=[self.claimed, self.owners, self.idx],
                args=[held.key, self.owner, self.expiry(held.deadline)],
            )
            if int(renewed) != 1:
                self.held.pop(held.key, None)
                lost += 1
        return lost

    def reclaim(self) -> int:
        """Expired claims, anyone's, back to the queue at their queue score."""
        now = math.floor(time.time())
        expired = self.client.zrangebyscore(self.idx, "-inf", now, 0, RECLAIM_BATCH)
        back = 0
        for raw in expired:
            key = raw.decode()
            member = self.client.hget(self.claimed, key)
            envelope = _parse(member.decode()) if member is not None else None
            score = queue_score(envelope) if envelope else 0.0
            back += int(
                self._scripts["reclaim"](
                    keys=[self.queue, self.claimed, self.owners, self.idx],
                    args=[key, repr(score), now],
                )
            )
        return back

    def release_all(self) -> int:
        released = 0
        for held in list(self.held.values()):
            released += int(
                self._scripts["release"](
                    keys=[self.queue, self.claimed, self.owners, self.idx],
                    args=[held.key, self.owner, repr(queue_score(held.envelope)), held.member],
                )
            )
            self.held.pop(held.key, None)
        return released

    def step(self, batch: int) -> int:
        """One poll: claim, work, answer. Returns how many were claimed."""
        claimed = self.poll(batch)
        if claimed and self.work:
            time.sleep(self.work)
        for held in claimed:
            if held.key in self.held:
                self.ack(held, self.result_of(held))
        return len(claimed)


def _parse(member: str) -> dict[str, Any] | None:
    """The envelope, or None for what upstream drops (not JSON, no data, deadline <= 0)."""
    try:
        envelope = json.loads(member)
    except ValueError:
        return None
    data = envelope.get("data") if isinstance(envelope, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return None
    deadline = data.get("deadline")
    if not isinstance(deadline, int | float) or deadline <= 0:
        return None
    if not isinstance(envelope.get("internal", {}), dict):
        return None
    return envelope


def heartbeat_interval(lease: float) -> float:
    return min(max(lease / 3, 1.0), 30.0)


def run(worker: GoShapedWorker, batch: int, poll_interval: float) -> None:
    """The daemon's loop until SIGTERM: poll, heartbeat, reclaim; then release."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    next_beat = next_reclaim = time.monotonic()
    beat = heartbeat_interval(worker.lease)
    while not stopping:
        now = time.monotonic()
        if now >= next_reclaim:
            worker.reclaim()
            next_reclaim = now + worker.reclaim_interval
        if now >= next_beat:
            worker.heartbeat()
            next_beat = now + beat
        if not worker.step(batch):
            time.sleep(poll_interval)
    worker.release_all()
    print(json.dumps({"owner": worker.owner, "answered": worker.answered}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.interop.go_worker")
    p.add_argument("--url", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--results", default="result-list")
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--lease", type=float, default=300.0)
    p.add_argument("--reclaim-interval", type=float, default=15.0)
    p.add_argument("--work", type=float, default=0.0, help="seconds a claimed batch takes")
    p.add_argument("--poll-interval", type=float, default=0.05)
    args = p.parse_args(argv)
    worker = GoShapedWorker(
        redis.Redis.from_url(args.url),
        args.queue,
        args.results,
        lease=args.lease,
        reclaim_interval=args.reclaim_interval,
        work=args.work,
    )
    print(json.dumps({"started": worker.owner}), flush=True)
    run(worker, args.batch, args.poll_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
