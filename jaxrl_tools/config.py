"""Typed, frozen run configuration, parsed from YAML (draccus) with dotted command-line overrides.

    cfg = load_config("configs/grpo_tool_math.yaml", ["trainer.steps=10", "--optim.lr", "2e-6"])

Every section is a frozen dataclass that validates itself in `__post_init__`; errors are
`ConfigError` (a ValueError) and name the offending field (`algorithm.dual_clip_c must be > 1`).
Unknown keys (in YAML or overrides) are errors that list the valid keys of that section.
Derived values are properties (`cfg.use_reference_model`, `cfg.algorithm.uses_critic`).
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus
import yaml

# Names other parts of the library register; kept here so that a typo fails at load time.
PROTOCOLS = ("qwen", "hermes", "torl", "retool", "search_r1", "ragen", "none")
ADV_ESTIMATORS = (
    "grpo",
    "drgrpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "gae",
    "vapo",
    "gigpo",
)
CRITIC_ESTIMATORS = ("gae", "vapo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
POLICY_LOSSES = ("ppo_clip", "gspo")
MODEL_TYPES = ("qwen2", "qwen3", "llama")
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("constant", "cosine", "linear")


class ConfigError(ValueError):
    """A configuration error; the message names the field (dotted path) at fault."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name} {msg}")


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}{extra}")


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyModelConfig:
    """A randomly initialised model (tests, the CPU demo). vocab_size comes from the tokenizer."""

    model_type: str = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    seed: int = 0

    def __post_init__(self):
        _check_choice(self.model_type, "model.tiny.model_type", MODEL_TYPES)
        for f in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _check(getattr(self, f) > 0, f"model.tiny.{f}", "must be > 0")
        _check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "model.tiny.num_attention_heads",
            f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({self.num_key_value_heads})",
        )


@dataclass(frozen=True)
class ModelSection:
    """The policy: an HF folder (`path`) or, when `path` is null, a `tiny` random-init model."""

    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: str = "float32"  # compute / parameter dtype of the policy
    ref_path: str | None = None  # reference policy for KL; null = the initial policy
    remat: bool = False  # rematerialise decoder layers in the update (memory for compute)

    def __post_init__(self):
        _check_choice(self.dtype, "model.dtype", DTYPES)

    @property
    def is_tiny(self) -> bool:
        return self.path is None


@dataclass(frozen=True)
class TokenizerSection:
    """Tokenizer folder; with `build`, a missing folder is trained by `build_tokenizer`."""

    path: str | None = None  # null: use model.path (a real model's own tokenizer)
    build: bool = True
    vocab_size: int = 1024
    seed: int = 0

    def __post_init__(self):
        _check(self.vocab_size >= 265, "tokenizer.vocab_size", "must be >= 265")


@dataclass(frozen=True)
class DataSection:
    """Prompt data (jsonl / parquet) and how to read it."""

    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"  # a string or a list of chat messages
    answer_key: str = "ground_truth"
    tools_key: str = "tools"  # optional per-record tool set
    system_prompt: str | None = None
    batch_size: int = 8  # prompts per RL step (each sampled rollout.group_size times)
    eval_batch_size: int = 32
    shuffle_seed: int = 0
    num_epochs: int | None = None  # null: repeat forever
    skip_bad_lines: bool = False
    # Generated tool-arithmetic task (the demo) when train_files is empty.
    task: str | None = None
    task_train_size: int = 2000
    task_eval_size: int = 200
    task_difficulty: int = 2
    task_eval_all_levels: bool = False  # eval on levels 0..task_difficulty, not only the top

    def __post_init__(self):
        _check(self.batch_size >= 1, "data.batch_size", "must be >= 1")
        _check(self.eval_batch_size >= 1, "data.eval_batch_size", "must be >= 1")
        _check(self.num_epochs is None or self.num_epochs >= 1, "data.num_epochs", "must be >= 1")
        if self.task is not None:
            _check_choice(self.task, "data.task", ("tool_arithmetic",))


@dataclass(frozen=True)
class RolloutSection:
    """Sampling and the agent loop."""

    protocol: str = "qwen"  # tool-call format: a jaxrl_tools.tools parser name
    group_size: int = 8  # G responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_prompt_len: int = 512
    max_response_len: int = 1024  # model + observation tokens of one response
    max_tool_calls: int = 3  # C: later calls are answered with a budget notice
    max_turns: int = 4
    chunk_size: int = 32  # tokens decoded per jitted chunk before the host looks for tool calls
    slots: int = 64  # concurrent sequences in the decode engine's KV cache
    max_obs_tokens: int = 512  # observation cap (head + ... + tail)
    tool_timeout_s: float = 10.0
    tool_concurrency: int = 8
    eval_temperature: float = 0.0  # 0 = greedy
    eval_group_size: int = 1

    def __post_init__(self):
        _check_choice(self.protocol, "rollout.protocol", PROTOCOLS)
        _check(self.group_size >= 1, "rollout.group_size", f"must be >= 1, got {self.group_size}")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _check(self.eval_temperature >= 0, "rollout.eval_temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        for f in (
            "max_prompt_len",
            "max_response_len",
            "chunk_size",
            "slots",
            "max_turns",
            "max_obs_tokens",
            "tool_concurrency",
            "eval_group_size",
        ):
            _check(getattr(self, f) >= 1, f"rollout.{f}", "must be >= 1")
        _check(self.max_tool_calls >= 0, "rollout.max_tool_calls", "must be >= 0")
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")


@dataclass(frozen=True)
class ToolSpec:
    """A tool declaration: `cls` ("python", "search", "calculator" or "module:Class") + kwargs.

    YAML may spell the key `class:`; it is read as `cls`.
    """

    cls: str = "python"
    name: str | None = None  # the function name the model sees (default: the tool's own)
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check(bool(self.cls), "tools[].cls", "must be non-empty")


@dataclass(frozen=True)
class FiltersSection:
    """Group filters applied before the update."""

    dynamic_sampling: bool = False  # DAPO: drop all-equal groups, resample to fill the batch
    max_sampling_rounds: int = 3
    starpo_s: bool = False  # RAGEN: keep the top fraction of groups by reward std
    starpo_keep_frac: float = 0.25
    zerotir: bool = False  # keep groups whose accuracy is in [low, high]
    zerotir_low: float = 0.2
    zerotir_high: float = 0.8

    def __post_init__(self):
        _check(
            self.max_sampling_rounds >= 0, "algorithm.filters.max_sampling_rounds", "must be >= 0"
        )
        _check(
            0 < self.starpo_keep_frac <= 1,
            "algorithm.filters.starpo_keep_frac",
            "must be in (0, 1]",
        )
        _check(
            0 <= self.zerotir_low <= self.zerotir_high <= 1,
            "algorithm.filters.zerotir_low",
            f"/zerotir_high must satisfy 0 <= low <= high <= 1, got "
            f"{self.zerotir_low}, {self.zerotir_high}",
        )


@dataclass(frozen=True)
class AlgorithmSection:
    """Advantage estimator, policy loss, KL and filters."""

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # GRPO's σ division (False = Dr. GRPO style)
    policy_loss: str = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO clip-higher: 0.28
    dual_clip_c: float | None = 3.0  # null = no dual clip
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.001  # 0 = no KL and no reference model
    kl_type: str = "low_var_kl"  # k1 | k2 | k3 (= low_var_kl) | abs
    kl_in_reward: bool = False  # True: -β·KL in the token rewards (PPO, REINFORCE++)
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0  # GAE λ of the policy
    vapo_alpha: float = 0.05  # VAPO length-adaptive λ = 1 - 1/(α·|o|)
    nll_coef: float = 0.0  # VAPO positive-example NLL weight (0.1 in the paper)
    gigpo_omega: float = 1.0
    filters: FiltersSection = field(default_factory=FiltersSection)

    def __post_init__(self):
        _check_choice(self.adv_estimator, "algorithm.adv_estimator", ADV_ESTIMATORS)
        _check_choice(self.policy_loss, "algorithm.policy_loss", POLICY_LOSSES)
        _check_choice(self.loss_agg_mode, "algorithm.loss_agg_mode", LOSS_AGG_MODES)
        _check_choice(self.kl_type, "algorithm.kl_type", KL_TYPES)
        _check(
            self.clip_eps_low > 0, "algorithm.clip_eps_low", f"must be > 0, got {self.clip_eps_low}"
        )
        _check(
            self.clip_eps_high > 0,
            "algorithm.clip_eps_high",
            f"must be > 0, got {self.clip_eps_high}",
        )
        _check(self.clip_eps_low < 1, "algorithm.clip_eps_low", "must be < 1")
        if self.dual_clip_c is not None:
            _check(
                self.dual_clip_c > 1,
                "algorithm.dual_clip_c",
                f"must be > 1 (or null to disable), got {self.dual_clip_c}",
            )
        _check(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        _check(self.entropy_coef >= 0, "algorithm.entropy_coef", "must be >= 0")
        _check(0 <= self.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {self.gamma}")
        _check(0 <= self.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {self.lam}")
        _check(self.vapo_alpha > 0, "algorithm.vapo_alpha", "must be > 0")
        _check(self.nll_coef >= 0, "algorithm.nll_coef", "must be >= 0")

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator in CRITIC_ESTIMATORS

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward


@dataclass(frozen=True)
class RewardSpec:
    """One term of the composite reward: a registered reward name, its weight and kwargs."""

    name: str = "math"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check(bool(self.name), "reward[].name", "must be non-empty")


@dataclass(frozen=True)
class OptimSection:
    """AdamW on the policy, with warmup + schedule, gradient clipping and PPO-style epochs."""

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0  # final lr / lr for cosine / linear decay
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # global-norm clip; null = off
    micro_batch_size: int = 4  # sequences per forward/backward (gradient accumulation)
    ppo_epochs: int = 1
    num_mini_batches: int = 1  # optimizer steps per RL step and epoch

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check_choice(self.schedule, "optim.schedule", SCHEDULES)
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(0 <= self.b1 < 1, "optim.b1", "must be in [0, 1)")
        _check(0 <= self.b2 < 1, "optim.b2", "must be in [0, 1)")
        _check(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", "must be > 0")
        _check(self.micro_batch_size >= 1, "optim.micro_batch_size", "must be >= 1")
        _check(self.ppo_epochs >= 1, "optim.ppo_epochs", "must be >= 1")
        _check(self.num_mini_batches >= 1, "optim.num_mini_batches", "must be >= 1")


@dataclass(frozen=True)
class CriticSection:
    """Value model (PPO / VAPO): a value head on a copy of the policy trunk."""

    enabled: bool = False
    lr: float = 1e-5
    warmup_steps: int = 0
    value_clip_eps: float = 0.5
    lam: float = 1.0  # critic GAE λ (VAPO decoupled GAE: 1.0)
    pretrain_steps: int = 0  # VAPO value pre-training steps before the policy moves

    def __post_init__(self):
        _check(self.lr > 0, "critic.lr", "must be > 0")
        _check(self.value_clip_eps > 0, "critic.value_clip_eps", "must be > 0")
        _check(0 <= self.lam <= 1, "critic.lam", "must be in [0, 1]")
        _check(self.pretrain_steps >= 0, "critic.pretrain_steps", "must be >= 0")


@dataclass(frozen=True)
class TrainerSection:
    """The outer loop: steps, seed, mesh, checkpoints, logs, evaluation."""

    steps: int = 100
    seed: int = 0
    mesh: str = "1x1x1"  # data x fsdp x tensor, or "auto" (all devices on fsdp)
    checkpoint_dir: str = "runs/checkpoints"
    checkpoint_every: int = 50  # 0 = only at the end
    keep_checkpoints: int = 3
    resume: bool = True
    log_dir: str = "runs/logs"
    log_every: int = 1
    eval_every: int = 0  # 0 = off
    run_name: str = "run"

    def __post_init__(self):
        _check(self.steps >= 0, "trainer.steps", "must be >= 0")
        _check(
            self.mesh == "auto" or re.fullmatch(r"\d+x\d+x\d+", self.mesh) is not None,
            "trainer.mesh",
            f"must look like 'DxFxT' (e.g. '1x2x1') or 'auto', got {self.mesh!r}",
        )
        _check(self.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
        _check(self.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
        _check(self.log_every >= 1, "trainer.log_every", "must be >= 1")
        _check(self.eval_every >= 0, "trainer.eval_every", "must be >= 0")

    @property
    def mesh_shape(self) -> tuple[int, int, int] | None:
        """(data, fsdp, tensor), or None for "auto"."""
        if self.mesh == "auto":
            return None
        d, f, t = (int(x) for x in self.mesh.split("x"))
        return d, f, t


@dataclass(frozen=True)
class SFTSection:
    """Supervised warm-up on tool-use traces before RL."""

    enabled: bool = False
    train_files: tuple[str, ...] = ()
    epochs: int = 1
    lr: float = 1e-5
    warmup_steps: int = 0
    batch_size: int = 8
    max_len: int = 1024
    num_traces: int = 2000  # generated traces when train_files is empty (demo)
    tool_mix: float = 0.8  # fraction of tool-using traces among non-trivial problems
    easy_tool_mix: float = 0.0  # fraction of tool-using traces among easy problems

    def __post_init__(self):
        _check(self.epochs >= 0, "sft.epochs", "must be >= 0")
        _check(self.lr > 0, "sft.lr", "must be > 0")
        _check(self.batch_size >= 1, "sft.batch_size", "must be >= 1")
        _check(self.max_len >= 1, "sft.max_len", "must be >= 1")
        _check(0 <= self.tool_mix <= 1, "sft.tool_mix", "must be in [0, 1]")
        _check(0 <= self.easy_tool_mix <= 1, "sft.easy_tool_mix", "must be in [0, 1]")


def _default_rewards() -> tuple[RewardSpec, ...]:
    return (RewardSpec("math", 1.0, {}),)


@dataclass(frozen=True)
class RunConfig:
    """The whole run."""

    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    tools: tuple[ToolSpec, ...] = ()
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    reward: tuple[RewardSpec, ...] = field(default_factory=_default_rewards)
    optim: OptimSection = field(default_factory=OptimSection)
    critic: CriticSection = field(default_factory=CriticSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    sft: SFTSection = field(default_factory=SFTSection)

    def __post_init__(self):
        if self.algorithm.uses_critic:
            _check(
                self.critic.enabled,
                "critic.enabled",
                f"must be true for algorithm.adv_estimator={self.algorithm.adv_estimator!r}",
            )
        if self.algorithm.adv_estimator == "rloo":
            _check(self.rollout.group_size >= 2, "rollout.group_size", "must be >= 2 for rloo")
        if self.tokenizer.path is None:
            _check(
                self.model.path is not None,
                "tokenizer.path",
                "must be set when model.path is null (a tiny model has no tokenizer of its own)",
            )
        names = [t.name or t.cls for t in self.tools]
        dup = {n for n in names if names.count(n) > 1}
        _check(not dup, "tools", f"has duplicate tool names {sorted(dup)}")
        self._check_reward_names()

    def _check_reward_names(self) -> None:
        try:
            from jaxrl_tools import rewards as rewards_lib
        except ImportError:  # rewards not importable: skip, the trainer will complain
            return
        known = rewards_lib.registered_rewards()
        for i, spec in enumerate(self.reward):
            if ":" not in spec.name:  # "module:function" names are resolved by the rewards lib
                _check_choice(spec.name, f"reward[{i}].name", known)

    @property
    def use_reference_model(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.path if self.tokenizer.path is not None else str(self.model.path)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_KEY_ALIASES = {ToolSpec: {"class": "cls"}}


def _strip_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


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
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key '{full}'{hint}; valid keys for {where}: {names}")
        tp = _strip_optional(hints[key])
        if dataclasses.is_dataclass(tp) and value is not None:
            raw[key] = _validate_keys(tp, value, full)
        elif typing.get_origin(tp) in (tuple, list) and value is not None:
            (elem, *_) = typing.get_args(tp) or (Any,)
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


__all__ = [
    "ConfigError",
    "RunConfig",
    "ModelSection",
    "TinyModelConfig",
    "TokenizerSection",
    "DataSection",
    "RolloutSection",
    "ToolSpec",
    "AlgorithmSection",
    "FiltersSection",
    "RewardSpec",
    "OptimSection",
    "CriticSection",
    "TrainerSection",
    "SFTSection",
    "load_config",
    "save_config",
    "config_from_dict",
    "config_to_yaml",
    "PROTOCOLS",
    "ADV_ESTIMATORS",
]
