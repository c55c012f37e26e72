"""The one config surface: settings (flags + environment) and the JSON config files.

Input: command-line flags, ``ASYNC_PROCESSOR_*`` environment variables (flags win),
``REDIS_URL``, and the transport / pool / merge-policy / transform files. Output: one
frozen ``AppConfig`` for ``pipeline.daemon.run``. Field names and defaults follow the Go
reference; unknown fields are errors (docs/architecture.md G15).

Split by seam: ``base`` (what the models share), ``transports`` (one model per
``--transport``), ``models`` (pools, merge policy, transforms, runtime, ``AppConfig``),
``flags`` (the command line and its environment twins), ``load`` (reading the files
and putting it together), ``queues`` (``QueueSpec``, a configured queue as the pipeline
sees it) and ``redis`` (Redis connection models and cluster slot rules, pure data).
Import from this package, not from its modules.
"""

from async_processor.config.base import DEFAULT_POOL
from async_processor.config.environment import ENV_PREFIX, usable_env
from async_processor.config.flags import (
    FLAGS,
    ExtendParser,
    Flag,
    Settings,
    flag_parser,
    parse_settings,
)
from async_processor.config.load import (
    build_config,
    load_config,
    read_transport_file,
    redis_connection_file,
    reread_transport_config,
)
from async_processor.config.models import (
    AppConfig,
    MergePolicyConfig,
    PoolConfig,
    RuntimeConfig,
    TLSConfig,
    TransformConfig,
    TransformEntry,
)
from async_processor.config.queues import QueueSpec
from async_processor.config.transports import (
    GcpPubSubConfig,
    PubSubTopic,
    RedisPubSubConfig,
    RedisQueue,
    SortedSetConfig,
    SortedSetQueue,
    TransportConfig,
)

__all__ = [
    "DEFAULT_POOL",
    "ENV_PREFIX",
    "FLAGS",
    "AppConfig",
    "ExtendParser",
    "Flag",
    "GcpPubSubConfig",
    "MergePolicyConfig",
    "PoolConfig",
    "PubSubTopic",
    "QueueSpec",
    "RedisPubSubConfig",
    "RedisQueue",
    "RuntimeConfig",
    "Settings",
    "SortedSetConfig",
    "SortedSetQueue",
    "TLSConfig",
    "TransformConfig",
    "TransformEntry",
    "TransportConfig",
    "build_config",
    "flag_parser",
    "load_config",
    "parse_settings",
    "read_transport_file",
    "redis_connection_file",
    "reread_transport_config",
    "usable_env",
]
