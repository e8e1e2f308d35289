"""Floors between the packages (docs/DESIGN.md): what importing a package loads, the package
arrows of the source against the floor order, and the registries' lists of their modules."""

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jaxrl_tools._lazy import type_checking_imports

ROOT = Path(__file__).resolve().parents[1]

# What each import loads, measured one after the other in one fresh interpreter (each set holds
# the ones before it, which only makes the later checks stricter).
PROBE = """
import json, sys
def ours():
    return sorted(m for m in sys.modules if m.startswith("jaxrl_tools"))
out = {}
import jaxrl_tools
out["jaxrl_tools"] = ours()
from jaxrl_tools.algorithms import *
out["jaxrl_tools.algorithms"] = ours()
from jaxrl_tools.config import *
out["jaxrl_tools.config"] = ours()
from jaxrl_tools.config_loader import config_from_dict
config_from_dict({"tokenizer": {"path": "unused"}})  # every section validated
out["a validated config"] = ours()
print(json.dumps(out))
"""

# Upward arrows of today, module -> module: each is a fix still to make (docs/DESIGN.md).
KNOWN_UPWARD: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def loaded():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _of(mods, packages):
    return [
        m
        for m in mods
        if any(m == f"jaxrl_tools.{p}" or m.startswith(f"jaxrl_tools.{p}.") for p in packages)
    ]


def test_import_jaxrl_tools_loads_few_modules(loaded):
    mods = loaded["jaxrl_tools"]
    assert len(mods) < 20, f"import jaxrl_tools loads {len(mods)} of our modules: {mods}"


def test_algorithms_load_no_higher_floor(loaded):
    bad = _of(loaded["jaxrl_tools.algorithms"], ("rollout", "train", "gateway", "tools"))
    assert not bad, f"from jaxrl_tools.algorithms import * loads {bad}"


def test_config_loads_no_rollout_train_gateway(loaded):
    bad = _of(loaded["jaxrl_tools.config"], ("rollout", "train", "gateway"))
    assert not bad, f"from jaxrl_tools.config import * loads {bad}"
    bad = _of(loaded["a validated config"], ("rollout", "train", "gateway"))
    assert not bad, f"validating a config loads {bad}"


def _package_dirs() -> dict[str, Path]:
    """Package name -> folder, as pyproject's package-dir installs them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / d for name, d in setuptools["package-dir"].items()}


def _modules() -> dict[str, Path]:
    dirs = _package_dirs()
    out = {}
    for pkg, folder in dirs.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if pkg == "jaxrl_tools" and f"jaxrl_tools.{parts[0]}" in dirs:
                continue  # a folder of its own (none today; mapped ones win)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


def _top_level_imports(tree: ast.Module) -> list[str]:
    """Modules and `module.name`s imported when the module is, not under TYPE_CHECKING."""
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append(node.module)
                found.extend(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _floors() -> dict[str, int]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    floors = {}
    for level, names in re.findall(r"^floor (\d+) +(.+)$", text, re.M):
        for name in names.split():
            floors[name] = int(level)
    return floors


def _floor_name(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_package_arrows_follow_the_floors():
    modules = _modules()
    floors = _floors()
    unplaced = sorted({_floor_name(m) for m in modules} - set(floors) - {None})
    assert not unplaced, f"packages on no floor of docs/DESIGN.md: {unplaced}"
    upward = set()
    for module, path in modules.items():
        for target in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if target not in modules or target == module:
                continue
            a, b = _floor_name(module), _floor_name(target)
            if a and b and floors[b] > floors[a]:
                upward.add((module, target))
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, "imports up the floors of docs/DESIGN.md: " + ", ".join(
        f"{a} -> {b} (floor {floors[_floor_name(a)]} -> {floors[_floor_name(b)]})" for a, b in new
    )
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"fixed, so remove from KNOWN_UPWARD: {gone}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_or_file_cycle():
    files: dict[str, set[str]] = {}
    packages: dict[str, set[str]] = {}
    modules = _modules()
    for module, path in modules.items():
        for target in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if target in modules and target != module:
                files.setdefault(module, set()).add(target)
                a, b = _floor_name(module), _floor_name(target)
                if a and b and a != b:
                    packages.setdefault(a, set()).add(b)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles(packages), f"packages importing each other: {_cycles(packages)}"
    assert not _cycles(files), f"files importing each other: {_cycles(files)}"


def _tuple_assigned(path: Path, name: str) -> tuple:
    for node in ast.parse(path.read_text()).body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no {name}")


@pytest.mark.parametrize(
    "package, registry, listing, decorator",
    [
        ("jaxrl_tools.algorithms", "registry", "ESTIMATOR_MODULES", "register_advantage_estimator"),
        ("jaxrl_tools.rewards", "registry", "REWARD_MODULES", "register_reward"),
        ("jaxrl_tools.envs", "base", "ENV_MODULES", "register_env"),
        ("jaxrl_tools.tools", "base", "TOOL_MODULES", "register_tool"),
    ],
)
def test_registry_lists_every_registering_module(package, registry, listing, decorator):
    """A lookup imports the listed modules first: a module registering entries and not listed
    would be missed by lookups made before something else imported it."""
    modules = {m: p for m, p in _modules().items() if m.startswith(package + ".")}
    registering = set()
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if name == decorator and not module.endswith(f".{registry}"):
                registering.add(module.removeprefix(package + "."))
    listed = set(_tuple_assigned(modules[f"{package}.{registry}"], listing))
    assert registering == listed, (
        f"{package}.{registry}.{listing} {sorted(listed)} != the modules calling {decorator} "
        f"{sorted(registering)}"
    )


def test_lazy_exports_are_all():
    """Each lazy __init__'s TYPE_CHECKING imports are exactly its __all__."""
    for module, path in _modules().items():
        if path.name != "__init__.py" or "lazy_api(__name__)" not in path.read_text():
            continue
        tree = ast.parse(path.read_text())
        all_ = next(
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "__all__"
        )
        exports = type_checking_imports(module, str(path))
        assert set(exports) == set(all_), (
            f"{module}: __all__ without import {sorted(set(all_) - set(exports))}, "
            f"import not in __all__ {sorted(set(exports) - set(all_))}"
        )
