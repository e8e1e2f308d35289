"""The model, tokenizer and data sections (with the tiny model and LoRA settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxrl_tools import models
from jaxrl_tools.config.checks import _at_least, _check, _check_choice
from jaxrl_tools.models.lora import DECODE_MODES as LORA_DECODE_MODES

TASKS = ("tool_arithmetic", "function_calling", "when_to_call")  # generated data (`data.task`)
CURRICULA = ("easy_to_hard",)  # orders of the training prompts (`data.curriculum`)


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
    # One weight per training file: batches draw from the files in these proportions (each file
    # shuffled and repeated on its own, reproducible per data.shuffle_seed). null: the files'
    # records are one pool.
    train_weights: tuple[float, ...] | None = None
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
    # Generated data when train_files is empty: tool_arithmetic (the demo), function_calling
    # (task_difficulty is then the most tools shown per prompt) or when_to_call (the real-model
    # demo: questions answered in the head mixed with arithmetic that needs Python).
    task: str | None = None
    task_train_size: int = 2000
    task_eval_size: int = 200
    task_difficulty: int = 2
    task_eval_all_levels: bool = False  # eval on levels 0..task_difficulty, not only the top
    # The training prompts' order: null (shuffled) or "easy_to_hard" (highest pass rate first,
    # every epoch; the records need a "pass_rate": `jaxrl-tools pass-rate` writes it).
    curriculum: str | None = None
    # A `verifiers` environment's tasks: {taskset: id, train: {its config}, eval: {...}}; its
    # episodes are the rollouts (jaxrl_tools/agents/verifiers_envs.py).
    verifiers: dict[str, Any] | None = None

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
        if self.curriculum is not None:
            _check_choice(self.curriculum, "data.curriculum", CURRICULA)
        if self.train_weights is not None:
            w = self.train_weights
            _check(
                len(w) == len(self.train_files) and all(x > 0 for x in w),
                "data.train_weights",
                f"needs one weight > 0 per data.train_files entry ({len(self.train_files)}), "
                f"got {list(w)}",
            )
            _check(
                self.num_epochs is None and self.curriculum is None,
                "data.train_weights",
                "mixes the files forever in their proportions: it takes no data.num_epochs and "
                "no data.curriculum",
            )
        if self.verifiers is not None:
            v = self.verifiers
            _check(
                isinstance(v.get("taskset"), str) and isinstance(v.get("train"), dict),
                "data.verifiers",
                f"needs taskset (its id) and train (its taskset config, {{}} for none), got {v}",
            )
            _check(
                set(v) <= {"taskset", "train", "eval"} and isinstance(v.get("eval", {}), dict),
                "data.verifiers",
                f"takes taskset, train and eval (a taskset config, or absent), got {sorted(v)}",
            )
            _check(
                self.task is None and not self.train_files and not self.eval_files,
                "data.verifiers",
                "gives the records: remove data.task and data.train_files / eval_files",
            )
