"""One policy update on an interchange batch, through the trainer's own objective code.

The trainer's loss is `objectives.actor_loss` = `objectives.actor_objective` of
`objectives.sequence_logprobs`; here the two are differentiated separately and joined by the
chain rule (see ``_pullback``), so that trying other settings recompiles only the loss. The
settings are the run's own sections (`UpdateSettings`: its `AlgorithmSection`, `OptimSection` and
sampling temperature), turned into the loss's and the estimators' settings by the functions the
trainer uses (`objectives.policy_loss_config`, `objectives.advantage_config`).

The update is what verl's actor does with one rank and one micro-batch: token log-probs of the
tempered policy, advantages from the batch's rewards grouped by ``uid``, the PPO-clip loss (+ KL
to the reference, − entropy) aggregated as verl's ``agg_loss`` divides, its gradient, and one
``torch.optim.AdamW`` step (``train.state.torch_adamw``, optionally after global-norm clipping).
Everything is returned by Hugging Face tensor name, so it compares directly with a PyTorch model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_tools import algorithms, models
from jaxrl_tools.config import (
    AlgorithmSection,
    ConfigError,
    CriticSection,
    OptimSection,
    RunConfig,
)
from jaxrl_tools.data import DataError
from jaxrl_tools.interop.batch import check_batch, packed, response_columns, spread_responses
from jaxrl_tools.models.hf_io import to_hf_tensors
from jaxrl_tools.train import objectives
from jaxrl_tools.train.state import torch_adamw

# The estimators the PyTorch reference transcribes (verl's names in docs/METHODS.md).
REFERENCE_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "gae")

# The fields of the sections that set one update's math (what a batch file records; verl's
# names in docs/METHODS.md): the estimator, the loss, and torch.optim.AdamW.
ALGORITHM_FIELDS = (
    "adv_estimator",
    "norm_adv_by_std",
    "gamma",
    "lam",
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip_c",
    "loss_agg_mode",
    "kl_coef",
    "kl_type",
    "entropy_coef",
)
OPTIM_FIELDS = ("lr", "b1", "b2", "eps", "weight_decay", "grad_clip")


def _no_kl() -> AlgorithmSection:
    return AlgorithmSection(kl_coef=0.0)


def _torch_defaults() -> OptimSection:
    return OptimSection(grad_clip=None)  # torch.optim.AdamW's betas, eps and decay; no clip


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """The run's sections that set one update (each of their fields names the verl setting it
    matches in docs/METHODS.md); nothing is copied out of them.

    Attributes:
      algorithm: the estimator (``drgrpo`` = verl's grpo with ``norm_adv_by_std_in_grpo:
        false``; groups come from the batch's ``uid``) and the loss; the loss is divided as
        verl's ``agg_loss`` does (``algorithms.verl_loss_denominator``), with L_max = the
        batch's response width. Default: GRPO without KL.
      optim: ``torch.optim.AdamW``'s lr, betas (b1, b2), eps and weight decay, and verl's
        ``actor.grad_clip`` (None = no clipping, the default).
      temperature: the sampling temperature; logits are divided by it (verl does the same).
    """

    algorithm: AlgorithmSection = dataclasses.field(default_factory=_no_kl)
    optim: OptimSection = dataclasses.field(default_factory=_torch_defaults)
    temperature: float = 1.0

    def __post_init__(self):
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> UpdateSettings:
        """The settings of a run's first RL update (its algorithm and optim sections).

        Raises ConfigError for what one verl-style update cannot reproduce: a warm-up (the first
        step's lr would be 0), GSPO, KL folded into the rewards, VAPO's NLL term, truncated
        importance weights (the batch has no behaviour log-probs).
        """
        a, o = cfg.algorithm, cfg.optim
        for bad, why in (
            (o.warmup_steps > 0, "optim.warmup_steps must be 0 (the first step's lr would be 0)"),
            (a.policy_loss != "ppo_clip", "algorithm.policy_loss must be ppo_clip"),
            (a.kl_in_reward, "algorithm.kl_in_reward must be false (KL in the loss only)"),
            (a.nll_coef > 0, "algorithm.nll_coef must be 0"),
            (a.corrects_off_policy, "algorithm.tis_cap and algorithm.off_policy must be off"),
        ):
            if bad:
                raise ConfigError(f"repro: {why}")
        return cls(a, o, cfg.rollout.temperature)

    def to_dict(self) -> dict:
        """The fields that set the update (`ALGORITHM_FIELDS`, `OPTIM_FIELDS`), JSON-able."""
        return {
            "algorithm": {f: getattr(self.algorithm, f) for f in ALGORITHM_FIELDS},
            "optim": {f: getattr(self.optim, f) for f in OPTIM_FIELDS},
            "temperature": self.temperature,
        }

    @classmethod
    def from_dict(cls, d: dict) -> UpdateSettings:
        """The settings of `to_dict`'s dict (other fields of the sections at their defaults)."""
        return cls(
            AlgorithmSection(**d.get("algorithm", {})),
            OptimSection(**{"grad_clip": None, **d.get("optim", {})}),
            d.get("temperature", 1.0),
        )


@dataclasses.dataclass
class UpdateResult:
    """One update's stages, arrays on the host; tensors by Hugging Face name.

    Attributes:
      logp: [B, R] log-probs of the responses (0 where response_mask is 0).
      advantages, returns: [B, R] the estimator's (0 where response_mask is 0).
      loss: the objective that was differentiated.
      grads: the loss's gradient, by HF parameter name.
      params: the parameters after one optimizer step, by HF parameter name.
    """

    logp: np.ndarray
    advantages: np.ndarray
    returns: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]


def advantages_by_uid(
    batch: dict[str, np.ndarray], settings: UpdateSettings
) -> tuple[np.ndarray, np.ndarray]:
    """([B, R] advantages, returns) of the configured estimator, rows grouped by ``uid``."""
    a = settings.algorithm
    x = packed(batch)
    cols = response_columns(batch)
    order, G = algorithms.contiguous_groups(batch["uid"])
    rewards = x["token_rewards"][order]
    inputs = {"loss_mask_BT": x["loss_mask"][order], "scores_B": rewards.sum(axis=1)}
    if algorithms.needs_critic(a.adv_estimator):
        if "values" not in x:
            raise DataError(
                f"adv_estimator={a.adv_estimator!r} needs the batch field 'values' (the "
                "critic's V per response token)"
            )
        inputs.update(values_BT=x["values"][order], token_rewards_BT=rewards)
    adv, ret = algorithms.compute_advantages(
        a.adv_estimator,
        algorithms.AdvantageInputs(**{k: jnp.asarray(v) for k, v in inputs.items()}),
        objectives.advantage_config(a, CriticSection(), G),
    )
    undo = np.argsort(order)
    responses = lambda a: np.take_along_axis(np.asarray(a)[undo], cols, axis=1)  # noqa: E731
    return responses(adv), responses(ret)


def optimizer(settings: UpdateSettings) -> optax.GradientTransformation:
    """``torch.optim.AdamW`` with the optim section's settings (after its global-norm clip)."""
    o = settings.optim
    adamw = torch_adamw(o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay)
    if o.grad_clip:
        return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw)
    return adamw


# The update in three jitted parts, split at the token log-probs by the chain rule, so that the
# model's forward and backward compile once per model and batch shape, whatever the settings:
#   1. (logp, entropy) = the trainer's sequence_logprobs(params)      once per model
#   2. loss and (∂loss/∂logp, ∂loss/∂entropy) by the trainer's actor_objective  once per settings
#   3. grads = the pullback of 1 applied to those cotangents           once per model
@functools.partial(jax.jit, static_argnums=(0, 1))
def _logprobs(model_cfg, temperature, params, mb):
    return objectives.sequence_logprobs(model_cfg, temperature, False, params, mb, True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pullback(model_cfg, temperature, params, mb, cotangents):
    fn = lambda p: objectives.sequence_logprobs(model_cfg, temperature, False, p, mb, True)  # noqa: E731
    _, pullback = jax.vjp(fn, params)
    return pullback(cotangents)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_and_cotangents(pcfg, nll_coef, logp, entropy, mb, denom):
    # Without old log-probs the update is on-policy: old = sg[current] (as the trainer does).
    def loss(logp, entropy):
        return objectives.actor_objective(pcfg, nll_coef, logp, entropy, mb, denom)[0]

    return jax.value_and_grad(loss, argnums=(0, 1))(logp, entropy)


@functools.partial(jax.jit, static_argnums=(0,))
def _adamw_step(settings, params, grads):
    opt = optimizer(settings)
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates)


def jax_update(
    model_cfg: models.ModelConfig,
    params,
    batch: dict[str, np.ndarray],
    settings: UpdateSettings,
) -> UpdateResult:
    """One update here: the trainer's log-probs and policy loss, our estimator, optax AdamW.

    Args:
      model_cfg, params: the policy (``models.from_pretrained`` of the batch's checkpoint).
      batch: a verl-layout batch (``interop.batch``).
      settings: UpdateSettings.
    """
    R = check_batch(batch)[2]
    a = settings.algorithm
    x = packed(batch)
    cols = response_columns(batch)
    adv, ret = advantages_by_uid(batch, settings)
    mb = {k: jnp.asarray(x[k]) for k in ("tokens", "positions", "attention", "loss_mask")}
    mb["advantages"] = jnp.asarray(spread_responses(adv, cols, x["tokens"].shape[1]))
    if "old_logp" in x:  # else the update is on-policy: old = sg[current] (as verl's first epoch)
        mb["old_logp"] = jnp.asarray(x["old_logp"])
    if a.kl_coef:
        if "ref_logp" not in x:
            raise DataError(
                "kl_coef > 0 needs the batch field 'ref_log_prob' (the reference policy's "
                "log-probs); add it or set kl_coef=0"
            )
        mb["ref_logp"] = jnp.asarray(x["ref_logp"])
    denom = algorithms.verl_loss_denominator(
        jnp.asarray(batch["response_mask"]), a.loss_agg_mode, R
    )
    T = settings.temperature
    seqs = {k: mb[k] for k in ("tokens", "positions", "attention", "loss_mask")}
    logp, entropy = _logprobs(model_cfg, T, params, seqs)
    pcfg = objectives.policy_loss_config(a, R)
    loss, cotangents = _loss_and_cotangents(pcfg, a.nll_coef, logp, entropy, mb, denom)
    grads = _pullback(model_cfg, T, params, seqs, cotangents)
    new_params = _adamw_step(settings, params, grads)
    return UpdateResult(
        logp=np.take_along_axis(np.asarray(logp), cols, axis=1),
        advantages=adv,
        returns=ret,
        loss=float(loss),
        grads=to_hf_tensors(model_cfg, grads),
        params=to_hf_tensors(model_cfg, new_params),
    )
