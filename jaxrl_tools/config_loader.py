"""Loading a RunConfig: YAML files, dotted command-line overrides, unknown keys (did-you-mean).

    cfg = load_config("configs/grpo_tool_math.yaml", ["trainer.steps=10", "--optim.lr", "2e-6"])

Unknown keys (in YAML or overrides) are errors that list the valid keys of that section; values
are parsed as YAML and converted to the field's type by draccus.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import draccus
import yaml

from jaxrl_tools.config import ConfigError, RunConfig, ToolSpec
from jaxrl_tools.errors import did_you_mean

_KEY_ALIASES = {ToolSpec: {"class": "cls"}}
_KIND = {int: "an integer", float: "a number"}


def _strip_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


# Keys that were replaced: what to write instead.
_REPLACED_KEYS = {
    "trainer.async_rollouts": " (replaced: write trainer.max_staleness: 1 for what true was)",
}


def _validate_keys(cls, raw: Any, path: str) -> Any:
    """Check `raw` against dataclass `cls`: unknown keys and non-mappings are ConfigErrors.

    Returns raw with key aliases applied (e.g. a tool's `class` -> `cls`).
    """
    where = path or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with keys {_field_names(cls)}, got {raw!r}")
    aliases = _KEY_ALIASES.get(cls, {})
    raw = {aliases.get(k, k): v for k, v in raw.items()}
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    for key, value in raw.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            hint = _REPLACED_KEYS.get(full, did_you_mean(key, names))
            raise ConfigError(f"unknown key '{full}'{hint}; valid keys for {where}: {names}")
        tp = _strip_optional(hints[key])
        if tp in (int, float) and isinstance(value, bool):
            # draccus would read true as 1: a flag given where a number belongs is a mistake.
            raise ConfigError(f"{full} must be {_KIND[tp]}, got {str(value).lower()}")
        if dataclasses.is_dataclass(tp) and value is not None:
            raw[key] = _validate_keys(tp, value, full)
        elif typing.get_origin(tp) in (tuple, list) and value is not None:
            (elem, *_) = typing.get_args(tp) or (Any,)
            if elem is str and isinstance(value, str):
                # `data.train_files=x.jsonl`: one file, not the characters of its name.
                raw[key] = value = [value]
            if dataclasses.is_dataclass(elem):
                if not isinstance(value, list | tuple):
                    raise ConfigError(f"{full} must be a list of {elem.__name__}, got {value!r}")
                raw[key] = [_validate_keys(elem, v, f"{full}[{i}]") for i, v in enumerate(value)]
    return raw


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_OVERRIDE_RE = re.compile(r"^(?:--)?([A-Za-z_][\w.\[\]]*)=(.*)$", re.DOTALL)


def _parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """Accept `a.b=v`, `--a.b=v` and `--a.b v`; return (dotted key, value string) pairs."""
    out = []
    i = 0
    items = list(overrides)
    while i < len(items):
        item = items[i]
        m = _OVERRIDE_RE.match(item)
        if m:
            out.append((m.group(1), m.group(2)))
            i += 1
        elif item.startswith("--") and i + 1 < len(items):
            out.append((item[2:], items[i + 1]))
            i += 2
        else:
            raise ConfigError(
                f"cannot parse override {item!r}: use 'section.key=value' or '--section.key value'"
            )
    return out


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    # "reward.0.weight" / "reward[0].weight" index into lists.
    parts = [p for p in re.split(r"\.|\[|\]", key) if p]
    node: Any = raw
    for j, part in enumerate(parts):
        last = j == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override {key!r}: index {part!r} out of range ({len(node)} items)"
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[:j])} is not a mapping")
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                node[part] = {} if not parts[j + 1].isdigit() else []
            node = node[part]


def _parse_value(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "1e-6" as a string; draccus converts strings to the field's type.
    return value


def _find_config_error(exc: BaseException) -> ConfigError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConfigError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def config_from_dict(raw: dict | None) -> RunConfig:
    """Build a RunConfig from a plain nested dict (as read from YAML).

    Raises:
      ConfigError: unknown key (names the key and the valid keys), wrong type or invalid value
        (names the field).
    """
    raw = _validate_keys(RunConfig, dict(raw or {}), "")
    try:
        return draccus.decode(RunConfig, raw)
    except ConfigError:
        raise
    except Exception as e:  # draccus wraps __post_init__ errors; surface ours
        inner = _find_config_error(e)
        if inner is not None:
            raise ConfigError(str(inner)) from None
        raise ConfigError(f"invalid config: {e}") from e


def load_config(
    yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> RunConfig:
    """Load a RunConfig from a YAML file plus dotted overrides.

    Args:
      yaml_path: a YAML file (sections as in RunConfig), or None for the defaults.
      overrides: e.g. ["trainer.steps=10", "--optim.lr", "2e-6", "--rollout.top_p=0.9",
        "reward.0.weight=0.5"]; values are parsed as YAML ("[1,2]", "null", "true").

    Returns:
      The frozen, validated RunConfig.

    Raises:
      ConfigError: naming the file, key or field at fault.
    """
    raw: dict = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for key, text in _parse_overrides(overrides):
        _set_dotted(raw, key, _parse_value(text))
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        where = f"{yaml_path}: " if yaml_path is not None else ""
        raise ConfigError(f"{where}{e}") from None


def apply_overrides(
    cfg: RunConfig, overrides: Sequence[str], *, except_sections: Sequence[str] = ()
) -> RunConfig:
    """`cfg` with dotted overrides set on it, as `load_config` sets them on a YAML file's.

    Args:
      cfg: a RunConfig.
      overrides: as for `load_config`.
      except_sections: top-level sections whose overrides are left out (e.g. "model").

    Raises:
      ConfigError: naming the key or field at fault.
    """
    raw = yaml.safe_load(config_to_yaml(cfg)) or {}
    for key, text in _parse_overrides(overrides):
        if re.split(r"\.|\[", key, maxsplit=1)[0] not in except_sections:
            _set_dotted(raw, key, _parse_value(text))
    return config_from_dict(raw)


def config_to_yaml(cfg: RunConfig) -> str:
    """Serialise a RunConfig to YAML text (loadable by load_config)."""
    buf = io.StringIO()
    draccus.dump(cfg, buf)
    return buf.getvalue()


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write `cfg` as YAML to `path` (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))
