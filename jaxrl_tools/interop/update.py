"""One policy update on an interchange batch, through the trainer's own functions.

The trainer's ``objectives.actor_loss`` is ``algorithms.policy_loss`` of
``objectives.sequence_logprobs``; here the two are differentiated separately and joined by the
chain rule (see ``_pullback``), so that trying other settings recompiles only the loss.

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
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.data import DataError
from jaxrl_tools.interop.batch import check_batch, packed, response_columns, spread_responses
from jaxrl_tools.models.hf_io import to_hf_tensors
from jaxrl_tools.train import objectives
from jaxrl_tools.train.state import torch_adamw

# The estimators the PyTorch reference transcribes (verl's names in docs/METHODS.md).
REFERENCE_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "gae")


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """Everything that sets the math of one update; each field says what it matches.

    Attributes:
      adv_estimator: a registered estimator (``drgrpo`` = verl's grpo with
        ``norm_adv_by_std_in_grpo: false``); groups come from the batch's ``uid``.
      norm_adv_by_std: grpo's division by the group std (verl ``norm_adv_by_std_in_grpo``).
      gamma, lam: GAE γ and λ (verl ``algorithm.gamma`` / ``lam``).
      clip_eps_low, clip_eps_high: verl ``clip_ratio_low`` / ``clip_ratio_high``.
      dual_clip_c: verl ``clip_ratio_c`` (verl always applies it; None here turns it off).
      loss_agg_mode: verl ``loss_agg_mode``; the loss is divided as verl's ``agg_loss`` does
        (``algorithms.verl_loss_denominator``), with L_max = the batch's response width.
      kl_coef, kl_type: verl ``use_kl_loss`` with ``kl_loss_coef`` / ``kl_loss_type`` (0 = off).
      entropy_coef: verl ``entropy_coeff``.
      temperature: the sampling temperature; logits are divided by it (verl does the same).
      lr, betas, eps, weight_decay: ``torch.optim.AdamW`` (torch's defaults but lr).
      grad_clip: verl ``actor.grad_clip`` (global norm before the step); None = no clipping.
    """

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.adv_estimator not in algorithms.list_advantage_estimators():
            raise ConfigError(
                f"adv_estimator={self.adv_estimator!r} is not one of "
                f"{algorithms.list_advantage_estimators()}"
            )
        if self.loss_agg_mode not in algorithms.LOSS_AGG_MODES:
            raise ConfigError(
                f"loss_agg_mode={self.loss_agg_mode!r} is not one of {algorithms.LOSS_AGG_MODES}"
            )
        if self.temperature <= 0 or self.lr <= 0:
            raise ConfigError("temperature and lr must be > 0")

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> UpdateSettings:
        """The settings of a run's first RL update (its algorithm and optim sections).

        Raises ConfigError for what one verl-style update cannot reproduce: a warm-up (the first
        step's lr would be 0), GSPO, KL folded into the rewards, VAPO's NLL term.
        """
        a, o = cfg.algorithm, cfg.optim
        for bad, why in (
            (o.warmup_steps > 0, "optim.warmup_steps must be 0 (the first step's lr would be 0)"),
            (a.policy_loss != "ppo_clip", "algorithm.policy_loss must be ppo_clip"),
            (a.kl_in_reward, "algorithm.kl_in_reward must be false (KL in the loss only)"),
            (a.nll_coef > 0, "algorithm.nll_coef must be 0"),
        ):
            if bad:
                raise ConfigError(f"repro: {why}")
        return cls(
            adv_estimator=a.adv_estimator,
            norm_adv_by_std=a.norm_adv_by_std,
            gamma=a.gamma,
            lam=a.lam,
            clip_eps_low=a.clip_eps_low,
            clip_eps_high=a.clip_eps_high,
            dual_clip_c=a.dual_clip_c,
            loss_agg_mode=a.loss_agg_mode,
            kl_coef=a.kl_coef,
            kl_type=a.kl_type,
            entropy_coef=a.entropy_coef,
            temperature=cfg.rollout.temperature,
            lr=o.lr,
            betas=(o.b1, o.b2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            grad_clip=o.grad_clip,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    x = packed(batch)
    cols = response_columns(batch)
    order, G = algorithms.contiguous_groups(batch["uid"])
    rewards = x["token_rewards"][order]
    inputs = {"loss_mask_BT": x["loss_mask"][order], "scores_B": rewards.sum(axis=1)}
    if algorithms.needs_critic(settings.adv_estimator):
        if "values" not in x:
            raise DataError(
                f"adv_estimator={settings.adv_estimator!r} needs the batch field 'values' (the "
                "critic's V per response token)"
            )
        inputs.update(values_BT=x["values"][order], token_rewards_BT=rewards)
    config = algorithms.AdvantageConfig(
        group_size=G,
        norm_by_std=settings.norm_adv_by_std,
        gamma=settings.gamma,
        lam=settings.lam,
    )
    adv, ret = algorithms.compute_advantages(
        settings.adv_estimator,
        algorithms.AdvantageInputs(**{k: jnp.asarray(v) for k, v in inputs.items()}),
        config,
    )
    undo = np.argsort(order)
    responses = lambda a: np.take_along_axis(np.asarray(a)[undo], cols, axis=1)
    return responses(adv), responses(ret)


def policy_loss_config(settings: UpdateSettings, response_width: int):
    return algorithms.PolicyLossConfig(
        clip_eps_low=settings.clip_eps_low,
        clip_eps_high=settings.clip_eps_high,
        dual_clip_c=settings.dual_clip_c,
        kl_coef=settings.kl_coef,
        kl_type=settings.kl_type,
        entropy_coef=settings.entropy_coef,
        loss_agg_mode=settings.loss_agg_mode,
        max_len=response_width,
    )


def optimizer(settings: UpdateSettings) -> optax.GradientTransformation:
    adamw = torch_adamw(
        settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
    )
    if settings.grad_clip:
        return optax.chain(optax.clip_by_global_norm(settings.grad_clip), adamw)
    return adamw


# The update in three jitted parts, split at the token log-probs by the chain rule, so that the
# model's forward and backward compile once per model and batch shape, whatever the settings:
#   1. (logp, entropy) = the trainer's sequence_logprobs(params)      once per model
#   2. loss and (∂loss/∂logp, ∂loss/∂entropy) by algorithms.policy_loss  once per settings (small)
#   3. grads = the pullback of 1 applied to those cotangents           once per model
@functools.partial(jax.jit, static_argnums=(0, 1))
def _logprobs(model_cfg, temperature, params, mb):
    return objectives.sequence_logprobs(model_cfg, temperature, False, params, mb, True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pullback(model_cfg, temperature, params, mb, cotangents):
    fn = lambda p: objectives.sequence_logprobs(model_cfg, temperature, False, p, mb, True)
    _, pullback = jax.vjp(fn, params)
    return pullback(cotangents)[0]


@functools.partial(jax.jit, static_argnums=(0,))
def _loss_and_cotangents(pcfg, logp, entropy, mb, denom):
    def loss(logp, entropy):
        # No old log-probs: one on-policy update, old = sg[current] (as the trainer does).
        old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
        terms = algorithms.policy_loss(
            pcfg,
            logp,
            old,
            mb["advantages"],
            mb["loss_mask"],
            ref_logp_BT=mb.get("ref_logp"),
            entropy_BT=entropy,
            denominator=denom,
        )
        return terms.loss  # total / denominator: the objective (LossTerms.total is not)

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
    x = packed(batch)
    cols = response_columns(batch)
    adv, ret = advantages_by_uid(batch, settings)
    mb = {k: jnp.asarray(x[k]) for k in ("tokens", "positions", "attention", "loss_mask")}
    mb["advantages"] = jnp.asarray(spread_responses(adv, cols, x["tokens"].shape[1]))
    if "old_logp" in x:  # else the update is on-policy: old = sg[current] (as verl's first epoch)
        mb["old_logp"] = jnp.asarray(x["old_logp"])
    if settings.kl_coef:
        if "ref_logp" not in x:
            raise DataError(
                "kl_coef > 0 needs the batch field 'ref_log_prob' (the reference policy's "
                "log-probs); add it or set kl_coef=0"
            )
        mb["ref_logp"] = jnp.asarray(x["ref_logp"])
    denom = algorithms.verl_loss_denominator(
        jnp.asarray(batch["response_mask"]), settings.loss_agg_mode, R
    )
    T = settings.temperature
    seqs = {k: mb[k] for k in ("tokens", "positions", "attention", "loss_mask")}
    logp, entropy = _logprobs(model_cfg, T, params, seqs)
    pcfg = policy_loss_config(settings, R)
    loss, cotangents = _loss_and_cotangents(pcfg, logp, entropy, mb, denom)
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
