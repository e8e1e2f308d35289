"""The install is complete and lean: every third-party import of the package is a declared
dependency, and the training path (`jaxrl-tools demo`) never imports JetStream / TensorFlow.

Why: the test install (torch, JetStream) pulls in far more than the core install, so a module
that the code imports but only a test extra brings (jinja2, via torch) passed every test while
the README's plain `scripts/setup.sh && jaxrl-tools demo` failed. So these tests read the source
and the declared dependencies rather than trust what the test venv happens to import. (The
runtime check of the plain install is `.ci/run`'s shortened demo.)
"""

import ast
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# Source folders of the installed package (pyproject maps models/, sharding/, tools/ into
# jaxrl_tools.*); their own top-level names count as first-party too.
SOURCE_DIRS = ("jaxrl_tools", "models", "sharding", "tools")
FIRST_PARTY = set(SOURCE_DIRS)
# Modules that may come from an extra instead of the core dependencies (imported lazily).
EXTRA_ONLY = {
    "jetstream": "serve",
    "grpc": "serve",
    "torch": "repro",
    "trl": "repro",
    "datasets": "repro",
    "wandb": "trackers",
    "mlflow": "trackers",
    "mcp": "mcp",
    "anyio": "mcp",
    "openai": "agents",
    "httpx": "agents",
    "starlette": "agents",
    "uvicorn": "agents",
    "verifiers": "verifiers",
    "gguf": "gguf",
    "agents": "agent-sdks",
    "langchain_openai": "agent-sdks",
    "langchain_core": "agent-sdks",
    "smolagents": "agent-sdks",
}
HEAVY = ("jetstream", "tensorflow", "seqio")  # what the training path must not import
# Distributions the core install must not pull in, even transitively: TensorFlow (~2 GB, via
# JetStream's seqio) and torch (test-only; it also drags in jinja2 and so hides its absence).
NOT_IN_CORE = {"google-jetstream", "seqio", "tensorflow", "tensorflow-text", "torch", "trl"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(reqs: list[str]) -> set[str]:
    return {_norm(Requirement(r).name) for r in reqs}


def _type_checking(node: ast.AST) -> bool:
    t = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
        or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST):
    """(top-level module name, line) of every absolute import, at module level or in a
    function (a lazy import runs too), skipping `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.partition(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _module_level_imports(tree: ast.AST):
    """Like `_imports`, but only the imports that run when the module is imported."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from _imports(node)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _third_party_imports() -> list[tuple[str, str]]:
    """(module, "file:line") for every third-party import in the package's source."""
    found = []
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for mod, line in _imports(tree):
                if mod in sys.stdlib_module_names or mod in FIRST_PARTY:
                    continue
                found.append((mod, f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_every_third_party_import_is_a_declared_dependency():
    project = _pyproject()
    core = _declared(project["dependencies"])
    extras = project.get("optional-dependencies", {})
    dists = metadata.packages_distributions()
    found = _third_party_imports()
    assert found, "no third-party imports found: is SOURCE_DIRS still right?"
    problems = []
    for mod, where in found:
        provided_by = {_norm(d) for d in dists.get(mod, [])}
        extra = EXTRA_ONLY.get(mod)
        allowed = core | _declared(extras.get(extra, [])) if extra else core
        if not provided_by:
            problems.append(f"{where}: `import {mod}`: no installed distribution provides it")
        elif not provided_by & allowed:
            where_to = "[project] dependencies" + (f" or [{extra}]" if extra else "")
            problems.append(
                f"{where}: `import {mod}` comes from {sorted(provided_by)}, "
                f"not declared in {where_to}"
            )
    assert not problems, "undeclared runtime imports:\n" + "\n".join(problems)


def _requires(dist: str, extras: set[str]) -> list[Requirement]:
    out = []
    for r in metadata.requires(dist) or []:
        req = Requirement(r)
        envs = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def test_core_install_pulls_no_tensorflow_jetstream_or_torch():
    """The closure of [project] dependencies, read from the installed packages' metadata."""
    todo = [(Requirement(r), ["jaxrl-tools"]) for r in _pyproject()["dependencies"]]
    seen, bad = set(), []
    while todo:
        req, chain = todo.pop()
        name = _norm(req.name)
        chain = [*chain, name]
        if name in NOT_IN_CORE:
            bad.append(" -> ".join(chain))
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = _requires(req.name, set(req.extras))
        except metadata.PackageNotFoundError:
            continue  # a marker-excluded or platform-specific dependency
        todo += [(r, chain) for r in reqs]
    assert not bad, "the core install would pull:\n" + "\n".join(sorted(set(bad)))


# Imports jaxrl_tools.cli, then every first-party module reachable from it through imports at
# any level (the CLI imports its run module lazily, and that its stages), one at a time, and
# reports which one first brought a heavy module into sys.modules.
_PROBE = textwrap.dedent(
    """
    import ast, importlib, importlib.util, json, sys
    HEAVY = {heavy!r}
    def heavy():
        return sorted(m for m in sys.modules if m.partition(".")[0] in HEAVY)
    def children(name, path):
        pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                yield base
                for a in node.names:
                    yield f"{{base}}.{{a.name}}"
    todo, seen, imported, culprits = ["jaxrl_tools.cli"], set(), [], {{}}
    while todo:
        name = todo.pop()
        if name in seen or name.partition(".")[0] != "jaxrl_tools":
            continue
        seen.add(name)
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue  # `from module import attr`: attr is not a module
        before = set(heavy())
        mod = importlib.import_module(name)
        imported.append((name, getattr(mod, "__file__", None)))
        if set(heavy()) - before:
            culprits[name] = sorted(set(heavy()) - before)[:3]
        if (getattr(mod, "__file__", None) or "").endswith(".py"):
            todo += list(children(name, mod.__file__))
    print(json.dumps({{"modules": imported, "heavy": heavy(), "culprits": culprits}}))
    """
)


def test_training_path_does_not_import_jetstream_or_tensorflow():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["modules"]) > 5, result["modules"]  # the probe did follow the imports
    if result["heavy"]:
        # The culprits are the modules whose import brought them in (perhaps through others);
        # name the files that import them at import time, outside any function.
        direct = [
            f"{Path(f).relative_to(ROOT)}:{line}"
            for _, f in result["modules"]
            if f and f.endswith(".py") and Path(f).is_relative_to(ROOT)
            for mod, line in _module_level_imports(ast.parse(Path(f).read_text()))
            if mod in HEAVY
        ]
        raise AssertionError(
            f"importing the training path imported {result['heavy'][:5]}; first brought in by "
            f"importing {result['culprits']}; module-level imports: {direct or 'none found'}"
        )


def test_chat_template_dependency_declared():
    """No import of ours names jinja2: transformers imports it inside apply_chat_template, yet
    transformers 5 declares it only in its `chat-template` extra (the demo failed without it)."""
    assert "jinja2" in _declared(_pyproject()["dependencies"])
