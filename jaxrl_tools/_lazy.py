"""Lazy public `__init__`s: a package's names are imported when first used, not with the package.

A package writes its public imports under `if typing.TYPE_CHECKING:` (read by type checkers,
IDEs and ruff as ordinary imports) and ends with

    __getattr__, __dir__ = lazy_api(__name__)

On the first name it does not hold yet, the package reads those import statements from its own
source (once) and imports only the module that name comes from; the value is then kept in the
package, so later lookups are ordinary attribute reads. `from pkg import name`, `pkg.name`,
`from pkg import *` (through `__all__`) and `pkg.submodule` all work as with eager imports.
In the manner of `etils.epy.lazy_api_imports`, with no import hooks: one `ast` pass per package.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable


def _resolve(package: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def type_checking_imports(package: str, path: str) -> dict[str, tuple[str, str]]:
    """Public name -> (module, attribute) of the `from M import a as b` statements under the
    package's top-level `if TYPE_CHECKING:` blocks."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    table: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            continue
        for stmt in node.body:
            if not isinstance(stmt, ast.ImportFrom):
                raise TypeError(f"{path}: only `from M import x` goes under TYPE_CHECKING")
            module = _resolve(package, stmt)
            for alias in stmt.names:
                table[alias.asname or alias.name] = (module, alias.name)
    return table


class _LazyPackage(types.ModuleType):
    """A package whose export may share its name with a submodule (`check.preflight`, the
    function, from `check/preflight.py`): importing the submodule does not bind the module over
    the export, as the eager `__init__` (whose import came first) never did."""

    def __setattr__(self, name: str, value: object) -> None:
        if (
            isinstance(value, types.ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
            and self.__dict__["__lazy_shadowed__"](name)
        ):
            return
        super().__setattr__(name, value)


def lazy_api(package: str) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) of package `package` (pass `__name__`)."""
    module = sys.modules[package]
    table: dict[str, tuple[str, str]] | None = None

    def exports() -> dict[str, tuple[str, str]]:
        nonlocal table
        if table is None:
            table = type_checking_imports(package, module.__file__)
        return table

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if name in exports():
            source, attr = exports()[name]
            if source == package:  # `from package import submodule`
                value = importlib.import_module(f"{package}.{attr}")
            else:
                owner = importlib.import_module(source)
                try:
                    value = getattr(owner, attr)
                except AttributeError:  # a submodule not imported by its package
                    value = importlib.import_module(f"{source}.{attr}")
            setattr(module, name, value)
            return value
        # `package.submodule`, as when the eager __init__ had imported it
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(module.__dict__) | set(exports()))

    def shadowed(name: str) -> bool:  # an export of that name that is not the submodule
        return name in exports() and exports()[name] != (package, name)

    module.__lazy_shadowed__ = shadowed
    module.__class__ = _LazyPackage
    return __getattr__, __dir__


@functools.cache
def import_modules(package: str, modules: tuple[str, ...]) -> None:
    """Imports `package.m` for each of `modules`, once: a registry's lookups call it so that
    every shipped module has registered its entries, whichever module the lookup came through."""
    for module in modules:
        importlib.import_module(f"{package}.{module}")
