"""One registry type for the named choices a config makes (advantage estimators, rewards,
environments, tools, record sources): entries are added by a decorator in the module that
implements them, and the first lookup imports the registry's shipped modules, so a lookup
through any module sees them all (`_lazy.import_modules`, once)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from jaxrl_tools._lazy import import_modules

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry.

    Args:
      what: the entries' name in errors ("reward", "environment").
      package, modules: the shipped modules (`package.m` for m in `modules`) that add entries.
      error: the exception type of an unknown name (its message lists the valid names).
    """

    def __init__(
        self,
        what: str,
        package: str | None = None,
        modules: tuple[str, ...] = (),
        error: type[Exception] = ValueError,
    ):
        self.what, self.package, self.modules, self.error = what, package, modules, error
        self._entries: dict[str, T] = {}

    def load(self) -> None:
        """Imports the shipped modules (each adds its entries)."""
        if self.package is not None:
            import_modules(self.package, self.modules)

    def add(self, name: str, entry: T) -> None:
        """Registers `entry` as `name`; the name taken by another entry is a ValueError."""
        if self._entries.get(name, entry) is not entry:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `add(name, entry)`, returning the entry."""

        def deco(entry: T) -> T:
            self.add(name, entry)
            return entry

        return deco

    def names(self) -> list[str]:
        """The registered names, sorted (shipped modules loaded)."""
        self.load()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry registered as `name`; unknown: `error` listing the valid ones."""
        self.load()
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(
                f"unknown {self.what} {name!r}; valid: {', '.join(self.names())}"
            ) from None

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
