"""Shipped recipes (YAML), installed with the package as `jaxrl_tools.configs`."""

from pathlib import Path

DIR = Path(__file__).parent


def path(name: str) -> Path:
    """The YAML file of recipe `name` (e.g. "grpo_tool_math")."""
    p = DIR / f"{name.removesuffix('.yaml')}.yaml"
    if not p.is_file():
        names = sorted(f.stem for f in DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no shipped config {name!r}; shipped: {names}")
    return p


def resolve(source: str) -> Path:
    """`source` itself when it is a YAML file, else the shipped recipe of that name."""
    p = Path(source)
    return p if p.is_file() else path(source)
