"""The algorithm (with its filters), reward, optim, critic and SFT sections (the trainer's:
`trainer.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxrl_tools import algorithms
from jaxrl_tools.config.checks import ConfigError, _check, _check_choice

SCHEDULES = ("constant", "cosine", "linear")  # learning-rate schedules (train.state.make_optimizer)


@dataclass(frozen=True)
class FiltersSection:
    """Group filters applied before the update."""

    dynamic_sampling: bool = False  # DAPO: drop groups all right or all wrong (accuracy)
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
class OffPolicySection:
    """A correction for tokens sampled by another policy than the update's start
    (`algorithms.off_policy`): an importance weight per token or sequence capped at `cap`, and a
    mask per token, sequence or geometric mean dropping ratios outside [low, high]."""

    weight: str | None = None  # token | sequence | null
    cap: float | None = None  # null: uncapped
    mask: str | None = None  # token | sequence | geometric | null
    low: float = 0.0
    high: float | None = None  # null: no upper bound

    def __post_init__(self):
        try:
            self.correction()
        except ValueError as e:
            raise ConfigError(str(e).replace("OffPolicyConfig.", "algorithm.off_policy.")) from None

    def correction(self) -> algorithms.OffPolicyConfig:
        high = float("inf") if self.high is None else self.high
        return algorithms.OffPolicyConfig(self.weight, self.cap, self.mask, self.low, high)


@dataclass(frozen=True)
class AlgorithmSection:
    """Advantage estimator, policy loss, KL and filters."""

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # GRPO's σ division (False = Dr. GRPO style)
    policy_loss: str = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO clip-higher: 0.28
    # The dual clip's c: "auto" = the policy loss's own (ppo_clip 3.0, gspo none); null = none.
    dual_clip_c: float | str | None = "auto"
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
    step_gamma: float = 0.95  # gigpo, turn_rloo: γ of the discounted step returns
    turn_gamma: float = 0.4  # Kevin: a turn's return = its score + turn_gamma x the next turn's
    turn_group_norm: bool = True  # Kevin: normalise turn returns over the prompt's group
    # Truncated importance sampling against the sampler's log-probs: each token's policy loss is
    # weighted by min(pi_old / pi_behaviour, tis_cap); null = off. Short for off_policy
    # {weight: token, cap: tis_cap}.
    tis_cap: float | None = None
    # Any correction (truncated or masked IS, token or sequence level, decoupled PPO).
    off_policy: OffPolicySection = field(default_factory=OffPolicySection)
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
        if isinstance(self.dual_clip_c, str):
            _check(
                self.dual_clip_c == "auto",
                "algorithm.dual_clip_c",
                f"must be a number > 1, auto or null, got {self.dual_clip_c!r}",
            )
        elif self.dual_clip_c is not None:
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
            0 <= self.step_gamma <= 1,
            "algorithm.step_gamma",
            f"must be in [0, 1], got {self.step_gamma}",
        )
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
            _check(
                not self.off_policy.correction().active,
                "algorithm.tis_cap",
                "and algorithm.off_policy are two corrections: keep one (tis_cap C is "
                "off_policy {weight: token, cap: C})",
            )

    def correction(self) -> algorithms.OffPolicyConfig:
        """The off-policy correction the loss applies (`tis_cap` C: a token weight capped at C)."""
        if self.tis_cap is not None:
            return algorithms.OffPolicyConfig(weight="token", cap=self.tis_cap)
        return self.off_policy.correction()

    @property
    def corrects_off_policy(self) -> bool:
        """Whether the loss reweights tokens by the sampler's log-probs."""
        return self.correction().active

    @property
    def uses_critic(self) -> bool:
        return algorithms.needs_critic(self.adv_estimator)

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward

    @property
    def dual_clip(self) -> float | None:
        """The dual clip's c in force: `dual_clip_c`, or the policy loss's own with "auto"."""
        if self.dual_clip_c == "auto":
            return algorithms.policy_loss_dual_clip(self.policy_loss)
        return self.dual_clip_c


@dataclass(frozen=True)
class RewardSpec:
    """One term of the composite reward: a registered reward name, its weight and kwargs."""

    name: str = "math"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Wall-clock bound of the term's call on one trajectory (rewards.deadline): its math
    # checks stop there and count as wrong answers; a slow or imported reward's call still
    # running a second later is given up and scores `timeout_score`. Both count in
    # reward/timeouts.
    timeout_s: float = 10.0
    timeout_score: float = 0.0

    def __post_init__(self):
        _check(bool(self.name), "reward[].name", "must be non-empty")
        _check(self.timeout_s > 0, "reward[].timeout_s", "must be > 0 seconds")


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
    # Packing that lays each group's shared prompt out once before its samples (each sample
    # attends to it): the update computes the prompt once per group, not once per sample.
    share_prefix: bool = False
    # Tokens per packed row (null: the padded rows' width). A group shares its prompt whole
    # only in a row that holds prompt + G x response tokens.
    pack_width: int | None = None

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(self.pack_width is None or self.pack_width >= 1, "optim.pack_width", "must be >= 1")
        _check(
            self.pack_width is None or self.pack or self.share_prefix,
            "optim.pack_width",
            "is the width of packed rows: set optim.pack or optim.share_prefix too",
        )
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


# `trainer.loggers`: where step metrics go. jsonl (metrics.jsonl) cannot be left out: a resumed
# run reads it back (its records up to the checkpoint, and the end-of-run plot from them).


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
