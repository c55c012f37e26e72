"""OpenAI's list pages: ``after`` (an id cursor), ``limit``, ``order``.

Stage: the API's HTTP edge. Input: the query and an index of ids. Output: the page
object ``{"object": "list", "data", "first_id", "last_id", "has_more"}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from async_processor.api.errors import ApiError
from async_processor.api.store import Store


def limit_of(query: Mapping[str, str], default: int, most: int) -> int:
    text = query.get("limit", str(default))
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}", param="limit")
    return int(text)


def order_of(query: Mapping[str, str], default: str) -> str:
    order = query.get("order", default)
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order")
    return order


async def page(
    store: Store,
    index: str,
    query: Mapping[str, str],
    render: Callable[[str], Awaitable[dict[str, Any] | None]],
    limits: tuple[int, int],
) -> web.Response:
    """One page of the objects ``render`` makes of the index's ids (None: left out, e.g.
    another purpose; the page is filled from further ids, so a short page means the end).
    ``limits``: the default and the largest ``limit``; ``order`` defaults to newest first."""
    order = order_of(query, "desc")
    after = query.get("after") or None
    if after is not None and (len(after) > 200 or not after.isprintable()):
        raise ApiError(400, "after must be an object id", param="after")
    limit = limit_of(query, *limits)
    data: list[dict[str, Any]] = []
    more = True
    while len(data) < limit and more:  # until the page is full of objects render keeps
        ids, more = await store.page(index, after, limit - len(data), order)
        data += [obj for obj in [await render(i) for i in ids] if obj is not None]
        after = ids[-1] if ids else after
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )
