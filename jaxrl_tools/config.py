"""Typed, frozen run configuration: one frozen dataclass per section, each validating itself.

Every choice is checked against the live registry that owns it (parsers, advantage estimators,
KL types, loss aggregations, rewards, tools, model types and dtypes, schedules), so a typo fails
here, naming the field, and never after the model loaded. Errors are `ConfigError` (a
ValueError) and name the offending field (`algorithm.dual_clip_c must be > 1`). Loading YAML and
overrides is `config_loader`; derived values are properties (`cfg.algorithm.uses_critic`).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxrl_tools import algorithms, envs, models, rewards, tools
from jaxrl_tools.rollout.sampler import ENGINES as ROLLOUT_ENGINES
from jaxrl_tools.train.lora import DECODE_MODES as LORA_DECODE_MODES
from jaxrl_tools.train.state import SCHEDULES

PROTOCOLS = (*sorted(tools.PARSERS), "none")
# What provides each advantage-estimator input beyond scores and the loss mask (the greedy
# baseline rollout is always available: the sampler runs it when the estimator reads it).
ADVANTAGE_INPUT_SOURCES = {
    "values_BT": "a critic (critic.enabled: true)",
    "kl_BT": "algorithm.kl_in_reward with kl_coef > 0",
    "step_rewards_BS": "multi-turn environment steps (an env section: env.name)",
}
STEP_INPUTS = {"step_rewards_BS", "step_mask_BS", "anchor_ids_BS", "token_step_BT"}
TASKS = ("tool_arithmetic", "function_calling")  # generated data (`data.task`)


class ConfigError(ValueError):
    """A configuration error; the message names the field (dotted path) at fault."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name} {msg}")


def _at_least(section_obj: Any, section: str, minimum: int, *fields: str) -> None:
    for f in fields:
        _check(getattr(section_obj, f) >= minimum, f"{section}.{f}", f"must be >= {minimum}")


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
        _check_choice(self.model_type, "model.tiny.model_type", models.SUPPORTED_MODEL_TYPES)
        _at_least(
            self,
            "model.tiny",
            1,
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        _check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "model.tiny.num_attention_heads",
            f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({self.num_key_value_heads})",
        )


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on the policy (`models.lora`): only they are trained; the base is frozen,
    is the KL reference, and is decoded with the adapters merged in (`decode: merged`, once per
    update) or applied per token (`decode: adapters`, no second copy of the weights)."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0  # scale = alpha / rank
    dropout: float = 0.0  # on the adapters' input, in the training loss only
    targets: tuple[str, ...] = tuple(models.LORA_TARGETS)  # q/k/v/o_proj, gate/up/down_proj
    decode: str = "merged"  # merged | adapters
    init_from: str | None = None  # a PEFT adapter folder to continue training from

    def __post_init__(self):
        _check(self.rank >= 1, "model.lora.rank", f"must be >= 1, got {self.rank}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(
            0 <= self.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}"
        )
        _check(bool(self.targets), "model.lora.targets", "must name at least one projection")
        for t in self.targets:
            _check_choice(t, "model.lora.targets[]", tuple(models.LORA_TARGETS))
        dup = sorted({t for t in self.targets if self.targets.count(t) > 1})
        _check(not dup, "model.lora.targets", f"has duplicates {dup}")
        _check_choice(self.decode, "model.lora.decode", LORA_DECODE_MODES)

    @property
    def config(self) -> models.LoraConfig | None:
        """The adapters' `models.LoraConfig`, or None when LoRA is off."""
        if not self.enabled:
            return None
        return models.LoraConfig(self.rank, self.alpha, self.dropout, self.targets)


@dataclass(frozen=True)
class ModelSection:
    """The policy: an HF folder (`path`) or, when `path` is null, a `tiny` random-init model."""

    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # Mixed precision (`models.DTypePolicy`): `dtype` is the compute dtype of every forward and
    # backward pass and of the rollout engine's weights; `param_dtype` that of the master weights
    # and optimizer state; `kv_cache_dtype` the decode engine's KV cache (null: `dtype`).
    dtype: str = "float32"
    param_dtype: str = "float32"
    kv_cache_dtype: str | None = None
    attention: str = "auto"  # models.attention.IMPLS: auto | dense | chunked | cudnn | pallas
    remat: bool = False  # rematerialise decoder layers in the update (memory for compute)
    remat_policy: str = "layer"  # with remat: "layer" recomputes everything, "dots" not matmuls
    lora: LoraSection = field(default_factory=LoraSection)  # off by default

    def __post_init__(self):
        _check_choice(self.remat_policy, "model.remat_policy", ("layer", "dots"))
        dtypes = tuple(models.PARAM_DTYPES)
        _check_choice(self.dtype, "model.dtype", dtypes)
        _check_choice(self.param_dtype, "model.param_dtype", dtypes)
        if self.kv_cache_dtype is not None:
            _check_choice(self.kv_cache_dtype, "model.kv_cache_dtype", dtypes)
        _check_choice(self.attention, "model.attention", models.attention.IMPLS)
        _check(
            not (self.param_dtype == "bfloat16" and self.dtype == "float32"),
            "model.param_dtype",
            "is bfloat16 but model.dtype (compute) is float32: master weights must be at least "
            "as precise as the compute; set model.param_dtype: float32",
        )

    @property
    def dtypes(self) -> models.DTypePolicy:
        """The policy's dtype policy (master weights, compute, KV cache)."""
        return models.DTypePolicy(
            param=self.param_dtype, compute=self.dtype, cache=self.kv_cache_dtype
        )

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
    # Prompts longer than rollout.max_prompt_len (rendered with the chat template): dropped and
    # counted (true) or an error at start-up (false).
    drop_long_prompts: bool = False
    max_eval_records: int | None = None  # evaluate on the first N eval records only (null: all)
    # Generated data when train_files is empty: tool_arithmetic (the demo) or function_calling
    # (task_difficulty is then the most tools shown per prompt).
    task: str | None = None
    task_train_size: int = 2000
    task_eval_size: int = 200
    task_difficulty: int = 2
    task_eval_all_levels: bool = False  # eval on levels 0..task_difficulty, not only the top

    def __post_init__(self):
        _check(self.batch_size >= 1, "data.batch_size", "must be >= 1")
        _check(self.eval_batch_size >= 1, "data.eval_batch_size", "must be >= 1")
        _check(self.num_epochs is None or self.num_epochs >= 1, "data.num_epochs", "must be >= 1")
        _check(
            self.max_eval_records is None or self.max_eval_records >= 1,
            "data.max_eval_records",
            "must be >= 1 (or null for all)",
        )
        if self.task is not None:
            _check_choice(self.task, "data.task", TASKS)


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
    max_turns: int = 4  # model turns per response (with an env section, env.max_turns rules)
    chunk_size: int = 32  # tokens decoded per jitted chunk before the host looks for tool calls
    slots: int = 64  # concurrent sequences in the decode engine's KV cache
    # Trajectories waiting on a tool that may hand their slot to a waiting sample, their cache
    # rows kept in host memory (up to their live length) meanwhile. null = slots; 0 = off.
    max_parked: int | None = None
    max_obs_tokens: int = 512  # observation cap (head + ... + tail)
    # The engine that decodes (rollout.sampler.ENGINES): "core" (EngineCore) or "jetstream" (the
    # same engine as a JetStream Engine, rollout.jetstream.DecodeEngine; the [serve] extra).
    engine: str = "core"
    # The engine's own mesh (DxFxT over the trainer's devices, e.g. tensor-parallel decode beside
    # an fsdp update): the weights are resharded onto it after each update. null = trainer.mesh.
    mesh: str | None = None
    tool_timeout_s: float = 10.0
    tool_concurrency: int = 8
    eval_temperature: float = 0.0  # 0 = greedy
    eval_group_size: int = 1

    def __post_init__(self):
        _check_choice(self.protocol, "rollout.protocol", PROTOCOLS)
        _check_choice(self.engine, "rollout.engine", tuple(ROLLOUT_ENGINES))
        _check(self.group_size >= 1, "rollout.group_size", f"must be >= 1, got {self.group_size}")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _check(self.eval_temperature >= 0, "rollout.eval_temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        _at_least(
            self,
            "rollout",
            1,
            "max_prompt_len",
            "max_response_len",
            "chunk_size",
            "slots",
            "max_turns",
            "max_obs_tokens",
            "tool_concurrency",
            "eval_group_size",
        )
        _check(self.max_tool_calls >= 0, "rollout.max_tool_calls", "must be >= 0")
        _check(
            self.max_parked is None or self.max_parked >= 0,
            "rollout.max_parked",
            f"must be >= 0 or null, got {self.max_parked}",
        )
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")
        _check(
            self.mesh is None or re.fullmatch(r"\d+x\d+x\d+", self.mesh) is not None,
            "rollout.mesh",
            f"must look like 'DxFxT' (e.g. '1x1x8') or null, got {self.mesh!r}",
        )

    @property
    def mesh_shape(self) -> tuple[int, int, int] | None:
        """The engine's (data, fsdp, tensor), or None: the trainer's mesh."""
        return None if self.mesh is None else tuple(int(x) for x in self.mesh.split("x"))


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


def _check_tool(spec: ToolSpec, where: str) -> None:
    """The tool class exists and takes the `config` keys (checked against its signature, so a
    recipe with a wrong key fails at load, before any model or worker pool starts)."""
    try:
        cls = tools.tool_class(spec.cls)
    except ValueError as e:
        raise ConfigError(f"{where}.cls: {e}") from None
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
    for key in spec.config:
        if key not in valid and key != "type":
            hint = difflib.get_close_matches(str(key), valid, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"{where}.config has unknown key {key!r} for tool {spec.cls!r}{extra}; "
                f"valid keys: {valid}"
            )


ENV_HISTORY = ("full", "last_k", "state")


@dataclass(frozen=True)
class EnvSection:
    """A multi-turn environment (`jaxrl_tools.envs`): every prompt is one episode.

    Episodes replace the data files: the prompt is the environment's instructions and first
    observation, and the G samples of a prompt share its seed (one start state per group, as
    GiGPO's anchor states need). Training seeds are `seed`, `seed + 1`, ...; held-out seeds
    start at `seed + envs.EVAL_SEED_OFFSET`. Grid games (sokoban, frozenlake) are played in
    RAGEN turns (`<think>..</think><answer>..</answer>`).

    History (what the model sees each turn):
    - `full`: each episode is one sequence holding its whole history. Budget (`context_budget`,
      prompt + response tokens): an episode whose next turn or observation would pass it ends
      there (finish reason "budget"); nothing is cut from the middle and no earlier turn is
      dropped; the turns played keep their rewards, and a turn cut mid-way gets no environment
      step (step mask 0).
    - `last_k`: every turn is a fresh prompt: the instructions, the last `history_length`
      (observation, answer) pairs and the current observation (GiGPO's history_length), so
      long horizons (30-100 turns) cost a bounded prompt. Truncation: a window longer than
      `rollout.max_prompt_len` drops its oldest pairs until it fits; an episode whose current
      observation does not fit alone ends there ("budget"). Each turn is its own training row;
      `rollout.max_response_len` and `context_budget` bound one turn.
    - `state`: the same with no earlier turns (the current observation only: an MDP).
    Windowed history needs an estimator whose advantage is one value per turn
    (`algorithms.turn_level`): no critic, no token rewards.
    """

    name: str | None = None  # a registered environment (envs.env_names()); null = none
    kwargs: dict[str, Any] = field(default_factory=dict)  # the environment's constructor's
    max_turns: int = 5  # turns per episode (the environment ends the episode after these)
    max_actions_per_turn: int = 1  # grid games: actions taken from one answer (RAGEN)
    format_penalty: float = -0.1  # grid games: reward of a turn not in RAGEN's form
    history: str = "full"  # what the model sees each turn: full | last_k | state
    history_length: int = 2  # last_k: earlier (observation, answer) pairs in each prompt
    context_budget: int | None = None  # prompt + response tokens per episode (null: engine's)
    seed: int = 0  # first training episode seed
    train_episodes: int = 2000  # distinct training seeds (repeated by the loader)
    eval_episodes: int = 64  # held-out seeds
    sandbox_workers: int = 2  # sandbox pool of environments that run code (refine)

    @property
    def windowed(self) -> bool:
        """Whether each turn is a fresh prompt (history last_k or state) of an environment."""
        return self.name is not None and self.history != "full"

    def __post_init__(self):
        if self.name is None:
            return
        _check_choice(self.name, "env.name", envs.env_names())
        _check_choice(self.history, "env.history", ENV_HISTORY)
        _at_least(self, "env", 1, "history_length")
        _at_least(self, "env", 1, "max_turns", "max_actions_per_turn", "train_episodes")
        _at_least(self, "env", 1, "eval_episodes", "sandbox_workers")
        _check(
            self.context_budget is None or self.context_budget >= 2,
            "env.context_budget",
            "must be >= 2 tokens (or null)",
        )
        valid = envs.env_kwargs(self.name)
        for key in self.kwargs:
            if key not in valid:
                hint = difflib.get_close_matches(str(key), valid, n=1)
                extra = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ConfigError(
                    f"env.kwargs has unknown key {key!r} for environment {self.name!r}{extra}; "
                    f"valid keys: {valid}"
                )


@dataclass(frozen=True)
class FiltersSection:
    """Group filters applied before the update."""

    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    starpo_s: bool = False  # RAGEN: keep the top fraction of groups by reward std
    starpo_keep_frac: float = 0.25
    zerotir: bool = False  # keep groups whose accuracy is in [low, high]
    zerotir_low: float = 0.2
    zerotir_high: float = 0.8
    # DAPO: sampling rounds per RL step while dynamic_sampling leaves the batch short of groups
    # (the metric filter/sampling_rounds reports how many ran); 1 = no resampling.
    max_sampling_rounds: int = 1

    def __post_init__(self):
        _check(
            self.max_sampling_rounds >= 1, "algorithm.filters.max_sampling_rounds", "must be >= 1"
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
    turn_gamma: float = 0.4  # Kevin: a turn's return = its score + turn_gamma x the next turn's
    turn_group_norm: bool = True  # Kevin: normalise turn returns over the prompt's group
    # Truncated importance sampling against the sampler's log-probs: each token's policy loss is
    # weighted by min(pi_old / pi_behaviour, tis_cap); null = off (needed by async rollouts).
    tis_cap: float | None = None
    filters: FiltersSection = field(default_factory=FiltersSection)

    def __post_init__(self):
        _check_choice(
            self.adv_estimator, "algorithm.adv_estimator", algorithms.list_advantage_estimators()
        )
        _check_choice(self.policy_loss, "algorithm.policy_loss", algorithms.POLICY_LOSSES)
        _check_choice(self.loss_agg_mode, "algorithm.loss_agg_mode", algorithms.LOSS_AGG_MODES)
        _check_choice(self.kl_type, "algorithm.kl_type", algorithms.KL_TYPES)
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
        _check(
            0 <= self.turn_gamma <= 1,
            "algorithm.turn_gamma",
            f"must be in [0, 1], got {self.turn_gamma}",
        )
        _check(self.vapo_alpha > 0, "algorithm.vapo_alpha", "must be > 0")
        _check(self.nll_coef >= 0, "algorithm.nll_coef", "must be >= 0")
        if self.tis_cap is not None:
            _check(
                self.tis_cap >= 1,
                "algorithm.tis_cap",
                f"must be >= 1 (2.0 is usual; null = off), got {self.tis_cap}",
            )

    @property
    def uses_critic(self) -> bool:
        return algorithms.needs_critic(self.adv_estimator)

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
    # Sequences back to back in the update's rows (train.packing): no compute on padding;
    # micro_batch_size then counts packed rows, and mini-batches are drawn from packed rows.
    pack: bool = False

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
    """Value model (PPO / VAPO): a value head on a copy of the policy trunk, trained with the
    `optim` section's AdamW (schedule, weight decay, betas, clip) at its own lr and warmup."""

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
    # One-step off-policy: the next batch is sampled (with the weights before this update) while
    # this one trains; staleness <= 1, corrected by algorithm.tis_cap. One process only.
    async_rollouts: bool = False
    # jax's persistent compilation cache (every compile over a second): a second run of the same
    # programs loads them instead of compiling; null = off. JAX_COMPILATION_CACHE_DIR wins.
    compile_cache_dir: str | None = "runs/xla_cache"
    # An update whose loss, gradient norm or update norm is NaN or inf (optim.lr too high, an
    # overflow): "stop" ends the run with one line before that step is saved (the last
    # checkpoint stays good: lower optim.lr and --resume); "skip_step" drops that update, keeps
    # the state before it and counts it in actor/skipped_updates (critic/skipped_updates).
    on_nonfinite: str = "stop"

    def __post_init__(self):
        _check(self.steps >= 0, "trainer.steps", "must be >= 0")
        _check_choice(self.on_nonfinite, "trainer.on_nonfinite", ("stop", "skip_step"))
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
    max_traces: int | None = None  # use only the first N traces of train_files (null: all)
    tool_mix: float = 0.8  # fraction of tool-using traces among non-trivial problems
    easy_tool_mix: float = 0.0  # fraction of tool-using traces among easy problems
    oracle_noise: float = 0.25  # grid games: chance an oracle move is another action
    pack: bool = False  # each batch's traces back to back in as few rows as fit (train.packing)

    def __post_init__(self):
        _check(self.epochs >= 0, "sft.epochs", "must be >= 0")
        _check(self.lr > 0, "sft.lr", "must be > 0")
        _check(self.batch_size >= 1, "sft.batch_size", "must be >= 1")
        _check(self.max_len >= 1, "sft.max_len", "must be >= 1")
        _check(
            self.max_traces is None or self.max_traces >= 1,
            "sft.max_traces",
            "must be >= 1 (or null for all)",
        )
        _check(0 <= self.tool_mix <= 1, "sft.tool_mix", "must be in [0, 1]")
        _check(0 <= self.easy_tool_mix <= 1, "sft.easy_tool_mix", "must be in [0, 1]")
        _check(0 <= self.oracle_noise <= 1, "sft.oracle_noise", "must be in [0, 1]")


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
    env: EnvSection = field(default_factory=EnvSection)

    def __post_init__(self):
        est, r = self.algorithm.adv_estimator, self.rollout
        # A group of one response, or of identical greedy ones, gets zero advantages everywhere.
        if algorithms.uses_group_baseline(est):
            _check(
                r.group_size >= 2,
                "rollout.group_size",
                f"must be >= 2 for algorithm.adv_estimator={est!r}: a group of one response gets "
                "zero advantages (use several samples per prompt, or a critic: "
                "adv_estimator=gae with critic.enabled=true)",
            )
            _check(
                r.temperature > 0,
                "rollout.temperature",
                f"must be > 0 for algorithm.adv_estimator={est!r}: greedy sampling makes the "
                "responses of a group identical and every advantage zero",
            )
        _check(
            self.model.attention != "cudnn" or not (self.optim.pack or self.sft.pack),
            "model.attention",
            "'cudnn' takes no packed rows (jax's API has no segment ids): use 'auto' or "
            "'chunked', or set optim.pack and sft.pack to false",
        )
        if self.tokenizer.path is None:
            _check(
                self.model.path is not None,
                "tokenizer.path",
                "must be set when model.path is null (a tiny model has no tokenizer of its own)",
            )
        names = [t.name or t.cls for t in self.tools]
        dup = {n for n in names if names.count(n) > 1}
        _check(not dup, "tools", f"has duplicate tool names {sorted(dup)}")
        for i, spec in enumerate(self.reward):
            if ":" not in spec.name:  # "module:function" names are imported by the rewards lib
                _check_choice(spec.name, f"reward[{i}].name", rewards.registered_rewards())
        for i, spec in enumerate(self.tools):
            _check_tool(spec, f"tools[{i}]")
        given = {"values_BT"} if self.critic.enabled else set()
        given.add("baseline_B")  # the sampler's greedy rollout (ReMax)
        if self.env.name is not None:
            given |= STEP_INPUTS
        if self.algorithm.kl_in_reward and self.algorithm.kl_coef > 0:
            given.add("kl_BT")
        est = self.algorithm.adv_estimator
        if "kl_BT" in given and "kl_BT" not in algorithms.estimator_inputs(est):
            takes = [
                n
                for n in algorithms.list_advantage_estimators()
                if "kl_BT" in algorithms.estimator_inputs(n)
            ]
            raise ConfigError(
                f"algorithm.kl_in_reward: adv_estimator={est!r} has no token rewards to fold "
                f"the KL into (it would be dropped); set kl_in_reward=false (KL in the loss) or "
                f"use one of {takes}"
            )
        if self.env.windowed:
            _check(
                not self.tools,
                "tools",
                f"are not supported with env.history={self.env.history!r}: a windowed turn is "
                "one model segment, with no tool calls inside it; use env.history=full",
            )
            _check(
                algorithms.turn_level(est),
                "algorithm.adv_estimator",
                f"is {est!r}, which gives each token its own advantage; env.history="
                f"{self.env.history!r} trains every turn as its own row, so it needs one of "
                f"{[n for n in algorithms.list_advantage_estimators() if algorithms.turn_level(n)]}"
                " (or env.history=full)",
            )
        missing = set(algorithms.estimator_requirements(est)) - given
        if missing:
            need = sorted(
                {
                    ADVANTAGE_INPUT_SOURCES.get(m, ADVANTAGE_INPUT_SOURCES["step_rewards_BS"])
                    for m in missing
                }
            )
            raise ConfigError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} needs "
                f"{' and '.join(need)}, which this run does not provide"
            )

    @property
    def update_rows(self) -> int:
        """Sequences in one update: prompts x G; with windowed history (a row per turn),
        x `env.max_turns`."""
        rows = self.data.batch_size * self.rollout.group_size
        return rows * self.env.max_turns if self.env.windowed else rows

    @property
    def use_reference_model(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.path if self.tokenizer.path is not None else str(self.model.path)
