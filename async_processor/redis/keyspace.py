"""Where a queue's derived keys live: today's names (standalone, sentinel) or the queue's
hash slot (cluster).

Input: the connection mode and queue names. Output: key names for the redis-sortedset
transport and the client library, the startup check that a queue's result list shares
its slot, and scripts that also run inside a cluster pipeline.

In cluster mode every Lua step must touch one slot, so every key derived for queue ``Q``
carries Q's hash tag: ``{Q}:claimed``, ``{Q}:claim-owners``, ``{Q}:claims-idx`` (as upstream
names them), the previous release's ``{Q}:inflight``, ``{Q}:inflight:meta``,
``{Q}:dead-letter``, ``{Q}:retry`` (a retry set per queue; ``retry_queue_name`` is not
used), and the markers ``{Q}:request-active:<id>``, ``{Q}:request-cancel:<id>``,
``{Q}:request-done:<id>:<fp>``. A queue whose name already has a tag (``{t}requests``) keeps
it: its own keys are today's names (``{t}requests:inflight``, which hash on ``t``), its
markers ``{t}:…``. Standalone and sentinel names stay exactly the Go daemon's
(``redis.keys``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline
from redis.commands.core import AsyncScript

from async_processor.config.redis import hash_tag, shares_slot, slot
from async_processor.redis import keys, scripts

UPKEEP_GROUP = 256  # queues per upkeep script call (each call stays well under a ms)
RELOAD_EVERY = 10.0  # seconds between script loads on every primary (cluster pipelines)


@dataclass(frozen=True)
class KeySpace:
    """Key names for one connection mode (``cluster`` puts them in each queue's slot)."""

    cluster: bool = False
    # A retry set per queue (``<q>:retry``) outside cluster mode too: with discovered
    # queues, so a due retry never goes to a queue other than its own.
    queue_retry: bool = False

    def _own(self, queue: str, key: Callable[[str], str]) -> str:
        """``key`` (one of ``redis.keys``' per-queue names) of ``queue``, or of ``{queue}``
        in cluster mode when the name has no tag of its own: one rule for every derived
        key, so a standalone name is always exactly the ``redis.keys`` one."""
        return key(f"{{{queue}}}" if self.cluster and hash_tag(queue) == queue else queue)

    def _marker(self, queue: str, name: str) -> str:
        return f"{{{hash_tag(queue)}}}:{name}" if self.cluster else name

    def claimed(self, queue: str) -> str:
        """Upstream's claim hash (claim key -> member), ``{Q}:claimed`` in cluster mode."""
        return self._own(queue, keys.claimed_key)

    def owners(self, queue: str) -> str:
        return self._own(queue, keys.claim_owners_key)

    def claims_idx(self, queue: str) -> str:
        return self._own(queue, keys.claims_idx_key)

    def claim_keys(self, queue: str) -> list[str]:
        """The three claim keys, in the order every claim script takes them."""
        return [self.claimed(queue), self.owners(queue), self.claims_idx(queue)]

    def claim_record(self, queue: str, call: str) -> str:
        """A claim call's record (``claim-batch:<owner>:<n>``), in the queue's slot."""
        return self._marker(queue, keys.CLAIM_RECORD_PREFIX + call)

    def inflight(self, queue: str) -> str:
        return self._own(queue, keys.inflight_key)

    def inflight_meta(self, queue: str) -> str:
        return self._own(queue, keys.inflight_meta_key)

    def dead_letter(self, queue: str) -> str:
        return self._own(queue, keys.dead_letter_key)

    def sequence(self, queue: str, deadline: int) -> str:
        """The counter of submissions with ``deadline`` (upstream's order tie-breaker):
        ``request-seq:<Q>:<deadline>``, in cluster mode ``request-seq:{Q}:<deadline>``
        unless ``Q`` has a tag of its own, as upstream names it."""
        return self._own(queue, lambda q: keys.sequence_key(q, deadline))

    def live(self, queue: str, request_id: str) -> str:
        """The queue's id index: the token of the id's live submission (client library)."""
        return self._own(queue, lambda q: keys.live_key(q, request_id))

    def retry(self, queue: str, configured: str) -> str:
        """The retry set ``queue``'s deferrals go to: the shared one, or per queue (cluster)."""
        return self._own(queue, keys.retry_key) if self.cluster or self.queue_retry else configured

    def active(self, queue: str, request_id: str) -> str:
        return self._marker(queue, keys.active_key(request_id))

    def cancel(self, queue: str, request_id: str) -> str:
        return self._marker(queue, keys.cancel_key(request_id))

    def done(self, queue: str, request_id: str, fingerprint: str) -> str:
        return self._marker(queue, keys.done_key(request_id, fingerprint))

    def slot_groups(self, queues: Sequence[str]) -> list[list[str]]:
        """``queues`` in groups one script call may cover: one slot each in cluster mode,
        all together otherwise; at most ``UPKEEP_GROUP`` queues a group."""
        groups: dict[int, list[str]] = {}
        for queue in queues:
            groups.setdefault(slot(queue) if self.cluster else 0, []).append(queue)
        return [
            group[start : start + UPKEEP_GROUP]
            for group in groups.values()
            for start in range(0, len(group), UPKEEP_GROUP)
        ]

    def routable(self, queue: str, result_list: str) -> bool:
        """Whether a message-named result list can be written with ``queue``'s ack: in
        cluster mode it and the keys kept beside it share the queue's slot (checking the
        list alone let a name like ``x{3606`` through, whose counter key hashes elsewhere:
        every write of that result failed, and the message went back to the gateway at
        each lease until its deadline)."""
        return not self.cluster or shares_slot(queue, result_list)

    def own_keys(self, own: keys.OwnKeys, queues: Iterable[str]) -> keys.OwnKeys:
        """``own`` plus the cluster names of each queue's keys and markers, and with
        ``queue_retry`` each queue's retry set."""
        if not self.cluster and not self.queue_retry:
            return own
        names = list(queues)
        exact = {f(q) for q in names for f in (self.inflight, self.inflight_meta)}
        exact |= {key for q in names for key in self.claim_keys(q)}
        exact |= {f(q) for q in names for f in (self.dead_letter, lambda q: self.retry(q, ""))}
        prefixes = {self._marker(q, p) for q in names for p in keys.OWN_PREFIXES}
        return replace(own, exact=own.exact | exact, prefixes=(*own.prefixes, *prefixes))

    def scripts(self, client: Redis) -> dict[str, AsyncScript]:
        """Every script on ``client``; in cluster mode they also run inside a pipeline."""
        if not self.cluster:
            return scripts.register_scripts(client)
        return {
            name: _ClusterScript(client, scripts.script_source(name))
            for name in scripts.SCRIPT_NAMES
        }


class _ClusterScript(AsyncScript):
    """A cluster pipeline cannot load a missing script before it runs (redis-py does that
    only for ``Pipeline``). So the script is loaded on every primary before its first use
    in a pipeline and again every ``RELOAD_EVERY`` s, and goes as EVALSHA: EVAL would
    send and hash its ~3 KB on every call (about 7 us of Redis CPU more per message). A
    node that lost its scripts (restart, promoted replica) fails those calls, which the
    callers retry, until the next reload."""

    def __init__(self, client: Redis, source: str) -> None:
        super().__init__(client, source)
        self._loaded_at = -math.inf

    async def __call__(
        self,
        keys: Sequence[Any] | None = None,
        args: Iterable[Any] | None = None,
        client: Any = None,
    ) -> Any:
        if isinstance(client, ClusterPipeline):
            await self._load_now_and_then()
            key_list = list(keys or [])
            # ClusterPipeline blocks its evalsha() method because it cannot load a missing
            # script; we load them ourselves, and it routes the command by its keys.
            command = ("EVALSHA", self.sha, len(key_list), *key_list, *(args or []))
            return client.execute_command(*command)
        return await super().__call__(keys, args, client)

    async def _load_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._loaded_at >= RELOAD_EVERY:
            await self.registered_client.script_load(self.script)  # every primary
            self._loaded_at = now
