"""The ``async-processor`` command and its subcommands (``async-processor --help`` lists them).

Input: argv and the environment. Output: an exit code. ``run`` (also the default when
only flags are given, as with the Go binary) loads the config and hands it to
``pipeline.daemon.run``; ``check-config`` prints the effective config with secrets masked.
The other subcommands live in their own modules, imported only when used, and get the
rest of argv (``submit``/``results``/``cancel`` share ``client.commands`` and get the
subcommand name first). Any ``ConfigError`` at startup is one stderr line and exit 2;
an unknown subcommand is an argparse error naming the known ones (also exit 2).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

import anyio
import structlog

from async_processor.cli.args import with_pod_flags
from async_processor.config import AppConfig, build_config, parse_settings
from async_processor.errors import ConfigError, UsageError
from async_processor.logs import configure_logging, redact

PROG = "async-processor"
CONFIG_ERROR_EXIT = 2
GC_YOUNG_THRESHOLD = 50_000  # net allocations between young collections (_tune_gc)


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its one-line help, and the module whose ``main`` runs it ("" = here)."""

    help: str
    module: str = ""
    with_name: bool = False  # main() gets the subcommand name first (shared modules)


COMMANDS: dict[str, Command] = {
    "run": Command("run the daemon (the default when only flags are given)"),
    "check-config": Command(
        "validate the config and print it, secrets masked; --probe: reach the broker, "
        "the gateways and each gate's source once"
    ),
    "sim": Command("serve the OpenAI-compatible inference simulator", "sim.app"),
    "demo": Command("the whole pipeline on this machine, with a live summary", "demo.run"),
    "submit": Command(
        "put requests from a JSONL file on a sorted-set queue", "client.commands", True
    ),
    "results": Command("read results from a result list as JSONL", "client.commands", True),
    "cancel": Command("cancel requests by id", "client.commands", True),
    "status": Command("queue depths, in flight, retries, dead letters", "ops.status"),
    "dead-letters": Command("list, show, replay or purge dead letters", "ops.deadletters"),
    "api": Command("serve the OpenAI Files and Batches API over the queues", "api.app"),
    "exporter": Command("serve the queues' backlog for autoscalers (KEDA)", "ops.exporter"),
}
# A first argument among these is the top-level parser's, not a flag of ``run``.
TOP_LEVEL_FLAGS = ("-h", "--help", "--version")

log = structlog.get_logger(__name__)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if env is None else env
    command, rest = _split(args)
    if command is None:
        return _top_level(args[:1])
    try:
        if command == "check-config":
            return check_config(rest, environ)
        if COMMANDS[command].module:
            return _delegate(command, rest)
        return run(rest, environ)
    except (ConfigError, BaseExceptionGroup) as exc:  # a task group wraps what it raises
        config_error = _find_config_error(exc)
        if config_error is None:
            raise
        label = f" {command}:" if isinstance(config_error, UsageError) else ": config error:"
        print(f"{PROG}{label} {config_error}", file=sys.stderr)
        return CONFIG_ERROR_EXIT


def run(argv: Sequence[str], env: Mapping[str, str]) -> int:
    settings = parse_settings(argv, env)
    configure_logging(settings.log_level, settings.log_format)
    config = build_config(settings, env)
    log.info("starting", version=_version(), config=effective_config(config))
    daemon = _import("pipeline.daemon", "run")
    _tune_gc()
    # uvloop: in 3 paired runs (bench.overhead, 20,000 messages, 256 workers, zero-latency
    # gateway) the daemon's throughput was 0.89-1.16x the baseline loop's on it, against
    # 0.56-0.71x on asyncio's own loop, at 0.38-0.46 vs 0.42-0.48 CPU ms per message.
    anyio.run(daemon.run, config, backend_options={"use_uvloop": True})
    return 0


def _tune_gc() -> None:
    """What start-up loaded (modules, config: ~70,000 objects) is never garbage: frozen, no
    collection walks it again. The young generation is collected after 50,000 net
    allocations instead of 700: every message's objects live as long as its request (1 s at
    bench.littles_law), so at 700 the collector ran ~20 times a second, walked each of them
    there and again when promoted (0.46-0.66 s of a 20 s run, pauses up to 60 ms, the loop
    stalled meanwhile). Refcounting still frees the garbage that has no cycles at once."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def check_config(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Validate flags, files and plugin types; print the effective config as JSON."""
    prog = f"{PROG} check-config"
    argv = with_pod_flags(list(argv), env, prog)
    settings = parse_settings(argv, env, prog=prog, extend=_probe_flag)
    configure_logging(settings.log_level, settings.log_format)  # stderr: stdout is the JSON
    config = build_config(settings, env)
    validate_plugins: Callable[[AppConfig], Any] | None = getattr(
        _optional("pipeline.daemon"), "validate_plugins", None
    )
    if validate_plugins is not None:
        validate_plugins(config)
    print(json.dumps(effective_config(config), indent=2, sort_keys=False))
    return int(_import("ops.probe", "main").main(config)) if settings.extra["probe"] else 0


def _probe_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--probe", action="store_true",
        help="then reach the broker and each gateway, run each metric gate's query once, "
        "print what it would use; exit 1 on any failure",
    )  # fmt: skip


def effective_config(config: AppConfig) -> dict[str, Any]:
    """The config as JSON-able data, with every secret masked (for printing and logs)."""
    data = config.model_dump(mode="json", by_alias=True)
    masked: dict[str, Any] = redact(data)
    return masked


def _version() -> str:
    try:
        return metadata.version("async-processor")
    except metadata.PackageNotFoundError:
        return "unknown"


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """(subcommand, rest); flags alone (or nothing) mean ``run``; None: not a subcommand."""
    if not args or (args[0].startswith("-") and args[0] not in TOP_LEVEL_FLAGS):
        return "run", args
    if args[0] in COMMANDS:
        return args[0], args[1:]
    return None, args


def _top_level(args: list[str]) -> int:
    """``--help``, ``--version`` or an unknown command: the top-level parser answers."""
    try:
        top_level_parser().parse_args(args)
    except SystemExit as exc:  # argparse exits after printing; main returns the code
        return int(exc.code or 0)
    raise AssertionError(f"the top-level parser accepted {args!r} without exiting")


def top_level_parser() -> argparse.ArgumentParser:
    """One help page: the commands, what each does, where their flags are described."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=30),
        description="Dispatches queued LLM inference requests to an llm-d gateway "
        "under admission control.",
        epilog=f"'{PROG} COMMAND --help' shows a command's flags. Flags without a command "
        "mean run, as with the Go daemon.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, command in COMMANDS.items():
        commands.add_parser(name, help=command.help)
    return parser


def _delegate(command: str, rest: list[str]) -> int:
    entry = COMMANDS[command]
    module = _import(entry.module, "main")
    code = module.main([command, *rest] if entry.with_name else rest)
    return int(code or 0)


def _import(module_name: str, attribute: str) -> ModuleType:
    module = _optional(module_name)
    if module is None or not hasattr(module, attribute):
        raise SystemExit(f"{PROG}: async_processor.{module_name} is not available in this build")
    return module


def _optional(module_name: str) -> ModuleType | None:
    """``async_processor.<module_name>``, or None when that module does not exist."""
    qualified = f"async_processor.{module_name}"
    try:
        return importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name != qualified:
            raise  # the module exists but one of its imports is missing: a real error
        return None


def _find_config_error(exc: BaseException) -> ConfigError | None:
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_config_error(inner)
            if found is not None:
                return found
    return None
