"""Which queues a daemon's transport config serves, for ``submit``, ``results`` and ``cancel``.

Stage: outside the daemon (the producer commands). Input: the daemon's sorted-set
transport config file (the one ``--transport-config-file`` names, read as raw JSON so a
gate's ``${SECRET}`` need not be set where the command runs) and the queue the operator
named, if any. Output: the queue to write to and its result list, or a ``ConfigError``
that names the file's queues: a queue no daemon serves would hold its requests forever
(``--force`` writes there anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from async_processor.config import read_transport_file
from async_processor.config.transports import QUEUE_PLACEHOLDER
from async_processor.errors import ConfigError
from async_processor.redis.keys import DEFAULT_RESULT_LIST


@dataclass(frozen=True, slots=True)
class Served:
    """A transport config's queues: name -> result list, and its discovery source."""

    source: str  # "--transport-config-file <path>", for messages
    queues: dict[str, str]
    result_list: str  # the transport-wide result list
    set_key: str = ""  # queue_discovery.set_key: queues listed in this Redis set
    key_prefix: str = ""  # queue_discovery.key_prefix: queues whose name starts so
    template_results: str = ""  # the discovery template's result_queue_name

    def lists_queues(self) -> bool:
        return bool(self.queues or self.set_key or self.key_prefix)

    def describe(self) -> str:
        """The served queues in words, for an error message."""
        parts = [", ".join(self.queues)] if self.queues else []
        if self.set_key:
            parts.append(f"those listed in the Redis set {self.set_key!r}")
        if self.key_prefix:
            parts.append(f"those named {self.key_prefix}*")
        return "; ".join(parts) or "none"

    def result_list_of(self, queue: str) -> str:
        if queue in self.queues:
            return self.queues[queue]
        if self.template_results:
            return self.template_results.replace(QUEUE_PLACEHOLDER, queue)
        return self.result_list

    def default_queue(self) -> str:
        """The one configured queue; a ConfigError naming them when there are several."""
        if len(self.queues) == 1 and not (self.set_key or self.key_prefix):
            return next(iter(self.queues))
        raise ConfigError(
            f"{self.source} serves several queues ({self.describe()}): pass --queue NAME"
        )

    def default_result_list(self) -> str:
        """The one result list the config writes to; a ConfigError when there are several."""
        lists = sorted({*self.queues.values(), self.result_list})
        if self.set_key or self.key_prefix:
            lists = sorted({*lists, self.template_results or self.result_list})
        if len(lists) == 1:
            return lists[0]
        raise ConfigError(
            f"{self.source} writes results to several lists ({', '.join(lists)}): "
            "pass --result-queue NAME"
        )

    def statically_served(self, queue: str) -> bool:
        """Served without asking Redis: configured, or matching the discovery prefix."""
        return queue in self.queues or bool(self.key_prefix and queue.startswith(self.key_prefix))


def served_queues(path: str) -> Served:
    """The queues the sorted-set config file at ``path`` serves (ConfigError if unreadable)."""
    raw = read_transport_file(path)
    source = f"--transport-config-file {path}"
    result_list = _text(raw.get("result_queue_name")) or DEFAULT_RESULT_LIST
    queues: dict[str, str] = {}
    for entry in _objects(raw.get("queues")):
        name = _text(entry.get("queue_name"))
        if name:
            queues[name] = _text(entry.get("result_queue_name")) or result_list
    discovery = raw.get("queue_discovery")
    discovery = discovery if isinstance(discovery, dict) else {}
    template = discovery.get("template")
    return Served(
        source=source,
        queues=queues,
        result_list=result_list,
        set_key=_text(discovery.get("set_key")),
        key_prefix=_text(discovery.get("key_prefix")),
        template_results=_text(template.get("result_queue_name"))
        if isinstance(template, dict)
        else "",
    )


def _objects(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
