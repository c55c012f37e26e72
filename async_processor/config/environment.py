"""``ASYNC_PROCESSOR_*`` variables: which one sets which flag of which command, and a
warning for those no flag of the command reads (a typo was silently ignored).

The rule: the daemon's flags (``async-processor run --help``) are
``ASYNC_PROCESSOR_<FLAG>``, read by every command that reads the daemon's config (run,
check-config, status, dead-letters, exporter, and the producer commands'
``--transport-config-file``): they describe one daemon, wherever it is looked at. A
command's own flags are ``ASYNC_PROCESSOR_<COMMAND>_<FLAG>`` (``ASYNC_PROCESSOR_RESULTS_COUNT``
for ``results --count``), so one command's setting never changes another's. The unscoped
names the producer, ``sim`` and ``api`` commands read before keep working, with a warning
naming the scoped one. Input: an argparse parser, its command and the environment. Output:
option defaults taken from the environment, and warnings on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Collection, Mapping

from async_processor.registry import did_you_mean

ENV_PREFIX = "ASYNC_PROCESSOR_"
# Every subcommand (cli.main.COMMANDS; a test keeps the two lists equal): a variable
# scoped to another command is that command's, not a typo of this one's.
COMMANDS = (
    "run", "check-config", "sim", "demo", "api", "submit", "results", "cancel", "status",
    "dead-letters", "exporter",
)  # fmt: skip
# Read outside the flags (logs.PAYLOAD_ENV).
OTHER_VARIABLES = frozenset({f"{ENV_PREFIX}LOG_PAYLOADS"})
# A Service named async-processor(-*) in the namespace makes Kubernetes inject these into
# every pod (service links): never ours, never a typo.
_SERVICE_LINK = re.compile(r"_SERVICE_HOST$|_SERVICE_PORT(_\w+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_\w+)?$")


def flag_env(dest: str) -> str:
    """A daemon flag's variable (shared by the commands that read the daemon's config)."""
    return ENV_PREFIX + dest.upper()


def scoped_env(command: str, dest: str) -> str:
    """A command's own flag's variable: ``ASYNC_PROCESSOR_<COMMAND>_<FLAG>``."""
    return f"{ENV_PREFIX}{command.upper().replace('-', '_')}_{dest.upper()}"


def command_of(prog: str) -> str:
    """``async-processor results`` -> ``results``."""
    return prog.split()[-1]


def usable_env(value: str) -> bool:
    """Empty means unset; so does a Kubernetes service link (``tcp://10.0.0.1:9090``).

    A Service named ``async-processor-metrics`` makes Kubernetes inject
    ``ASYNC_PROCESSOR_METRICS_PORT=tcp://...`` into every pod of the namespace; taking it
    for our flag would crash-loop the daemon.
    """
    return value != "" and not value.startswith(("tcp://", "udp://"))


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's flags (not positionals, help or version)."""
    return [
        action
        for action in parser._actions
        if action.option_strings and action.dest not in ("help", "version")
    ]


def env_names(action: argparse.Action, command: str, shared: Collection[str]) -> list[str]:
    """The variables of one flag, first wins: a daemon flag's shared name, or the scoped
    name and then the unscoped one the command read before (``legacy``)."""
    if action.dest in shared:
        return [flag_env(action.dest)]
    return [scoped_env(command, action.dest), flag_env(action.dest)]


def apply_env(
    prog: str,
    actions: list[argparse.Action],
    env: Mapping[str, str],
    command: str,
    shared: Collection[str],
    *,
    legacy: bool,
) -> None:
    """Defaults of the flags ``actions`` from the environment where set (flags still win).

    The value goes through the flag's ``type`` as a flag's would (argparse converts string
    defaults), so a bad variable is reported like a bad flag. ``legacy``: the unscoped
    names still work for the command's own flags, each with a warning.
    """
    for action in actions:
        names = env_names(action, command, shared)
        found = next((n for n in names[: 2 if legacy else 1] if usable_env(env.get(n, ""))), "")
        if not found:
            continue
        if found != names[0]:
            _warn(prog, f"{found} is read as --{action.dest.replace('_', '-')}: "
                  f"use {names[0]} (an unscoped name reaches every command)")  # fmt: skip
        value = env[found]
        if action.const is not None and action.nargs == 0:  # store_true / store_false
            action.default = value.lower() in ("1", "true", "yes", "on")
        else:
            action.default = value


def warn_unknown(prog: str, env: Mapping[str, str], known: Collection[str]) -> None:
    """One warning per ``ASYNC_PROCESSOR_*`` variable this command reads for no flag (a
    typo, or a setting of another command's under the wrong name)."""
    others = tuple(scoped_env(c, "") for c in COMMANDS if c != command_of(prog))
    choices = sorted(known)
    for name, value in sorted(env.items()):
        if (
            not name.startswith(ENV_PREFIX)
            or name in known
            or name in OTHER_VARIABLES
            or name.startswith(others)
            or _SERVICE_LINK.search(name)
            or not usable_env(value)
        ):
            continue
        _warn(prog, f"ignoring {name}: no flag of this command reads it"
              f"{did_you_mean(name, choices)}")  # fmt: skip


def _warn(prog: str, text: str) -> None:
    # Before logging is configured (its flags are being read): plain stderr, one line.
    print(f"{prog}: warning: {text}", file=sys.stderr)
