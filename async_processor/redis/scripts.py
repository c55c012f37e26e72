"""The one Lua loader: every script the daemon, its gates and its tools run is a file in
``redis/lua/``.

Input: a script's name. Output: its source (the redis-sortedset scripts after the shared
checks of ``lib.lua``) or, for the transport, every one of them registered on a client
(EVALSHA, loaded on first use).
"""

from __future__ import annotations

from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

SCRIPT_NAMES = (
    "claim",
    "ready",
    "extend",
    "reap",
    "reap_legacy",
    "complete",
    "defer",
    "dead_letter",
    "move_due",
    "move_due_own",
    "cancel",
    "expired",
    "expired_many",
    "submit",
    "retain",
)


def script_source(name: str) -> str:
    """The Lua source of ``lua/<name>.lua`` after the shared helpers of ``lua/lib.lua``."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown Lua script {name!r} (known: {', '.join(SCRIPT_NAMES)})")
    return lua_source("lib") + lua_source(name)


def lua_source(name: str) -> str:
    """The text of ``lua/<name>.lua`` (packaged as data); scripts live in files, not in
    Python strings, so they read, diff and lint as Lua."""
    return (resources.files("async_processor.redis") / "lua" / f"{name}.lua").read_text(
        encoding="utf-8"
    )


def register_scripts(client: Redis) -> dict[str, AsyncScript]:
    """Every script registered on ``client`` (EVALSHA, loaded on first use)."""
    return {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}
