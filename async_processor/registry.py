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

import difflib
import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin

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
            problem = describe_validation(exc, entry.params)
            raise ConfigError(f"{self.kind} {type_name!r}: {problem}") from exc

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
            known = self.known()
            raise ConfigError(
                f"unknown {self.kind} type {type_name!r}{did_you_mean(type_name, known)} "
                f"(known: {', '.join(known)})"
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


def describe_validation(exc: ValidationError, model: Any = None) -> str:
    """One line naming the first bad field and the problem (for startup errors).

    A misspelled key is named before the "Field required" it causes: the typo is the news,
    with the closest key ``model`` (the type validated) knows at that place, if one is close.
    """
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden" and first["loc"]:
        known = _keys_at(model, first["loc"][:-1])
        message += did_you_mean(str(first["loc"][-1]), known)
    elif first["type"] == "literal_error" and isinstance(first.get("input"), str):
        # 'rate_limit' for 'rate-limit': the closest of the choices pydantic lists.
        choices = re.findall(r"'([^']*)'", str((first.get("ctx") or {}).get("expected", "")))
        message += did_you_mean(first["input"], choices)
    message = _unechoed(message, first["loc"], first.get("input"))
    return mask_url(f"{where}: {message}" if where else message)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _keys_at(model: Any, path: Sequence[int | str]) -> list[str]:
    """The keys the model found by following ``path`` from ``model`` accepts (names and
    aliases), or none when the path leaves the models (a dict of anything, a union)."""
    for part in path:
        model = _unwrap(model)
        if isinstance(part, int) or model is None:  # a list item: the list's item type
            model = get_args(model)[0] if get_origin(model) in (list, tuple) else model
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        model = field.annotation if field is not None else None
    model = _unwrap(model)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    names: list[str] = []
    for name, field in model.model_fields.items():
        names += [name, field.alias] if field.alias else [name]
    return list(dict.fromkeys(names))


def _unwrap(annotation: Any) -> Any:
    """``X`` from ``Annotated[X, ...]`` and ``X | None``; anything else as is."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        annotation = options[0] if len(options) == 1 else annotation
    return annotation


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
