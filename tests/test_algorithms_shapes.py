"""Every public function in jaxrl_tools.algorithms refuses, at trace time and with a one-line
ValueError naming the argument, inputs that would otherwise broadcast or truncate silently."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_tools.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    PolicyLossConfig,
    accuracy_band_filter,
    aggregate,
    apply_kl_penalty,
    chunked_token_logprobs,
    chunked_token_logprobs_and_entropy,
    compute_advantages,
    discounted_returns,
    dynamic_sampling_filter,
    entropy_loss,
    gae_advantages,
    gae_step,
    get_advantage_estimator,
    kl_loss,
    kl_penalty,
    last_token_onehot,
    log_ratio,
    loss_denominator,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    ppo_clip_loss,
    starpo_s_filter,
    target_logprobs,
    token_entropy,
    value_loss,
)

B, T, V, D, S, G = 6, 10, 11, 4, 3, 3
rng = np.random.default_rng(0)
X = rng.normal(size=(B, T)).astype(np.float32)  # any [B, T] float (log-probs, values, ...)
M = (rng.random((B, T)) < 0.7).astype(np.float32)
M[:, -1] = 1.0
LOGITS = rng.normal(size=(B, T, V)).astype(np.float32)
TARGETS = rng.integers(0, V, (B, T)).astype(np.int32)
H = rng.normal(size=(B, T, D)).astype(np.float32)
W = rng.normal(size=(D, V)).astype(np.float32)
CFG = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)


def sh(*dims):
    return re.escape(str(tuple(dims)))


# (id, function of nothing, regex of the message). Each runs eagerly and under jax.jit.
LOSS_CASES = [
    (
        "ppo_mask_short",
        lambda: ppo_clip_loss(X, X, X, M[:, :-1]),
        rf"ppo_clip_loss: loss_mask_BT has shape {sh(B, T - 1)}, expected {sh(B, T)} "
        r"\(the shape of logp_BT\)",
    ),
    (
        "ppo_mask_broadcastable",
        lambda: ppo_clip_loss(X, X, X, M[:, :1]),
        rf"ppo_clip_loss: loss_mask_BT has shape {sh(B, 1)}, expected {sh(B, T)}",
    ),
    (
        "ppo_old_logp",
        lambda: ppo_clip_loss(X, X[:, 1:], X, M),
        rf"ppo_clip_loss: old_logp_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "ppo_advantages_per_row",
        lambda: ppo_clip_loss(X, X, X[:, 0], M),
        rf"ppo_clip_loss: advantages_BT has shape {sh(B)}, expected {sh(B, T)}",
    ),
    (
        "ppo_logp_1d",
        lambda: ppo_clip_loss(X[0], X[0], X[0], M[0]),
        rf"ppo_clip_loss: logp_BT has shape {sh(T)}, expected \[B, T\]",
    ),
    (
        "ppo_denominator_per_row",
        lambda: ppo_clip_loss(X, X, X, M, denominator=jnp.ones(B)),
        rf"ppo_clip_loss: denominator has shape {sh(B)}, expected a scalar",
    ),
    (
        "policy_ref_logp",
        lambda: policy_loss(CFG, X, X, X, M, ref_logp_BT=X[:, :-1], entropy_BT=X),
        rf"policy_loss: ref_logp_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "policy_entropy",
        lambda: policy_loss(CFG, X, X, X, M, ref_logp_BT=X, entropy_BT=X[:1]),
        rf"policy_loss: entropy_BT has shape {sh(1, T)}, expected {sh(B, T)}",
    ),
    (
        "policy_mask",
        lambda: policy_loss(CFG, X, X, X, M[:-1], ref_logp_BT=X, entropy_BT=X),
        rf"policy_loss: loss_mask_BT has shape {sh(B - 1, T)}, expected {sh(B, T)}",
    ),
    (
        "policy_advantages",
        lambda: policy_loss(CFG, X, X, X[:, :1], M, ref_logp_BT=X, entropy_BT=X),
        rf"policy_loss: advantages_BT has shape {sh(B, 1)}, expected {sh(B, T)}",
    ),
    (
        "policy_denominator",
        lambda: policy_loss(
            CFG, X, X, X, M, ref_logp_BT=X, entropy_BT=X, denominator=jnp.ones((1,))
        ),
        r"policy_loss: denominator has shape \(1,\), expected a scalar",
    ),
    (
        "value_old_values",
        lambda: value_loss(X, X[:, :-2], X, M),
        rf"value_loss: old_values_BT has shape {sh(B, T - 2)}, expected {sh(B, T)}",
    ),
    (
        "value_returns_per_row",
        lambda: value_loss(X, X, X[:, 0], M),
        rf"value_loss: returns_BT has shape {sh(B)}, expected {sh(B, T)}",
    ),
    (
        "value_mask",
        lambda: value_loss(X, X, X, M[:, :-1]),
        rf"value_loss: loss_mask_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "kl_loss_ref",
        lambda: kl_loss(X, X[:, :-1], M),
        rf"kl_loss: ref_logp_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "kl_penalty_ref",
        lambda: kl_penalty(X, X[:1]),
        rf"kl_penalty: ref_logp_BT has shape {sh(1, T)}, expected {sh(B, T)}",
    ),
    (
        "apply_kl_penalty_kl",
        lambda: apply_kl_penalty(X, X[:, :-1], M, 0.1),
        rf"apply_kl_penalty: kl_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "apply_kl_penalty_mask",
        lambda: apply_kl_penalty(X, X, M[:, :1], 0.1),
        rf"apply_kl_penalty: loss_mask_BT has shape {sh(B, 1)}, expected {sh(B, T)}",
    ),
    (
        "entropy_loss_mask",
        lambda: entropy_loss(X, M[:, :-1]),
        rf"entropy_loss: loss_mask_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "aggregate_mask",
        lambda: aggregate(X, M[:, :-1]),
        rf"aggregate: loss_mask_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "aggregate_denominator",
        lambda: aggregate(X, M, denominator=jnp.ones((B, 1))),
        rf"aggregate: denominator has shape {sh(B, 1)}, expected a scalar",
    ),
    (
        "log_ratio_old",
        lambda: log_ratio(X, X[:, :-1], M, "sequence"),
        rf"log_ratio: old_logp_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "loss_denominator_1d",
        lambda: loss_denominator(M[0]),
        rf"loss_denominator: loss_mask_BT has shape {sh(T)}, expected \[B, T\]",
    ),
    (
        "masked_sum",
        lambda: masked_sum(X, M[:, :1]),
        rf"masked_sum: mask has shape {sh(B, 1)}, expected {sh(B, T)} \(the shape of x\)",
    ),
    (
        "masked_mean",
        lambda: masked_mean(X, M[0]),
        rf"masked_mean: mask has shape {sh(T)}, expected {sh(B, T)}",
    ),
    (
        "masked_var",
        lambda: masked_var(X, M[:-1]),
        rf"masked_var: mask has shape {sh(B - 1, T)}, expected {sh(B, T)}",
    ),
    (
        "masked_whiten",
        lambda: masked_whiten(X, M[:, :-1]),
        rf"masked_whiten: mask has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
]

LOGPROB_CASES = [
    (
        "logprobs_float_targets",
        lambda: target_logprobs(LOGITS, TARGETS.astype(np.float32), M),
        r"target_logprobs: targets_BT has dtype float32, expected an integer dtype \(token ids\)",
    ),
    (
        "logprobs_targets_short",
        lambda: target_logprobs(LOGITS, TARGETS[:, :-1], M),
        rf"target_logprobs: targets_BT has shape {sh(B, T - 1)}, expected {sh(B, T)} "
        r"\(the leading \[B, T\] of logits_BTV",
    ),
    (
        "logprobs_mask",
        lambda: target_logprobs(LOGITS, TARGETS, M[:, :1]),
        rf"target_logprobs: loss_mask_BT has shape {sh(B, 1)}, expected {sh(B, T)}",
    ),
    (
        "logprobs_2d_logits",
        lambda: target_logprobs(LOGITS[:, 0], TARGETS, M),
        rf"target_logprobs: logits_BTV has shape {sh(B, V)}, expected \[B, T, V\]",
    ),
    (
        "entropy_mask",
        lambda: token_entropy(LOGITS, M[:-1]),
        rf"token_entropy: loss_mask_BT has shape {sh(B - 1, T)}, expected {sh(B, T)}",
    ),
    (
        "chunked_float_targets",
        lambda: chunked_token_logprobs(H, W, TARGETS.astype(np.float32), M, chunk_size=4),
        r"chunked_token_logprobs_and_entropy: targets_BT has dtype float32, expected an integer",
    ),
    (
        "chunked_bool_targets",
        lambda: chunked_token_logprobs_and_entropy(H, W, TARGETS > 3, M, chunk_size=4),
        r"targets_BT has dtype bool, expected an integer dtype",
    ),
    (
        "chunked_mask",
        lambda: chunked_token_logprobs(H, W, TARGETS, M[:, :-1], chunk_size=4),
        rf"chunked_token_logprobs_and_entropy: loss_mask_BT has shape {sh(B, T - 1)}",
    ),
    (
        "chunked_W",
        lambda: chunked_token_logprobs(H, W[:-1], TARGETS, M, chunk_size=4),
        rf"W_DV has shape {sh(D - 1, V)}, expected \[D, V\] with D = {D}",
    ),
    (
        "chunked_h_2d",
        lambda: chunked_token_logprobs(H[:, 0], W, TARGETS, M, chunk_size=4),
        rf"h_BTD has shape {sh(B, D)}, expected \[B, T, D\]",
    ),
]


def adv_data():
    r = np.random.default_rng(1)
    return dict(
        loss_mask_BT=M,
        scores_B=r.normal(size=B).astype(np.float32),
        values_BT=X,
        baseline_B=r.normal(size=B).astype(np.float32),
        step_rewards_BS=r.normal(size=(B, S)).astype(np.float32),
        step_mask_BS=np.ones((B, S), np.float32),
        anchor_ids_BS=r.integers(0, 2, (B, S)).astype(np.int32),
        token_step_BT=np.sort(r.integers(0, S, (B, T)), axis=1).astype(np.int32),
    )


def adv(name, G=G, **override):
    d = dict(adv_data(), **override)
    return lambda: compute_advantages(name, AdvantageInputs(**d), AdvantageConfig(group_size=G))


def direct(name, **override):  # through the registry, without compute_advantages' own check
    d = dict(adv_data(), **override)
    return lambda: get_advantage_estimator(name)(
        AdvantageInputs(**d), AdvantageConfig(group_size=G)
    )


def est(name):
    return re.escape(f"advantage estimator '{name}': AdvantageInputs.")


ADV_CASES = [
    (
        "grpo_scores_BT",
        adv("grpo", scores_B=X),
        est("grpo") + rf"scores_B has shape {sh(B, T)}, expected {sh(B)} "
        rf"\(B, T from loss_mask_BT {sh(B, T)}\)",
    ),
    (
        "rloo_scores_T",
        direct("rloo", scores_B=X[0]),
        est("rloo") + rf"scores_B has shape {sh(T)}, expected {sh(B)}",
    ),
    (
        "remax_baseline_BT",
        adv("remax", baseline_B=X),
        est("remax") + rf"baseline_B has shape {sh(B, T)}, expected {sh(B)}",
    ),
    (
        "remax_baseline_T",
        direct("remax", baseline_B=X[0]),
        est("remax") + rf"baseline_B has shape {sh(T)}, expected {sh(B)}",
    ),
    (
        "gae_values_short",
        direct("gae", values_BT=X[:, :-1]),
        est("gae") + rf"values_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "vapo_values_per_row",
        adv("vapo", values_BT=X[:, 0]),
        est("vapo") + rf"values_BT has shape {sh(B)}, expected {sh(B, T)}",
    ),
    (
        "reinforce_pp_kl",
        direct("reinforce_pp", kl_BT=X[:, :1]),
        est("reinforce_pp") + rf"kl_BT has shape {sh(B, 1)}, expected {sh(B, T)}",
    ),
    (
        "reinforce_pp_token_rewards",
        adv("reinforce_pp", token_rewards_BT=X[:-1]),
        est("reinforce_pp") + rf"token_rewards_BT has shape {sh(B - 1, T)}, expected {sh(B, T)}",
    ),
    (
        "mask_1d",
        adv("grpo", loss_mask_BT=M[0]),
        est("grpo") + rf"loss_mask_BT has shape {sh(T)}, expected \[B, T\]",
    ),
    (
        "gigpo_float_anchor_ids",
        direct("gigpo", anchor_ids_BS=np.zeros((B, S), np.float32)),
        est("gigpo") + r"anchor_ids_BS has dtype float32, expected an integer dtype \(ids of",
    ),
    (
        "gigpo_float_token_step",
        adv("gigpo", token_step_BT=np.zeros((B, T), np.float32)),
        est("gigpo") + r"token_step_BT has dtype float32, expected an integer dtype \(step indices",
    ),
    (
        "gigpo_step_mask_S",
        direct("gigpo", step_mask_BS=np.ones((B, S + 1), np.float32)),
        est("gigpo") + rf"step_mask_BS has shape {sh(B, S + 1)}, expected {sh(B, S)} "
        r"\(B, T from loss_mask_BT .*, S from step_rewards_BS\)",
    ),
    (
        "gigpo_step_rewards_1d",
        adv("gigpo", step_rewards_BS=np.zeros(B, np.float32)),
        est("gigpo") + rf"step_rewards_BS has shape {sh(B)}, expected \[B, S\]",
    ),
    (
        "gigpo_anchor_rows",
        direct("gigpo", anchor_ids_BS=np.zeros((B - 1, S), np.int32)),
        est("gigpo") + rf"anchor_ids_BS has shape {sh(B - 1, S)}, expected {sh(B, S)}",
    ),
    *[
        (
            f"{n}_group_size",
            adv(n, G=4),
            re.escape(
                f"advantage estimator '{n}': batch size {B} is not a multiple of group_size 4"
            ),
        )
        for n in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "gigpo")
    ],
    (
        "discounted_returns_mask",
        lambda: discounted_returns(X, M[:, :-1], 0.9),
        rf"discounted_returns: loss_mask_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "last_token_onehot_1d",
        lambda: last_token_onehot(M[0]),
        rf"last_token_onehot: loss_mask_BT has shape {sh(T)}, expected \[B, T\]",
    ),
    (
        "gae_advantages_values",
        lambda: gae_advantages(X, X[:, :-1], M, 0.9, 0.9),
        rf"gae_advantages: values_BT has shape {sh(B, T - 1)}, expected {sh(B, T)}",
    ),
    (
        "gae_advantages_mask",
        lambda: gae_advantages(X, X, M[:1], 0.9, 0.9),
        rf"gae_advantages: loss_mask_BT has shape {sh(1, T)}, expected {sh(B, T)}",
    ),
    (
        "gae_advantages_lam_BT",
        lambda: gae_advantages(X, X, M, 0.9, jnp.ones((B, T))),
        rf"gae_advantages: lam has shape {sh(B, T)}, expected a scalar or \[B\]",
    ),
    (
        "gae_step_v",
        lambda: gae_step(0.9, 0.9, (X[:, 0], X[:, 0]), (X[:, 0], X[:-1, 0], M[:, 0])),
        rf"gae_step: v_B has shape {sh(B - 1)}, expected {sh(B)}",
    ),
]

CASES = LOSS_CASES + LOGPROB_CASES + ADV_CASES


@pytest.mark.parametrize("fn, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_eagerly_with_one_line_message(fn, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        fn()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fn, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_at_trace_time_under_jit(fn, pattern):
    with pytest.raises(ValueError, match=pattern):
        jax.jit(fn)()


FILTER_CASES = [
    (
        "flat_not_multiple",
        lambda: dynamic_sampling_filter(np.zeros(10), 4),
        r"dynamic_sampling_filter: rewards has shape \(10,\): batch size 10 is not a multiple of "
        r"group_size 4",
    ),
    (
        "grouped_wrong_G",
        lambda: starpo_s_filter(np.zeros((3, 4)), 2),
        r"starpo_s_filter: rewards has shape \(3, 4\), expected \[B\] with group_size or "
        r"\[num_groups, G\] with G = 2",
    ),
    (
        "rank_3",
        lambda: accuracy_band_filter(np.zeros((2, 2, 2))),
        r"accuracy_band_filter: rewards has shape \(2, 2, 2\), expected \[B\]",
    ),
    (
        "float_group_size",
        lambda: dynamic_sampling_filter(np.zeros(8), 4.0),
        r"dynamic_sampling_filter: group_size must be an int >= 1, got 4.0",
    ),
    (
        "zero_group_size",
        lambda: starpo_s_filter(np.zeros(8), 0),
        r"starpo_s_filter: group_size must be an int >= 1, got 0",
    ),
]


@pytest.mark.parametrize(
    "fn, pattern", [c[1:] for c in FILTER_CASES], ids=[c[0] for c in FILTER_CASES]
)
def test_filters_refuse(fn, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        fn()
    assert "\n" not in str(e.value)


def test_valid_inputs_still_pass_under_jit():
    """The checks read static shapes only: correct inputs trace and run under jit."""
    out = jax.jit(
        lambda: policy_loss(
            CFG, X, X, X, M, ref_logp_BT=X, entropy_BT=X, denominator=jnp.float32(7.0)
        )
    )()
    assert out.loss.shape == ()
    for name in ("grpo", "gigpo", "remax", "vapo"):
        a, r = jax.jit(adv(name))()
        assert a.shape == r.shape == (B, T)
    lp = jax.jit(lambda: chunked_token_logprobs(H, W, TARGETS, M, chunk_size=4))()
    np.testing.assert_allclose(lp, target_logprobs(H @ W, TARGETS, M), rtol=1e-5, atol=1e-5)
    # int64 / uint8 ids are integers too
    target_logprobs(LOGITS, TARGETS.astype(np.uint8), M)
