"""The gateway's HTTP client; ``base.HttpClient`` is the seam every implementation keeps.

``--http-client`` picks one by name (default ``httptools``). Only the module of the one in
use is imported, so the default never loads an optional library (pyreqwest is the
``pyreqwest`` extra).
"""

from __future__ import annotations

import importlib

from async_processor.config import TLSConfig
from async_processor.errors import ConfigError
from async_processor.httpclients.base import Answer, HttpClient

__all__ = ["HTTP_CLIENTS", "Answer", "HttpClient", "build_http_client"]

# Name -> (module, class). The names are ``RuntimeConfig.http_client``'s choices.
HTTP_CLIENTS: dict[str, tuple[str, str]] = {
    "httptools": ("httptools_client", "HttptoolsClient"),
    "aiohttp": ("aiohttp_client", "AiohttpClient"),
    "pyreqwest": ("pyreqwest_client", "PyreqwestClient"),
}


def build_http_client(name: str, tls: TLSConfig, connections: int) -> HttpClient:
    """The client ``name`` for up to ``connections`` requests at once (one per worker)."""
    module_name, class_name = HTTP_CLIENTS[name]
    try:
        module = importlib.import_module(f"async_processor.httpclients.{module_name}")
    except ImportError as exc:
        raise ConfigError(
            f"--http-client {name}: {exc.name or exc} is not installed "
            f"(pip install 'async-processor[{name}]')"
        ) from exc
    client: HttpClient = getattr(module, class_name)(tls, connections)
    return client
