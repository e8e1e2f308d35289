"""The engine protocol (`engine.protocol.Engine`): both engines have every call it names
with its parameters, and the code that decodes (the driver, the sampler, the gateway, both
servers) asks an engine for nothing else, so a third engine that satisfies it can be plugged in."""

import ast
import inspect
from pathlib import Path

import pytest
from fakes import tiny_model_config

from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.engine.jetstream import DecodeEngine
from jaxrl_tools.engine.protocol import Engine

ROOT = Path(__file__).resolve().parents[1] / "jaxrl_tools"
CALLERS = (
    "rollout/loop.py",
    "rollout/driver.py",
    "agents/rollouts.py",
    "rollout/sampler.py",
    "gateway/engine_backend.py",
    "serve.py",
    "serve_openai.py",
)
JETSTREAM_ONLY = {"render_prompt"}  # serve.py sets it on JetStream's engine (text requests)


def _members(proto) -> dict[str, object]:
    """Name -> its declaration: a function, a property, or None (a data attribute)."""
    out: dict[str, object] = dict.fromkeys(proto.__annotations__)
    for name, v in vars(proto).items():
        if not name.startswith("_") and (inspect.isfunction(v) or isinstance(v, property)):
            out[name] = v
    return out


def _params(fn) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", [EngineCore, DecodeEngine], ids=["core", "jetstream"])
def test_both_engines_satisfy_the_protocol(cls):
    members = _members(Engine)
    assert {"prefill", "insert", "generate_steps", "write_slots", "park", "slots"} <= set(members)
    engine = cls(tiny_model_config(), None, slots=2, max_len=32, max_prefill_length=16)
    for name, spec in members.items():
        if inspect.isfunction(spec):  # a call: the same parameters, in order and kind
            assert _params(getattr(cls, name)) == _params(spec), name
        elif isinstance(spec, property):
            assert isinstance(inspect.getattr_static(cls, name), property), name
        else:
            assert hasattr(engine, name), name


def _engine_attributes(path: Path) -> set[str]:
    """Attributes read off `engine` or `<x>.engine` in a module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "engine") or (
            isinstance(v, ast.Attribute) and v.attr == "engine" and isinstance(v.value, ast.Name)
        ):
            out.add(node.attr)
    return out


def test_callers_use_only_the_protocol():
    allowed = set(_members(Engine))
    used = {rel: _engine_attributes(ROOT / rel) for rel in CALLERS}
    assert used["rollout/driver.py"] >= {"prefill", "insert", "generate_steps", "park"}
    for rel, names in used.items():
        extra = names - allowed - (JETSTREAM_ONLY if rel == "serve.py" else set())
        assert not extra, f"{rel} asks the engine for {sorted(extra)}, not in Engine"
