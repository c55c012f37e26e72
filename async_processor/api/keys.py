"""Redis key names of the API's state (docs/batch-api.md, "State in Redis").

Input: ids and tenant names. Output: key names. Every key of one object carries that
object's hash tag, so each script touches one cluster slot; ids are
``<prefix><12 hex of ms time><16 random hex>``, so byte order is creation order.
"""

from __future__ import annotations

import secrets
import time

from async_processor.config.redis import hash_tag

PREFIX = "async-processor:api"
OPEN_BATCHES = f"{PREFIX}:open-batches"
EXPIRIES = f"{PREFIX}:expiries"  # zset: "file:<id>" / "batch:<id>" -> when to delete it
RETENTION_LOCK = f"{PREFIX}:retention-lock"  # the replica sweeping expiries
REPLICAS = f"{PREFIX}:replicas"  # zset: replica name -> last heartbeat (Redis clock)
FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"


def new_id(prefix: str) -> str:
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


def file_key(file_id: str) -> str:
    return f"{PREFIX}:file:{{{file_id}}}"


def files_index(tenant: str) -> str:
    return f"{PREFIX}:files:{{{tenant}}}"


def batch_key(batch_id: str) -> str:
    return f"{PREFIX}:batch:{{{batch_id}}}"


def batch_part(batch_id: str, part: str) -> str:
    """``ids``, ``done``, ``out``, ``err`` or ``lease`` of a batch, in its slot."""
    return f"{batch_key(batch_id)}:{part}"


def arrival_copy(file_id: str) -> str:
    """The storage id of an input-ordered output or error file's copy in recorded order
    (the results stream reads it; it has no File record and expires with the file)."""
    return f"{file_id}-arrival"


def batches_index(tenant: str) -> str:
    return f"{PREFIX}:batches:{{{tenant}}}"


def tenant_open(tenant: str) -> str:
    """zset: the tenant's batches not yet terminal (its open-batch cap counts them)."""
    return f"{PREFIX}:open:{{{tenant}}}"


def tenant_stored(tenant: str) -> str:
    """hash: the tenant's file id -> bytes (its stored-bytes cap sums them)."""
    return f"{PREFIX}:stored:{{{tenant}}}"


def idempotency_key(tenant: str, digest: str) -> str:
    return f"{PREFIX}:idem:{{{tenant}}}:{digest}"


def result_list(queue: str) -> str:
    """The API's result list for ``queue``: in the queue's hash slot (cluster mode)."""
    return f"{{{hash_tag(queue)}}}:api-results"


def line_id(batch_id: str, index: int) -> str:
    """The queue message id of a batch line (0-based index)."""
    return f"{batch_id}:{index}"


def parse_line_id(request_id: str) -> tuple[str, int] | None:
    """(batch id, line index) of a line's message id, None for any other id."""
    batch_id, _, index = request_id.rpartition(":")
    if not batch_id.startswith(BATCH_PREFIX) or not (index.isascii() and index.isdigit()):
        return None
    return batch_id, int(index)


REQUEST_PREFIX = "areq:"


def request_key(tenant: str, request_id: str) -> str:
    return f"{PREFIX}:request:{{{tenant}:{request_id}}}"


def request_message_id(tenant: str, request_id: str) -> str:
    """The queue message id of a single request (tenants and request ids hold no ``:``)."""
    return f"{REQUEST_PREFIX}{tenant}:{request_id}"


def parse_request_message_id(message_id: str) -> tuple[str, str] | None:
    if not message_id.startswith(REQUEST_PREFIX):
        return None
    tenant, _, request_id = message_id.removeprefix(REQUEST_PREFIX).partition(":")
    return (tenant, request_id) if tenant and request_id else None
