"""The docs as a map of the code: every relative link (and its #anchor), every `path/file.py`
and every `jaxrl-tools <command>` named in README.md, benchmarks/README.md and docs/ exists, and
every shipped recipe is in the README's table. So a rename or a removed command fails the suite
instead of leaving the docs pointing at nothing.

Nothing is imported or run: importing `jaxrl_tools.cli` loads jax and most of the package (seconds),
so the subcommands are read with `ast` (`jaxrl_tools/commands/__init__.py`'s `COMMANDS`), and
`prepare`'s targets from the datasets' and models' tables.
"""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")]
)
PAGE_IDS = [str(p.relative_to(ROOT)) for p in DOCS]

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
# A repository path: folders, then a file with one of these endings.
PATH = re.compile(r"(?<![\w./<$~-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|yaml|toml|md|png|sbatch))\b")
COMMAND = re.compile(r"(?:^|[\s/`(])jaxrl-tools +([a-z][\w-]*)")
PREPARE = re.compile(r"jaxrl-tools +prepare +([a-z][\w.-]*)")
CONFIG = re.compile(r"--config[ =]([\w./-]+)")
# Paths a page names that are not the repository's: a run's outputs, the user's own files, the
# peers' benchmark checkout, files inside a download or an export.
NOT_OURS = (
    "runs/",
    "shared/",
    ".venv/",
    "pretrained/",
    "log_dir/",
    "adapter/",
    "mypkg/",
    "my_pkg/",
)
# Files of the papers' own repositories that RECIPES.md cites (ToRL's and Dr. GRPO's scripts,
# ZeroTIR's code and README figure, Search-R1's code, DeepResearcher's paper), and a third-party
# VAPO implementation's.
UPSTREAM = {
    "scripts/torl_1.5b.sh",
    "env/math/math_tir_process_single_request.py",
    "docs/interactions_scaling.png",
    "training/vapo_trainer.py",
    "search_r1/llm_agent/generation.py",
    "resources/DeepResearcher.pdf",
    "examples/qwen2.5-math-7b.sh",
}
# Package folders a page may name a module under (`rollout/loop.py` is jaxrl_tools/rollout/loop.py).
PATH_ROOTS = (ROOT, ROOT / "jaxrl_tools", ROOT / "benchmarks")


def _code(text: str) -> str:
    """The page's code: fenced blocks and inline spans, one per line."""
    spans = FENCE.findall(text)
    spans += [m.group(2) for m in CODE_SPAN.finditer(FENCE.sub("", text))]
    return "\n".join(spans)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation out, spaces to dashes."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    slugs, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _string_args(path: Path, callee: str) -> set[str]:
    """The first string argument of every call to `callee` (a name or an attribute) in `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        first = node.args[0]
        if name == callee and isinstance(first, ast.Constant) and isinstance(first.value, str):
            found.add(first.value)
    return found


@cache
def subcommands() -> frozenset[str]:
    """`commands.COMMANDS` (module names; `pass_rate` is `pass-rate`), read without importing."""
    tree = ast.parse((ROOT / "jaxrl_tools" / "commands" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMMANDS":
            return frozenset(m.replace("_", "-") for m in ast.literal_eval(node.value))
    raise AssertionError("jaxrl_tools/commands/__init__.py assigns no COMMANDS")


@cache
def prepare_targets() -> frozenset[str]:
    datasets = ROOT / "jaxrl_tools" / "datasets"
    models = _string_args(datasets / "pretrained.py", "Pretrained")
    return frozenset(
        _string_args(datasets / "prepare.py", "Dataset") | models | {"gguf", "retool-coldstart"}
    )


def test_the_cli_is_read():
    assert {"demo", "train", "check", "plan", "serve", "prepare", "pass-rate"} <= subcommands()
    assert {"dapo-math-17k", "smollm2-135m-instruct", "gguf"} <= prepare_targets()


@pytest.mark.parametrize("page", DOCS, ids=PAGE_IDS)
def test_links_resolve(page):
    text = FENCE.sub("", page.read_text())
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", DOCS, ids=PAGE_IDS)
def test_named_paths_exist(page):
    missing = []
    text = LINK.sub("", page.read_text())  # links: test_links_resolve
    for path in sorted(set(PATH.findall(text))):
        if path.startswith(NOT_OURS) or path in UPSTREAM:
            continue
        if not any((root / path).exists() for root in PATH_ROOTS):
            missing.append(path)
    assert not missing, f"paths named in {page.relative_to(ROOT)} that do not exist: {missing}"


@pytest.mark.parametrize("page", DOCS, ids=PAGE_IDS)
def test_commands_exist(page):
    code = _code(page.read_text())
    unknown = sorted(set(COMMAND.findall(code)) - subcommands())
    assert not unknown, (
        f"`jaxrl-tools <command>` with no such subcommand in jaxrl_tools/commands: {unknown}"
    )
    unknown = sorted(set(PREPARE.findall(code)) - prepare_targets())
    assert not unknown, f"`jaxrl-tools prepare <target>` that prepare does not know: {unknown}"
    recipes = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    bad = []
    for name in set(CONFIG.findall(code)):
        if "/" in name or name.endswith(".yaml"):  # a file: ours if under configs/
            if name.startswith("configs/") and not (ROOT / name).exists():
                bad.append(name)
        elif name.isidentifier() and not name.isupper() and name not in recipes:
            bad.append(name)
    assert not bad, f"--config of no shipped recipe: {sorted(bad)}"


def test_every_recipe_is_in_the_readme_table():
    text = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    recipes = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert not recipes - listed, f"recipes missing from the README's table: {recipes - listed}"
    assert not listed - recipes, f"README rows of no recipe: {listed - recipes}"


def test_readme_stays_a_front_page():
    """The README is the way in (what, set-up, main job, links); the detail lives in docs/."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15_000
    # scripts/setup.sh, scripts/test.sh and .ci/run run the set-up's two commands as written.
    assert "bash scripts/setup.sh && .venv/bin/jaxrl-tools demo\n" in readme
    assert "bash scripts/test.sh\n" in readme
