"""Registry: a config ``type`` string -> a factory and its typed params model.

Input: the ``type`` and raw ``parameters`` mapping from a config file. Output: the built
plugin (gate, merge policy, transform, transport). One registry per kind of plugin; an
unknown type or a bad parameter is a ``ConfigError`` naming the known choices or the field.

Every kind registers the same way: a factory decorated with ``REGISTRY.register(type,
params model)`` in a plug-in module, and the registry names its plug-in modules, imported
at its first lookup (not before: they import the registry's own module): ``plugins`` all
at once, or ``modules`` per type, so that only the module of the type in use is imported
(transports: a Redis deployment never loads the Pub/Sub libraries).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from async_processor.errors import ConfigError
from async_processor.logs import MASK, is_secret_key, is_secret_name, mask_url

T = TypeVar("T")
C = TypeVar("C")
P = TypeVar("P", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class _Entry(Generic[T, C]):
    params: type[BaseModel]
    factory: Callable[[Any, C], T]


class Registry(Generic[T, C]):
    """Type string -> (params model, factory(params, ctx))."""

    def __init__(
        self, kind: str, plugins: Sequence[str] = (), modules: Mapping[str, str] | None = None
    ) -> None:
        """``plugins``: the modules that register this kind's types, imported at the first
        lookup (imported once: later lookups find them in ``sys.modules``). ``modules``:
        type -> the module that registers it, imported at the first lookup of that type."""
        self.kind = kind
        self._entries: dict[str, _Entry[T, C]] = {}
        self._plugins = tuple(plugins)
        self._modules = dict(modules or {})

    def register(
        self, type_name: str, params: type[P]
    ) -> Callable[[Callable[[P, C], T]], Callable[[P, C], T]]:
        def decorate(factory: Callable[[P, C], T]) -> Callable[[P, C], T]:
            if type_name in self._entries:
                raise RuntimeError(f"{self.kind} type {type_name!r} registered twice")
            self._entries[type_name] = _Entry(params, factory)
            return factory

        return decorate

    def known(self) -> list[str]:
        self._load_plugins()
        return sorted({*self._entries, *self._modules})

    def params(self, type_name: str, raw: Mapping[str, Any] | None) -> BaseModel:
        """Validate ``raw`` against the type's params model (ConfigError on failure)."""
        entry = self._entry(type_name)
        try:
            return entry.params.model_validate(dict(raw or {}))
        except ValidationError as exc:
            raise ConfigError(f"{self.kind} {type_name!r}: {describe_validation(exc)}") from exc

    def build(self, type_name: str, raw: Mapping[str, Any] | None, ctx: C) -> T:
        params = self.params(type_name, raw)
        return self._entry(type_name).factory(params, ctx)

    def _entry(self, type_name: str) -> _Entry[T, C]:
        self._load_plugins()
        if type_name in self._modules:
            importlib.import_module(self._modules[type_name])
        try:
            return self._entries[type_name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} type {type_name!r} (known: {', '.join(self.known())})"
            ) from None

    def _load_plugins(self) -> None:
        for module in self._plugins:
            importlib.import_module(module)


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for a package face: each name is imported from its home
    module at first use, so importing the face loads none of them (``async-processor
    --version`` never loads redis-py)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__


def describe_validation(exc: ValidationError) -> str:
    """One line naming the first bad field and the problem (for startup errors).

    A misspelled key is named before the "Field required" it causes: the typo is the news.
    """
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "value"
    message = first["msg"].removeprefix("Value error, ")
    return mask_url(f"{where}: {_unechoed(message, first['loc'], first.get('input'))}")


def _unechoed(message: str, loc: tuple[int | str, ...], value: Any) -> str:
    """``message`` without the bad value in it when the field looks secret (a validator
    quoting ``'Bearer ...\n'`` would print the credential in a startup error)."""
    names = [str(part) for part in loc]
    secret = any(is_secret_key(n) for n in names) or any(
        is_secret_name(n) for i, n in enumerate(names) if i and names[i - 1].endswith("headers")
    )
    leaves = value.values() if isinstance(value, Mapping) else [value]
    for leaf in leaves if secret else ():
        if isinstance(leaf, str) and leaf:
            message = message.replace(repr(leaf), MASK).replace(leaf, MASK)
    return message
