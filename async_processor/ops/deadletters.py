"""``async-processor dead-letters``: list, show, replay or purge the Redis dead-letter lists.

Stage: outside the daemon (an operator's tool). Input: the daemon's own flags and config
(the same queues, hence the same ``<queue>:dead-letter`` keys: with ``queue_discovery``
also the discovered queues, found as the daemon finds them, and removed ones still
draining), an action and entry ids. Output: a table or JSON on stdout; one structured
log line per action on stderr (queue, reason, request id, never the payload), and a count
of what was done.

An entry is named by a short digest of its content (``list`` shows it), which stays the
same while the daemon pushes new entries and others are removed. Replay and purge match
the entry by its exact content in one atomic step (a Lua script), so two operators cannot
replay the same entry twice.

Replay puts the message back on its queue: on the sorted set scored by its deadline, its
own (default) or ``--deadline-in`` from now, written into the message; on redis-pubsub it
is published to its channel, and stays on the list when nobody subscribes (a published
message with no subscriber is lost). A message that does not decode is never replayed
(the daemon would only park it again): the operator is told why, and it stays on the
list to be shown and purged; nor is an entry that kept only a prefix of a large message
(``truncated``). Either makes the exit code 1. gcp-pubsub copies dead
letters to a topic (``<subscription>-dead-letter``); read them with a subscription there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import structlog
from redis.asyncio import Redis

from async_processor.cli.args import daemon_config, duration
from async_processor.config import AppConfig, GcpPubSubConfig, RedisPubSubConfig, SortedSetConfig
from async_processor.errors import InvalidMessage, TransportError, UsageError
from async_processor.json_scan import peek_id
from async_processor.messages import decode_envelope
from async_processor.ops.status import served_queues
from async_processor.redis.conn import connect, redis_errors
from async_processor.redis.keyspace import KeySpace
from async_processor.redis.scripts import lua_source
from async_processor.routing import queue_score

log = structlog.get_logger(__name__)

PROG = "async-processor dead-letters"
ACTIONS = ("list", "show", "replay", "purge")
DETAIL_WIDTH = 60
ID_BYTES = 5  # 10 hex digits: unique enough among one queue's dead letters


@dataclass(frozen=True, slots=True)
class Entry:
    queue: str
    raw: bytes  # the list element, matched by content on replay/purge

    @property
    def id(self) -> str:
        return hashlib.blake2b(self.raw, digest_size=ID_BYTES).hexdigest()

    @property
    def fields(self) -> dict[str, Any]:
        try:
            value = json.loads(self.raw)
        except ValueError:
            return {"raw": self.raw.decode("utf-8", "replace")}
        return value if isinstance(value, dict) else {"raw": value}

    def summary(self, now: float) -> dict[str, Any]:
        """What ``list`` shows: no payload."""
        fields = self.fields
        when = fields.get("time")
        return {
            "queue": self.queue,
            "id": self.id,
            "reason": fields.get("reason", ""),
            "age_seconds": round(now - when, 1) if isinstance(when, int | float) else None,
            "request_id": peek_id(str(fields.get("raw", ""))),
            "detail": str(fields.get("detail", "")),
            "truncated": bool(fields.get("truncated")),
        }


class DeadLetters:
    """The dead-letter lists of the queues a Redis transport's daemon serves: configured,
    and on redis-sortedset discovered and removed ones still draining (``load``)."""

    def __init__(self, config: SortedSetConfig | RedisPubSubConfig, client: Redis) -> None:
        self.config = config
        self.redis = client
        self.sorted_set = isinstance(config, SortedSetConfig)
        self._keys = KeySpace(cluster=config.mode == "cluster")  # the daemon's key names
        self._replay = client.register_script(lua_source("replay_dead_letter"))
        self.queues = [q.queue_name for q in config.queues]

    async def load(self, pool_gate_params: Sequence[Mapping[str, Any]] = ()) -> None:
        """Find the queues as the daemon does (``status.served_queues``)."""
        served = await served_queues(self.config, self.redis, None, pool_gate_params)
        self.queues = [queue.name for _, queue in served]

    async def entries(self, queue: str) -> list[Entry]:
        """Oldest first (the list is pushed at its head)."""
        with redis_errors("dead-letter read"):
            raw = cast(list[bytes], await self.redis.lrange(self._keys.dead_letter(queue), 0, -1))
        return [Entry(queue, item) for item in reversed(raw)]

    async def replay(self, entry: Entry, deadline_in: float | None, now: float) -> int:
        """1 replayed, 0 gone meanwhile, -1 kept (no subscriber on the channel), -2 kept
        (the entry holds only a prefix of the message: replaying it would corrupt it);
        InvalidMessage (kept) when the message does not decode."""
        if entry.fields.get("truncated"):
            return -2
        message, score = _message(entry, deadline_in, now)
        mode = "zadd" if self.sorted_set else "publish"
        target = [self._keys.dead_letter(entry.queue), entry.queue]
        with redis_errors("dead-letter replay"):
            done = await self._replay(keys=target, args=[entry.raw, message, score, mode])
        return int(done)

    async def purge(self, entry: Entry) -> int:
        with redis_errors("dead-letter purge"):
            key = self._keys.dead_letter(entry.queue)
            return int(await self.redis.lrem(key, 1, entry.raw))  # type: ignore[arg-type]


def _message(entry: Entry, deadline_in: float | None, now: float) -> tuple[bytes, float]:
    """The message to put back and its sorted-set score (its deadline plus its submission
    order's fraction, upstream's score: a replayed message keeps its place among the
    requests of its deadline); InvalidMessage when it does not decode (the daemon would
    park it again at once).

    It keeps its bytes unless ``deadline_in`` gives it a fresh deadline.
    """
    raw = str(entry.fields.get("raw", "")).encode()
    envelope = decode_envelope(raw)
    if deadline_in is not None:
        envelope.request.deadline = int(now + deadline_in)
        raw = envelope.encode()
    return raw, queue_score(envelope.request.deadline, envelope.routing.enqueue_seq)


# -- command line ---------------------------------------------------------------------


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.description = "List, show, replay or purge dead letters (the Redis transports)."
    parser.add_argument("action", choices=ACTIONS, help="what to do")
    parser.add_argument("ids", nargs="*", metavar="ID",
                        help="entry ids, as list shows them (show/replay/purge)")  # fmt: skip
    parser.add_argument("--queue", default="", metavar="NAME",
                        help="one queue's list (default: every queue served)")  # fmt: skip
    parser.add_argument("--all", action="store_true", help="every entry (replay/purge)")
    parser.add_argument("--deadline-in", type=duration, default=None, metavar="DURATION",
                        help="replay with a fresh deadline this far from now "
                        "(default: the message's own)")  # fmt: skip
    parser.add_argument("--limit", type=int, default=20, metavar="N",
                        help="newest entries list shows per queue (0: all)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def main(argv: list[str]) -> int:
    """Exit 0 when done, 1 when Redis cannot be reached or an entry cannot be replayed,
    2 on a usage or config error."""
    config, extra = daemon_config(argv, PROG, _flags)
    opts = argparse.Namespace(**extra)
    _check(config, opts)
    try:
        return anyio.run(_run, config, opts)
    except TransportError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def _check(config: AppConfig, opts: argparse.Namespace) -> None:
    transport = config.transport_config
    if isinstance(transport, GcpPubSubConfig):
        raise UsageError(
            "gcp-pubsub copies dead letters to the topic <subscription>-dead-letter; "
            "read them with a subscription to it"
        )
    if opts.action in ("replay", "purge") and not (opts.ids or opts.all):
        raise UsageError(f"{opts.action} needs entry ids or --all")
    if opts.action == "show" and not opts.ids:
        raise UsageError("show needs entry ids")


async def _run(config: AppConfig, opts: argparse.Namespace) -> int:
    transport = config.transport_config
    assert not isinstance(transport, GcpPubSubConfig)  # _check refused it
    client = connect(transport.redis_connection())
    try:
        lists = DeadLetters(transport, client)
        await lists.load([pool.gate_params for pool in config.pools])
        if opts.queue and opts.queue not in lists.queues:
            raise UsageError(f"--queue {opts.queue!r} is not a queue the daemon serves")
        with redis_errors("time"):
            seconds, micros = await client.time()
        now = seconds + micros / 1e6
        selected = await _select(lists, opts)
        if opts.action in ("list", "show"):
            _print(selected, opts, now)
            return 0
        counts = await _act(lists, selected, opts, now)
    finally:
        await client.aclose()
    print(json.dumps(counts) if opts.json else _counts_text(opts.action, counts))
    return 1 if counts.keys() & {"undecodable", "truncated"} else 0


async def _select(lists: DeadLetters, opts: argparse.Namespace) -> list[Entry]:
    per_queue = [await lists.entries(q) for q in ([opts.queue] if opts.queue else lists.queues)]
    if opts.action == "list" and opts.limit:
        per_queue = [entries[-opts.limit :] for entries in per_queue]  # the newest
    entries = [entry for entries in per_queue for entry in entries]
    if not opts.ids:
        return entries
    missing = set(opts.ids) - {e.id for e in entries}
    if missing:
        raise UsageError(f"no dead letter with id {', '.join(sorted(missing))}")
    return list({e.id: e for e in entries if e.id in opts.ids}.values())  # one per id


async def _act(
    lists: DeadLetters, entries: list[Entry], opts: argparse.Namespace, now: float
) -> dict[str, int]:
    """Replay or purge each entry; one log line each; counts by outcome."""
    outcomes: Counter[str] = Counter()
    for entry in entries:
        if opts.action == "replay":
            outcome = await _replay(lists, entry, opts.deadline_in, now)
        else:
            outcome = "purged" if await lists.purge(entry) else "gone"
        outcomes[outcome] += 1
        summary = entry.summary(now)
        log.info(f"dead_letter_{opts.action}", outcome=outcome, queue=entry.queue,
                 entry=entry.id, reason=summary["reason"],
                 request_id=summary["request_id"])  # fmt: skip
    return dict(outcomes)


async def _replay(lists: DeadLetters, entry: Entry, deadline_in: float | None, now: float) -> str:
    """Replay one entry; the outcome's name. One that cannot be replayed is said on stderr."""
    try:
        done = await lists.replay(entry, deadline_in, now)
    except InvalidMessage as exc:
        _cannot_replay(entry, f"the message does not decode ({exc})")
        return "undecodable"
    if done == -2:
        _cannot_replay(entry, "the entry holds only the start of a message too large to keep")
    return {1: "replayed", 0: "gone", -1: "no_subscriber", -2: "truncated"}[done]


def _cannot_replay(entry: Entry, why: str) -> None:
    print(f"{PROG}: {entry.id} on {entry.queue} cannot be replayed: {why}; it stays on the "
          f"dead-letter list ('show {entry.id}' to read it, 'purge {entry.id}' once the "
          "producer is fixed)", file=sys.stderr)  # fmt: skip


def _print(entries: list[Entry], opts: argparse.Namespace, now: float) -> None:
    if opts.action == "show":
        shown = [{"queue": e.queue, "id": e.id, **e.fields} for e in entries]
        print(json.dumps(shown, indent=2, ensure_ascii=False))  # whole entries: JSON anyway
        return
    rows = [entry.summary(now) for entry in reversed(entries)]  # newest first
    if opts.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    print("QUEUE\tID\tAGE\tREASON\tREQUEST ID\tDETAIL")
    for row in rows:
        age = "-" if row["age_seconds"] is None else f"{row['age_seconds']:.0f}s"
        cells = [row["queue"], row["id"], age, row["reason"],
                 row["request_id"] or "-", row["detail"][:DETAIL_WIDTH]]  # fmt: skip
        print("\t".join(cells))


def _counts_text(action: str, counts: dict[str, int]) -> str:
    if not counts:
        return f"{action}: nothing to do"
    return ", ".join(f"{outcome.replace('_', ' ')} {n}" for outcome, n in sorted(counts.items()))
