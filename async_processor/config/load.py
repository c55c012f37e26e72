"""Flags + environment + files -> one validated ``AppConfig``, or a ``ConfigError``.

Reads ``REDIS_URL`` and the transport / pool / merge-policy / transform files the flags
name, and reports every failure as one line naming its source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar, cast

from pydantic import (
    BaseModel,
    TypeAdapter,
    ValidationError,
)

from async_processor.config.base import DEFAULT_POOL, require_unique
from async_processor.config.flags import FLAGS, Settings, parse_settings
from async_processor.config.models import (
    AppConfig,
    MergePolicyConfig,
    MergePolicyFile,
    PoolConfig,
    RuntimeConfig,
    TransformConfig,
)
from async_processor.config.redis import (
    RedisConnection,
    RedisConnectionFields,
)
from async_processor.config.transports import (
    TRANSPORT_CONFIGS,
    RedisTransportBase,
    SortedSetConfig,
    TransportConfig,
)
from async_processor.errors import ConfigError
from async_processor.registry import describe_validation

_BY_FIELD = {flag.field: flag for flag in FLAGS if flag.field}


def load_config(argv: Sequence[str], env: Mapping[str, str]) -> AppConfig:
    """Flags + environment + files -> a validated ``AppConfig`` (ConfigError otherwise)."""
    return build_config(parse_settings(argv, env), env)


def build_config(settings: Settings, env: Mapping[str, str]) -> AppConfig:
    transport = settings.get("transport")
    transport_config, source = _transport_config(settings, transport, env)
    pools = _pools(settings, env)
    _check_pools(transport_config, pools, source)
    merge_path = settings.get("request_merge_policy_config_file")
    transforms_path = settings.get("transform_config_file")
    runtime = _runtime(settings)
    path = settings.get("transport_config_file")
    if runtime.transport_config_watch_interval and (transport != "redis-sortedset" or not path):
        raise ConfigError(
            "--transport-config-watch-interval needs --transport redis-sortedset "
            "and --transport-config-file (inline config cannot change)"
        )
    return AppConfig(
        transport=transport,
        transport_config=transport_config,
        transport_config_file=path,
        runtime=runtime,
        pools=pools,
        merge_policy=_from_file(MergePolicyFile, "--request-merge-policy-config-file",
                                merge_path) if merge_path else MergePolicyConfig(),
        transforms=_from_file(TransformConfig, "--transform-config-file", transforms_path)
        if transforms_path else TransformConfig(),
    )  # fmt: skip


def _transport_config(
    settings: Settings, transport: str, env: Mapping[str, str]
) -> tuple[TransportConfig, str]:
    inline, path = settings.get("transport_config"), settings.get("transport_config_file")
    if inline and path:
        raise ConfigError("--transport-config and --transport-config-file are mutually exclusive")
    if not inline and not path:
        raise ConfigError("one of --transport-config or --transport-config-file is required")
    source = f"--transport-config-file {path}" if path else "--transport-config"
    raw = _parse_json(source, inline) if inline else _read_json("--transport-config-file", path)
    if "transport" not in settings.values:  # the default transport is only a guess
        _suggest_transport(source, raw, transport)
    return _validated_transport(transport, raw, source, env), source


def reread_transport_config(config: AppConfig, env: Mapping[str, str]) -> AppConfig:
    """``config`` with its transport config file read again (hot reload): checked as at
    startup (REDIS_URL fallback, known pools, gate groups), except that ``queues`` may
    be empty (every queue stopped, as upstream allows). A ConfigError otherwise."""
    path = config.transport_config_file
    source = f"--transport-config-file {path}"
    raw = _read_json("--transport-config-file", path)
    transport_config = _validated_transport(config.transport, raw, source, env, reload=True)
    _check_pools(transport_config, config.pools, source)
    fields = {name: getattr(config, name) for name in AppConfig.model_fields}
    fields["transport_config"] = transport_config
    # The context again: a model field of a union is validated anew here.
    validate = partial(AppConfig.model_validate, context={"env": env, "reload": True})
    return _validate(validate, source, fields)


def _validated_transport(
    transport: str, raw: Any, source: str, env: Mapping[str, str], *, reload: bool = False
) -> TransportConfig:
    model = TRANSPORT_CONFIGS[transport]
    is_redis = issubclass(model, RedisTransportBase)
    if is_redis and isinstance(raw, dict) and not raw.get("url"):
        # REDIS_URL only fills an empty url: an explicit one wins.
        raw = {**raw, "url": env.get("REDIS_URL", "")}
        if not raw["url"]:
            raise ConfigError(f"{source}: url is required for {transport} (or set REDIS_URL)")
    validate = partial(model.model_validate, context={"env": env, "reload": reload})
    return cast(TransportConfig, _validate(validate, source, raw, model))


def _suggest_transport(source: str, raw: Any, assumed: str) -> None:
    """ConfigError naming the transport ``raw`` is a config of, when not ``assumed``'s.

    Without ``--transport`` the default (redis-pubsub) is assumed, and a sorted-set config
    would otherwise fail as ``queues.0.id: Extra inputs are not permitted``.
    """
    fits = [name for name, model in TRANSPORT_CONFIGS.items() if _fits(model, raw)]
    if fits and assumed not in fits:
        raise ConfigError(
            f"{source}: this looks like a {fits[0]} config; pass --transport {fits[0]}"
        )


def _fits(model: type[BaseModel], raw: Any) -> bool:
    try:
        model.model_validate(raw)
    except ValidationError:
        return False
    return True


def read_transport_file(path: str) -> dict[str, Any]:
    """A transport config file as raw JSON (unvalidated): for the operator commands, which
    read its queue names and connection without needing every gate's secret set."""
    raw = _read_json("--transport-config-file", path)
    if not isinstance(raw, dict):
        raise ConfigError(f"--transport-config-file {path}: not a JSON object")
    return raw


def redis_connection_file(path: str, url: str) -> RedisConnection:
    """The connection a Redis transport config file describes (its queues are ignored);
    ``url`` fills an empty one. For the producer commands, so they connect as the daemon."""
    raw = read_transport_file(path)
    wanted = {"url", "mode", *RedisConnectionFields.model_fields}
    fields = {k: v for k, v in raw.items() if k in wanted}
    fields["url"] = fields.get("url") or url
    source = f"--transport-config-file {path}"
    return _validate(RedisTransportBase.model_validate, source, fields).redis_connection()


def _pools(settings: Settings, env: Mapping[str, str]) -> list[PoolConfig]:
    path = settings.get("pool_config_file")
    if not path:
        return []
    source = f"--pool-config-file {path}"
    pools = _validate(
        partial(TypeAdapter(list[PoolConfig]).validate_python, context={"env": env}),
        source,
        _read_json("--pool-config-file", path),
        list[PoolConfig],
    )
    if not pools:
        raise ConfigError(f"{source}: at least one pool is required")
    try:
        require_unique("[].id", [p.id for p in pools])
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return pools


def _check_pools(transport_config: TransportConfig, pools: list[PoolConfig], source: str) -> None:
    known = [p.id for p in pools] or [DEFAULT_POOL]
    templates = (
        transport_config.template_specs() if isinstance(transport_config, SortedSetConfig) else []
    )
    for spec in [*transport_config.queue_specs(), *templates]:
        if spec.pool not in known:
            raise ConfigError(
                f"{source}: queue {spec.name!r} names unknown worker_pool_id {spec.pool!r} "
                f"(pools: {', '.join(known)})"
            )


def _runtime(settings: Settings) -> RuntimeConfig:
    given: dict[str, Any] = {"tls": {}}
    for flag in FLAGS:
        if flag.field and flag.dest in settings.values:
            group, _, name = flag.field.rpartition(".")
            (given[group] if group else given)[name] = settings.values[flag.dest]
    token_file = settings.get("metrics_bearer_token_file")
    if token_file:
        given["metrics_bearer_token"] = _read_text("--metrics-bearer-token-file", token_file)
        if not given["metrics_bearer_token"]:
            raise ConfigError(f"--metrics-bearer-token-file {token_file}: the file is empty")
    for name, path in given["tls"].items():
        if name != "insecure_skip_verify" and path and not os.path.isfile(path):
            raise ConfigError(f"--tls-{name.replace('_', '-')} {path}: no such file")
    try:
        return RuntimeConfig.model_validate(given)
    except ValidationError as exc:
        raise ConfigError(_describe_flag_error(exc, settings)) from None


def _describe_flag_error(exc: ValidationError, settings: Settings) -> str:
    first = exc.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    flag = _BY_FIELD.get(".".join(str(part) for part in first["loc"]))
    if flag is None:
        return message
    value = settings.values.get(flag.dest, "")
    return f"{settings.sources.get(flag.dest, flag.option)}={value!r}: {message}"


T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)


def _from_file(model: type[ModelT], option: str, path: str) -> ModelT:
    return _validate(model.model_validate, f"{option} {path}", _read_json(option, path), model)


def _validate(validate: Callable[[Any], T], source: str, raw: Any, model: Any = None) -> T:
    """``validate(raw)``; a ConfigError naming ``source`` and the first problem (``model``,
    the type validated, lets it suggest a key for a misspelled one)."""
    try:
        return validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation(exc, model)}") from None


def _read_text(option: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"{option} {path}: cannot read: {reason}") from None


def _read_json(option: str, path: str) -> Any:
    return _parse_json(f"{option} {path}", _read_text(option, path))


def _parse_json(source: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{source}: malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
