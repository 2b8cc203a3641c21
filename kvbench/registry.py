"""Name -> class registries for probes and strategies, filled by importing a package.

Each probe or strategy module decorates its class with `@REGISTRY.register`; the registry
imports every module of its package the first time it is asked, so adding one touches one
module, its test, and README.md's table (`kvbench list --markdown`, from `markdown_tables`).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Generic, Protocol, TypeVar

from kvbench.errors import KvbenchError


class Named(Protocol):
    name: str

    @classmethod
    def summary(cls) -> str: ...


T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind
        self.package = package
        self._items: dict[str, T] = {}
        self._loaded = False

    def register(self, cls: T) -> T:
        name = cls.name  # type: ignore[attr-defined]
        if name in self._items and self._items[name] is not cls:
            raise RuntimeError(f"{self.kind} '{name}' registered twice")
        self._items[name] = cls
        return cls

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{self.package}.{mod.name}")

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def all(self) -> list[T]:
        return [self._items[n] for n in self.names()]

    def get(self, name: str) -> T:
        self._load()
        if name not in self._items:
            known = ", ".join(sorted(self._items)) or "none"
            raise KvbenchError(f"unknown {self.kind} '{name}' (known: {known})")
        return self._items[name]


def first_line(doc: str | None) -> str:
    """The first non-empty line of a docstring, for one-line listings."""
    for line in (doc or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""
