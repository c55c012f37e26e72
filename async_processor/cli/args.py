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
from collections.abc import Mapping
from typing import Any

from async_processor.config import (
    ENV_PREFIX,
    AppConfig,
    ExtendParser,
    build_config,
    parse_settings,
    usable_env,
)
from async_processor.durations import parse_duration
from async_processor.logs import configure_logging


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


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def read_env(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Defaults of ``parser``'s options from ``ASYNC_PROCESSOR_<DEST>`` where set (flags win).

    The value goes through the option's ``type`` as a flag's would (argparse converts
    string defaults), so a bad variable is reported like a bad flag. Empty means unset, and
    so does a service link: a Service named ``async-processor`` injects
    ``ASYNC_PROCESSOR_PORT=tcp://...`` into every pod of its namespace (``sim --port``).
    """
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        value = env.get(env_name(action.dest), "")
        if not usable_env(value):  # empty, or a Kubernetes service link (tcp://...)
            continue
        if action.const is not None and action.nargs == 0:  # store_true / store_false
            action.default = value.lower() in ("1", "true", "yes", "on")
        else:
            action.default = value


def describe(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X; env NAME)" to each option's help, once, where it applies."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version") or not action.help:
            continue
        notes = []
        default = action.default
        if default not in (None, "", False, argparse.SUPPRESS) and "(default" not in action.help:
            notes.append(f"default: {default}")
        notes.append(f"env {env_name(action.dest)}")
        action.help = f"{action.help} ({'; '.join(notes)})"


def subcommand_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser every delegated subcommand starts from (one formatter, no abbreviations)."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG_IN_UPPER_SNAKE>; flags win.",
    )


def parse(
    parser: argparse.ArgumentParser, argv: list[str], env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Describe the options, take env defaults (``os.environ`` by default), parse ``argv``."""
    describe(parser)
    read_env(parser, os.environ if env is None else env)
    return parser.parse_args(argv)


def daemon_config(
    argv: list[str], prog: str, extend: ExtendParser
) -> tuple[AppConfig, Mapping[str, Any]]:
    """For operator commands (status, dead-letters): the daemon's flags, env and config
    files (so they look at the daemon's own keys), plus the command's own flags.

    Logs go to stderr as the daemon's would; stdout stays the command's output.
    """
    settings = parse_settings(argv, os.environ, prog=prog, extend=extend)
    configure_logging(settings.log_level, settings.log_format)
    return build_config(settings, os.environ), settings.extra
