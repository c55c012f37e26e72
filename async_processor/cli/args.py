"""Argument helpers shared by every ``async-processor`` subcommand's parser.

Stage: outside the daemon (the command line). Input: an ``argparse`` parser and the
environment. Output: parsers that take durations in one syntax (Go durations; a plain
number still means seconds) and read ``ASYNC_PROCESSOR_<FLAG>`` for any flag not given,
as ``run`` does, with each default shown once in ``--help``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from async_processor.config import (
    ENV_PREFIX,
    FLAGS,
    AppConfig,
    ExtendParser,
    build_config,
    flag_parser,
    parse_settings,
    usable_env,
)
from async_processor.config.environment import (
    apply_env,
    command_of,
    env_names,
    options,
    warn_unknown,
)
from async_processor.durations import parse_duration
from async_processor.errors import ConfigError
from async_processor.logs import configure_logging

# In a pod, PID 1 is the daemon (the image's entrypoint): its command line holds the
# config flags the chart passes, which ``kubectl exec ... async-processor status`` lacks.
DAEMON_CMDLINE = "/proc/1/cmdline"
TRANSPORT_CONFIG_ENV = (f"{ENV_PREFIX}TRANSPORT_CONFIG_FILE", f"{ENV_PREFIX}TRANSPORT_CONFIG")
DAEMON_COMMANDS = ("run", "exporter")  # PID 1 commands whose flags are the daemon's config
# Flags named as the daemon's (e.g. --transport-config-file) share its variable.
DAEMON_DESTS = frozenset(flag.dest for flag in FLAGS)


def duration(text: str) -> float:
    """Seconds from ``90s``/``1h30m`` (Go syntax) or a plain number of seconds, >= 0.

    Named ``duration`` so that argparse reports "invalid duration value: 'x'".
    """
    try:
        seconds = float(text)
    except ValueError:
        seconds = parse_duration(text)
    if not 0 <= seconds < math.inf:  # also refuses nan
        raise ValueError(f"{text!r} is not a duration >= 0")
    return seconds


def describe(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X; env NAME)" to each option's help, once, where it applies."""
    command = command_of(parser.prog)
    for action in options(parser):
        if not action.help or action.help == argparse.SUPPRESS:
            continue
        notes = []
        default = action.default
        if default not in (None, "", False, argparse.SUPPRESS) and "(default" not in action.help:
            notes.append(f"default: {default}")
        notes.append(f"env {env_names(action, command, DAEMON_DESTS)[0]}")
        if action.help.endswith(")") and "(default" in action.help:  # one pair of brackets
            action.help = f"{action.help[:-1]}; {'; '.join(notes)})"
        else:
            action.help = f"{action.help} ({'; '.join(notes)})"


def subcommand_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser every delegated subcommand starts from (one formatter, no abbreviations)."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        epilog=f"Each flag can also be set in the environment (the name is in its help: "
        f"{ENV_PREFIX}<COMMAND>_<FLAG>, or {ENV_PREFIX}<FLAG> for the daemon's own flags); "
        "flags win.",
    )


def parse(
    parser: argparse.ArgumentParser, argv: list[str], env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Describe the options, take env defaults (``os.environ`` by default; scoped names
    first, config.environment), warn about variables no flag reads, parse ``argv``."""
    environ = os.environ if env is None else env
    describe(parser)
    command = command_of(parser.prog)
    apply_env(parser.prog, options(parser), environ, command, DAEMON_DESTS, legacy=True)
    own = {n for a in options(parser) for n in env_names(a, command, DAEMON_DESTS)}
    warn_unknown(parser.prog, environ, own | {flag.env for flag in FLAGS})
    return parser.parse_args(argv)


# The daemon's flags an operator command's --help lists: those that choose the broker, its
# keys and the gates' keys (status, dead-letters), and the logs.
CONFIG_FLAGS = (
    "transport", "transport-config", "transport-config-file", "pool-config-file",
    "log-level", "log-format",
)  # fmt: skip


def daemon_config(
    argv: list[str], prog: str, extend: ExtendParser, shown: Sequence[str] = CONFIG_FLAGS
) -> tuple[AppConfig, Mapping[str, Any]]:
    """For operator commands (status, dead-letters): the daemon's flags, env and config
    files (so they look at the daemon's own keys), plus the command's own flags.

    Logs go to stderr as the daemon's would; stdout stays the command's output.
    """
    argv = with_pod_flags(argv, os.environ, prog)
    settings = parse_settings(argv, os.environ, prog=prog, extend=extend, shown=shown)
    configure_logging(settings.log_level, settings.log_format)
    return build_config(settings, os.environ), settings.extra


def with_pod_flags(argv: list[str], env: Mapping[str, str], prog: str) -> list[str]:
    """``argv`` after the daemon's own config flags when neither it nor ``env`` names a
    transport config and PID 1 is the daemon (an operator command run in its pod); the
    command's flags still win. Otherwise a ConfigError saying where it looked."""
    if _names_transport_config(argv, env) or {"-h", "--help"} & set(argv):
        return argv
    daemon, why = daemon_flags()
    if not daemon.get("transport-config-file") and not daemon.get("transport-config"):
        raise ConfigError(
            "no transport config: pass the daemon's --transport and --transport-config-file "
            f"(or set {TRANSPORT_CONFIG_ENV[0]}); looked at this command's flags, "
            f"{' and '.join(TRANSPORT_CONFIG_ENV)}, and {DAEMON_CMDLINE} ({why})"
        )
    print(f"{prog}: using the daemon's flags from {DAEMON_CMDLINE}", file=sys.stderr)
    return [*(f"--{name}={value}" for name, value in daemon.items()), *argv]


def _names_transport_config(argv: list[str], env: Mapping[str, str]) -> bool:
    given = any(arg.startswith("--transport-config") for arg in argv)
    return given or any(usable_env(env.get(name, "")) for name in TRANSPORT_CONFIG_ENV)


def daemon_flags() -> tuple[dict[str, str], str]:
    """The daemon's flags from PID 1's command line (flag name -> value), or ``{}`` and
    why not."""
    try:
        with open(DAEMON_CMDLINE, "rb") as handle:
            words = handle.read().decode(errors="replace").split("\0")
    except OSError as exc:
        return {}, f"unreadable: {exc.strerror}"
    rest = _after_program(words)
    if rest is None:
        return {}, "PID 1 is not async-processor"
    if rest and not rest[0].startswith("-"):
        if rest[0] not in DAEMON_COMMANDS:
            return {}, f"PID 1 is async-processor {rest[0]}"
        rest = rest[1:]
    try:
        known, _ = flag_parser().parse_known_args(rest)
    except ConfigError as exc:
        return {}, f"PID 1's flags do not parse: {exc}"
    values = vars(known)
    flags = {f.name: values[f.dest] for f in FLAGS if values.get(f.dest) is not None}
    return flags, "" if flags.keys() & {"transport-config", "transport-config-file"} else (
        "PID 1 names no transport config"
    )


def _after_program(words: list[str]) -> list[str] | None:
    """The words after ``async-processor`` (or ``python -m async_processor``), or None."""
    for index, word in enumerate(words):
        if os.path.basename(word) == "async-processor" or (
            word == "async_processor" and index and words[index - 1] == "-m"
        ):
            return [w for w in words[index + 1 :] if w]
    return None
