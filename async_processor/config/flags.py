"""Command-line flags and their ``ASYNC_PROCESSOR_*`` environment twins.

``FLAGS`` is the one list; ``parse_settings`` reads flags first, then the environment for
the flags not given, and checks choices. ``config.load`` turns the result into models.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, get_args, get_origin

from pydantic import (
    BaseModel,
)

from async_processor.config.environment import (
    ENV_PREFIX,
    apply_env,
    command_of,
    env_names,
    options,
    usable_env,
    warn_unknown,
)
from async_processor.config.models import RuntimeConfig, TLSConfig
from async_processor.config.transports import TRANSPORT_CONFIGS
from async_processor.durations import format_duration
from async_processor.errors import ConfigError
from async_processor.logs import FORMATS, LEVELS

TRANSPORT_SOURCES = ("transport_config", "transport_config_file")


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag; ``field`` is its path in ``RuntimeConfig`` (if any)."""

    name: str
    help: str
    field: str = ""
    default: str = ""  # for flags outside RuntimeConfig (which holds the others' defaults)
    choices: tuple[str, ...] = ()
    boolean: bool = False

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


FLAGS: tuple[Flag, ...] = (
    Flag("transport", "message transport", default="redis-pubsub",
         choices=tuple(TRANSPORT_CONFIGS)),
    Flag("transport-config", "transport config as inline JSON"),
    Flag("transport-config-file", "transport config JSON file"),
    Flag("transport-config-watch-interval", "re-read --transport-config-file this often and "
         "apply its queues without a restart (redis-sortedset only; 0 disables)",
         "transport_config_watch_interval"),
    Flag("pool-config-file", "worker pools JSON file (default: one pool 'default')"),
    Flag("request-merge-policy-config-file", "merge policy JSON file (default random-robin)"),
    Flag("transform-config-file", "request body transforms JSON file"),
    Flag("concurrency", "workers of the default pool", "concurrency"),
    Flag("request-timeout", "per-attempt HTTP cap (Go duration)", "request_timeout"),
    Flag("drain-timeout", "shutdown drain budget (Go duration)", "drain_timeout"),
    Flag("gate-wait-timeout", "longest pool-gate wait (default: --request-timeout)",
         "gate_wait_timeout"),
    Flag("prometheus-url", "Prometheus base URL for prometheus-* gates", "prometheus_url"),
    Flag("prometheus-cache-ttl", "gate metric cache TTL (0 disables)", "prometheus_cache_ttl"),
    Flag("budget-scope", "what a queue gate's budget bounds: in-flight (budget × pool slots) "
         "or fetch (each fetch only, as the Go reference)", "budget_scope"),
    Flag("shed-pause", "after a 429 the pool sends nothing new for Retry-After, at most this "
         "long (0 disables)", "shed_pause"),
    Flag("tokens-kind-total", "also write tokens_total{kind=\"total\"} (deprecated: it double "
         "counts under sum; off by default in the next release, then removed)",
         "tokens_kind_total", boolean=True),
    Flag("tenant-label-limit", "distinct tenants in tokens_total per replica; more count "
         "as 'other'", "tenant_label_limit"),
    Flag("metrics-backlog-poll-interval", "broker backlog gauge interval (0 disables)",
         "metrics_backlog_poll_interval"),
    Flag("health-port", "port of /healthz and /readyz", "health_port"),
    Flag("metrics-port", "port of /metrics", "metrics_port"),
    Flag("bind-address", "address the health and metrics servers listen on", "bind_address"),
    Flag("deadline-header", "header carrying the request's deadline to the gateway, as "
         "absolute Unix seconds (not the time left; empty disables)",
         "deadline_header"),
    Flag("inference-ttl-header", "send x-llm-d-inference-ttl, the time left to the deadline "
         "(Go duration), so the router's flow control holds no request past it",
         "inference_ttl_header", boolean=True),
    Flag("max-message-bytes", "largest accepted message", "max_message_bytes"),
    Flag("metrics-bearer-token-file", "file holding a bearer token required on /metrics"),
    Flag("tls-ca-cert", "CA bundle for the gateway", "tls.ca_cert"),
    Flag("tls-cert", "client certificate for the gateway", "tls.cert"),
    Flag("tls-key", "client key for the gateway", "tls.key"),
    Flag("tls-insecure-skip-verify", "skip gateway certificate checks", "tls.insecure_skip_verify",
         boolean=True),
    Flag("http-client", "the gateway's HTTP client: httptools, aiohttp or pyreqwest (an extra)",
         "http_client"),
    Flag("log-level", "log level", default="info", choices=LEVELS),
    Flag("log-format", "log format (auto: json unless stderr is a TTY)", default="auto",
         choices=FORMATS),
)  # fmt: skip
_BY_DEST = {flag.dest: flag for flag in FLAGS}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as a one-line ConfigError."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


# Adds a command's own flags (e.g. ``status --json``) next to the config flags.
ExtendParser = Callable[[argparse.ArgumentParser], None]


def flag_parser(
    prog: str = "async-processor run",
    extend: ExtendParser | None = None,
    shown: Collection[str] | None = None,
) -> argparse.ArgumentParser:
    """The daemon's flags (then ``extend``'s). ``shown``: the flags ``--help`` lists (None:
    all); an operator command lists those that choose what it looks at, and accepts the
    others unlisted, so it still takes the pod's whole command line."""
    epilog = (
        f"Every flag can also be set as {ENV_PREFIX}<FLAG_IN_UPPER_SNAKE> (a command's own "
        f"flags: {ENV_PREFIX}<COMMAND>_<FLAG>); flags win."
    )
    if shown is not None:
        epilog += " It also accepts (and ignores) the other flags of 'async-processor run'."
    parser = _Parser(prog=prog, allow_abbrev=False, epilog=epilog)
    for flag in FLAGS:
        default = flag.default or _field_default(flag.field)
        # A default the help text already explains (or none at all) is not repeated.
        noted = f"default: {default}; " if default and "(default" not in flag.help else ""
        help_text = f"{flag.help} ({noted}env {flag.env})"
        if shown is not None and flag.name not in shown:
            help_text = argparse.SUPPRESS
        if flag.boolean:
            parser.add_argument(
                flag.option, dest=flag.dest, nargs="?", const="true", metavar="BOOL", help=help_text
            )
        else:
            parser.add_argument(flag.option, dest=flag.dest, metavar=_metavar(flag), help=help_text)
    if extend is not None:
        extend(parser)
    return parser  # fmt: skip


def _metavar(flag: Flag) -> str:
    """What kind of value a flag takes, for ``--help`` (FILE, PORT, DURATION, ...)."""
    if flag.choices:
        return "{" + ",".join(flag.choices) + "}"
    if flag.name.endswith("-file") or flag.name.startswith("tls-"):
        return "FILE"
    if flag.name.endswith("-port"):
        return "PORT"
    if flag.name.endswith("-url"):
        return "URL"
    if flag.field:
        group, _, name = flag.field.rpartition(".")
        annotation = (TLSConfig if group else RuntimeConfig).model_fields[name].annotation
        # Unwrap Optional and Annotated: ``Annotated[Duration, ...] | None`` counts as float.
        args = get_args(annotation)
        if get_origin(annotation) is Literal:  # a closed set: show it, as choices are shown
            return "{" + ",".join(str(arg) for arg in args) + "}"
        kinds = {annotation, *args, *(inner for arg in args for inner in get_args(arg))}
        if float in kinds:  # the Duration fields (Go syntax)
            return "DURATION"
        if int in kinds:
            return "N"
    return "VALUE"


@dataclass(frozen=True, slots=True)
class Settings:
    """Flag values as given (flag, else environment); absent ones take the defaults.

    An empty environment variable counts as unset (Kubernetes renders unset values as
    ""); an empty flag value is kept (``--deadline-header=`` turns the header off).
    """

    values: Mapping[str, str]
    sources: Mapping[str, str]  # dest -> "--flag" or "ENV_NAME", for error messages
    extra: Mapping[str, Any] = field(default_factory=dict)  # a command's own flags (extend)

    def get(self, dest: str) -> str:
        flag = next(f for f in FLAGS if f.dest == dest)
        return self.values.get(dest, flag.default)

    @property
    def log_level(self) -> str:
        return self.get("log_level")

    @property
    def log_format(self) -> str:
        return self.get("log_format")


def parse_settings(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    prog: str = "async-processor run",
    extend: ExtendParser | None = None,
    shown: Collection[str] | None = None,
) -> Settings:
    """Flags, then ``ASYNC_PROCESSOR_*`` for the flags not given; choices checked. A
    command's own flags (``extend``'s) read ``ASYNC_PROCESSOR_<COMMAND>_<FLAG>``; a
    variable no flag reads is warned about (config.environment)."""
    parser = flag_parser(prog, extend, shown)
    own = [action for action in options(parser) if action.dest not in _BY_DEST]
    command = command_of(prog)
    apply_env(parser.prog, own, env, command, (), legacy=False)
    for action in own:
        if action.help and action.help != argparse.SUPPRESS:
            action.help += f" (env {env_names(action, command, ())[0]})"
    known = {flag.env for flag in FLAGS} | {env_names(a, command, ())[0] for a in own}
    warn_unknown(parser.prog, env, known)
    parsed = vars(parser.parse_args(list(argv)))
    extra = {k: parsed.pop(k) for k in list(parsed) if k not in _BY_DEST}
    given = {k: v for k, v in parsed.items() if v is not None}
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    # The two transport sources are one setting: a flag for either hides the env of both.
    skip_env = set(TRANSPORT_SOURCES) if given.keys() & set(TRANSPORT_SOURCES) else set()
    for flag in FLAGS:
        if flag.dest in given:
            values[flag.dest], sources[flag.dest] = given[flag.dest], flag.option
        elif flag.dest not in skip_env and usable_env(env.get(flag.env, "")):
            values[flag.dest], sources[flag.dest] = env[flag.env], flag.env
        if flag.choices and flag.dest in values and values[flag.dest] not in flag.choices:
            raise ConfigError(f"{sources[flag.dest]}: {values[flag.dest]!r} is not one of "
                              f"{', '.join(flag.choices)}")  # fmt: skip
    return Settings(values, sources, extra)


def _field_default(path: str) -> str:
    """The model default of a flag's field, as text for ``--help``."""
    if not path:
        return ""
    group, _, name = path.rpartition(".")
    model: type[BaseModel] = TLSConfig if group else RuntimeConfig
    default = model.model_fields[name].get_default(call_default_factory=True)
    return format_duration(default) if isinstance(default, float) else str(default)
