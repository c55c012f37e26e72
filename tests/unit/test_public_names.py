"""The public import surface, pinned: the root and every family's face (the httpx pattern).

A name added to or dropped from a face is an API change; this test makes it a deliberate
one. The root is lazy: importing it (or ``--version``) loads no broker library.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

FACES = {
    "async_processor": [
        "AsyncProcessorError", "ConfigError", "ErrorCode", "Request", "Result",
        "SortedSetClient", "TransportError", "__version__",
    ],
    "async_processor.client": ["SortedSetClient", "Submitted", "UndecodableResult"],
    "async_processor.config": [
        "AppConfig", "DEFAULT_POOL", "ENV_PREFIX", "ExtendParser", "FLAGS", "Flag",
        "GcpPubSubConfig", "MergePolicyConfig", "PoolConfig", "PubSubTopic", "QueueSpec",
        "RedisPubSubConfig", "RedisQueue", "RuntimeConfig", "Settings", "SortedSetConfig",
        "SortedSetQueue", "TLSConfig", "TransformConfig", "TransformEntry", "TransportConfig",
        "build_config", "flag_parser", "load_config", "parse_settings",
        "read_transport_file", "redis_connection_file", "reread_transport_config",
        "usable_env",
    ],
    "async_processor.pipeline": ["Processor", "run", "validate_plugins"],
    "async_processor.transports": [
        "Abandons", "Completion", "Deferral", "Delivery", "DiscoversQueues", "LetsGo",
        "LimitsResults", "LoadsPayloads", "SignalsMessages", "TRANSPORTS", "Transport",
        "TransportContext", "WatchesCancels", "abandon", "build_transport",
    ],
    "async_processor.gates": [
        "Action", "GATES", "Gate", "GateContext", "GateOwner", "Observes", "Releases",
        "Verdict", "WaitsForChange", "build_gate",
    ],
    "async_processor.merge": [
        "MERGE_POLICIES", "MergeContext", "MergePolicy", "Source", "build_merge_policy",
    ],
    "async_processor.transforms": [
        "Opens", "Outgoing", "TRANSFORMS", "Transform", "TransformChain", "TransformContext",
        "build_transform_chain",
    ],
    "async_processor.httpclients": ["Answer", "HTTP_CLIENTS", "HttpClient", "build_http_client"],
    "async_processor.sim": ["SimConfig", "Simulator", "main"],
}  # fmt: skip


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_exports_exactly_its_names(face: str) -> None:
    module = importlib.import_module(face)
    assert sorted(module.__all__) == sorted(FACES[face])
    for name in module.__all__:  # every listed name resolves (lazy ones included)
        assert getattr(module, name) is not None, name


def test_an_unknown_name_is_an_attribute_error() -> None:
    import async_processor

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        async_processor.Nope  # noqa: B018


def test_the_root_and_version_load_no_broker_library() -> None:
    code = (
        "import sys, async_processor\n"
        "from async_processor.cli.main import main\n"
        "main(['--version'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'google')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.splitlines()[-1] == "[]"


def test_the_readme_import_path_keeps_working() -> None:
    from async_processor import SortedSetClient
    from async_processor.client import SortedSetClient as documented

    assert documented is SortedSetClient
