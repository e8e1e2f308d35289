"""The trainer section: steps, checkpoints, logs and trackers, evaluation, rollouts ahead."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jaxrl_tools.config.checks import _check, _check_choice

# trainer.max_staleness's bound: AReaL's staleness ablations (2505.24298) stay within single
# digits, as do ours (k <= 4 in tests and benchmarks); past it the run would train on samples
# of policies too old for truncated importance weights to correct, held in memory meanwhile.
MAX_STALENESS = 8

LOGGERS = ("tensorboard", "jsonl", "wandb", "mlflow")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class WandbSection:
    """Weights & Biases (`trainer.loggers: [..., wandb]`); the run is named `trainer.run_name`
    and its files go under `trainer.log_dir/wandb`."""

    project: str = "jaxrl-tools"
    entity: str | None = None  # null: the logged-in user's default entity
    # online | offline (no network; `wandb sync` later) | disabled; null: WANDB_MODE if set,
    # else online (as wandb itself decides).
    mode: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        _check(bool(self.project), "trainer.wandb.project", "must be non-empty")
        if self.mode is not None:
            _check_choice(self.mode, "trainer.wandb.mode", WANDB_MODES)


@dataclass(frozen=True)
class MlflowSection:
    """MLflow (`trainer.loggers: [..., mlflow]`)."""

    # null: MLFLOW_TRACKING_URI if set, else a local file store in `trainer.log_dir/mlruns`.
    tracking_uri: str | None = None
    experiment: str | None = None  # null: `trainer.run_name`

    def __post_init__(self):
        _check(
            self.experiment is None or bool(self.experiment),
            "trainer.mlflow.experiment",
            "must be non-empty (or null for trainer.run_name)",
        )


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
    # Rollouts ahead of the update (`rollout.ahead`): batch b is sampled with the weights after
    # update b - 1 - k while earlier updates run, so its tokens are at most k versions old (an
    # off-policy correction is required: algorithm.tis_cap or algorithm.off_policy); 0 = on-policy.
    max_staleness: int = 0
    # With max_staleness >= 1: a rollout still decoding when newer weights are published
    # continues with them (its earlier tokens keep their version); false: it finishes on the
    # weights it started with.
    partial_rollouts: bool = False
    # jax's persistent compilation cache (every compile over a second): a second run of the same
    # programs loads them instead of compiling; null = off. JAX_COMPILATION_CACHE_DIR wins.
    compile_cache_dir: str | None = "runs/xla_cache"
    # An update whose loss, gradient norm or update norm is NaN or inf (optim.lr too high, an
    # overflow): "stop" ends the run with one line before that step is saved (the last
    # checkpoint stays good: lower optim.lr and --resume); "skip_step" drops that update, keeps
    # the state before it and counts it in actor/skipped_updates (critic/skipped_updates).
    on_nonfinite: str = "stop"
    # Where step metrics go (process 0 only): tensorboard, jsonl (`metrics.jsonl`, always on: a
    # resumed run reads it back), wandb, mlflow (those two: `pip install 'jaxrl-tools[trackers]'`).
    loggers: tuple[str, ...] = ("tensorboard", "jsonl")
    wandb: WandbSection = field(default_factory=WandbSection)
    mlflow: MlflowSection = field(default_factory=MlflowSection)
    # Every N steps, that step's rollouts as (prompt, response, reward) rows: `samples.jsonl` in
    # log_dir, and a table in wandb / mlflow; 0 = off.
    log_samples_every: int = 0

    def __post_init__(self):
        _check(self.steps >= 0, "trainer.steps", "must be >= 0")
        for name in self.loggers:
            _check_choice(name, "trainer.loggers", LOGGERS)
        _check(
            "jsonl" in self.loggers,
            "trainer.loggers",
            f"must include jsonl (got {list(self.loggers)}): metrics.jsonl is always written, "
            "a resumed run reads it back; add jsonl to the list",
        )
        _check(self.log_samples_every >= 0, "trainer.log_samples_every", "must be >= 0 (0 = off)")
        _check_choice(self.on_nonfinite, "trainer.on_nonfinite", ("stop", "skip_step"))
        _check(
            0 <= self.max_staleness <= MAX_STALENESS,
            "trainer.max_staleness",
            f"must be in [0, {MAX_STALENESS}] (0 = on-policy), got {self.max_staleness}: each "
            "unit holds one more sampled batch and weight copy, and the off-policy corrections "
            "are meant for a few updates of lag, not a run sampled by its first policy",
        )
        _check(
            not self.partial_rollouts or self.max_staleness >= 1,
            "trainer.partial_rollouts",
            "needs trainer.max_staleness >= 1 (on-policy rollouts never see newer weights)",
        )
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
