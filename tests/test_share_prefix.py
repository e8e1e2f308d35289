"""Shared prompts in the update (`optim.share_prefix`): each group's prompt laid out once before its
samples. The layout round-trips every token; log-probs, values, every loss and its gradient, and
whole RL steps equal the padded update's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import VOCAB, tiny_model_config
from test_packing import CASES, _rl_config, _varied_trajectories

from jaxrl_tools import algorithms, models, run
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.models import attention as A
from jaxrl_tools.train import objectives, policy
from jaxrl_tools.train.batch import make_batch
from jaxrl_tools.train.packing import plan_shared_packing, take_tokens
from jaxrl_tools.train.step import StepSettings
from jaxrl_tools.train.step_inputs import step_inputs

PROMPTS = (7, 4, 1)  # three groups of 4; the last prompt is 1 token: nothing to share
RESPONSES = ((9, 2, 14, 5), (11, 3, 6, 8), (4, 7, 2, 5))


def _groups(seed=0, width=40):
    """Rows of 3 groups x 4 samples, right-padded: a prompt per group, then responses (the
    first 2 response tokens of the longer ones an observation, not trained)."""
    rng = np.random.default_rng(seed)
    R = 12
    tokens, positions = np.zeros((R, width), np.int32), np.zeros((R, width), np.int32)
    attention, mask = np.zeros((R, width), np.int32), np.zeros((R, width), np.float32)
    for g, (p, lengths) in enumerate(zip(PROMPTS, RESPONSES)):
        prompt = rng.integers(1, VOCAB, p)
        for j, n in enumerate(lengths):
            r = 4 * g + j
            tokens[r, :p], tokens[r, p : p + n] = prompt, rng.integers(1, VOCAB, n)
            attention[r, : p + n], positions[r, : p + n] = 1, np.arange(p + n)
            mask[r, p : p + n] = 1.0
            if n > 6:
                mask[r, p + 2 : p + 4] = 0.0
    return tokens, positions, attention, mask


def test_each_prompt_is_laid_out_once_and_every_token_round_trips():
    tokens, positions, attention, mask = _groups()
    lay = plan_shared_packing(tokens, attention.sum(1), mask, multiple=2)
    # group 0: 6 + (1 + 9, 1 + 2, 1 + 14, 1 + 5) = 40 tokens; group 1: 3 + 4 x 1 + 28 = 35;
    # group 2 (a 1-token prompt) is 4 plain rows of 5, 8, 3, 6.
    real = lay.segments_PT > 0
    assert real.sum() == 40 + 35 + 5 + 8 + 3 + 6
    packed = lay.pack(tokens)
    np.testing.assert_array_equal(lay.unpack(packed), tokens)  # the prompts are the same
    np.testing.assert_array_equal(lay.unpack(lay.pack(positions)), positions)
    # A sample's tokens see the prompt's segment, which holds the prompt's first p - 1 tokens.
    pre = lay.prefix_PT
    for g, p in enumerate(PROMPTS[:2]):
        r = 4 * g + 1
        first = lay.dst_RT[r, p - 1]  # the sample's copy of the prompt's last token
        seg = lay.prefix_PT.flat[first]
        row = first // lay.width
        assert packed[row][lay.segments_PT[row] == seg].tolist() == tokens[r, : p - 1].tolist()
        assert lay.pack(positions).flat[first] == p - 1
    assert (pre[lay.segments_PT == 0] == 0).all()
    # The loss tokens are placed once each: nothing trained is shared.
    np.testing.assert_array_equal(lay.unpack(lay.pack(mask)), mask)
    assert lay.pack(mask).sum() == mask.sum()


def test_a_group_too_long_for_one_row_is_split_with_a_copy_of_its_prompt_each():
    tokens, _, attention, mask = _groups(width=24)
    lengths = attention[:4].sum(1)
    narrow = plan_shared_packing(tokens[:4], lengths, mask[:4])
    # 6 + 10 + 3 = 19, then 6 + 15 + 6 = 27 > 24: 6 + 15 = 21, then 6 + 6 = 12
    np.testing.assert_array_equal((narrow.segments_PT > 0).sum(1), [21, 19, 12])
    np.testing.assert_array_equal(narrow.unpack(narrow.pack(tokens[:4])), tokens[:4])
    wide = plan_shared_packing(tokens[:4], lengths, mask[:4], width=40)  # 6 + 34: one row
    assert (wide.packed_rows, wide.width, wide.padded_width) == (1, 40, 24)
    np.testing.assert_array_equal(wide.unpack(wide.pack(tokens[:4])), tokens[:4])
    assert wide.pack_rows(np.arange(4)).shape == (1, 40)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_model_config()
    return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_logprobs_entropies_and_values_equal_the_padded_ones(tiny, impl):
    cfg, params = tiny
    tokens, positions, attention, mask = _groups()
    lay = plan_shared_packing(tokens, attention.sum(1), mask)
    kw = dict(attention=impl)
    logp, ent = policy.token_logprobs(cfg, params, tokens, positions, attention, mask, **kw)
    s_logp, s_ent = policy.token_logprobs(
        cfg, params, lay.pack(tokens), lay.pack(positions), lay.segments_PT, lay.pack(mask),
        packed=True, prefix_ids=lay.prefix_PT, **kw,
    )  # fmt: skip
    m = mask > 0
    for shared, padded in ((s_logp, logp), (s_ent, ent)):
        back = lay.unpack(np.asarray(shared))
        np.testing.assert_allclose(back[m], np.asarray(padded)[m], atol=1e-5, rtol=1e-5)
    critic = policy.init_value_head(cfg, params)
    critic["value_head"]["kernel"] = jnp.asarray(np.random.default_rng(0).normal(size=32))
    v = policy.token_values(cfg, critic, tokens, positions, attention, attention=impl)
    s_v = policy.token_values(
        cfg, critic, lay.pack(tokens), lay.pack(positions), lay.segments_PT, attention=impl,
        packed=True, prefix_ids=lay.prefix_PT,
    )  # fmt: skip
    np.testing.assert_allclose(lay.unpack(np.asarray(s_v))[m], np.asarray(v)[m], atol=1e-5)


def test_chunked_attention_with_prefixes_equals_dense_and_sees_only_its_prompt():
    B, T, H, K, Dh = 1, 40, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, Dh)), jnp.float32) for n in (H, K, K))
    seg, pre = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    seg[0, :9], seg[0, 9:20], seg[0, 20:33], seg[0, 33:38] = 1, 2, 3, 4  # prompt, 2 samples, row
    pre[0, 9:33] = 1
    seg, pre, pos = jnp.asarray(seg), jnp.asarray(pre), jnp.broadcast_to(jnp.arange(T), (B, T))
    w = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32) * (seg > 0)[..., None, None]

    def loss(impl, q, k, v):
        out = A.attention(
            q, k, v, pos, seg > 0, segment_ids_BT=seg, prefix_ids_BT=pre, impl=impl, chunk=8
        )
        return jnp.sum(out * w), out

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, od), gd = grad("dense", q, k, v)
    (_, oc), gc = grad("chunked", q, k, v)
    m = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(oc)[m], np.asarray(od)[m], atol=1e-5)
    for a, b in zip(gc, gd, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

    def out_with(k):
        return np.asarray(
            A.attention(q, k, v, pos, seg > 0, segment_ids_BT=seg, prefix_ids_BT=pre)
        )[0]

    base = out_with(k)
    sample_one = out_with(k.at[0, 9:20].add(1.0))  # the first sample's keys changed
    np.testing.assert_allclose(sample_one[20:], base[20:], atol=1e-6)  # not seen by the others
    prompt = out_with(k.at[0, :9].add(1.0))  # the prompt's keys changed: both samples see it
    assert not np.allclose(prompt[9:20], base[9:20]) and not np.allclose(prompt[20:33], base[20:33])
    np.testing.assert_allclose(prompt[33:], base[33:], atol=1e-6)  # the plain row does not
    for impl in ("cudnn", "pallas"):
        with pytest.raises(ValueError, match=f"'{impl}' takes no shared prompt prefixes"):
            A.attention(q, k, v, pos, seg > 0, segment_ids_BT=seg, prefix_ids_BT=pre, impl=impl)


LOSSES = {
    **{f"grpo-{mode}": dict(loss_agg_mode=mode) for mode in algorithms.LOSS_AGG_MODES},
    "gspo-kl-in-loss-nll": dict(policy_loss="gspo", kl_coef=0.05, nll_coef=0.1),
}


def _actor_loss_and_grad(model_cfg, params, algorithm: dict, share: bool):
    """The actor loss, and its gradient, of the step's own inputs for two groups of 4."""
    trajs = _varied_trajectories()
    records = [{"prompt": "q", "ground_truth": "7"}] * 2
    cfg = _rl_config(False, algorithm, share_prefix=share)
    settings = StepSettings(model_cfg, cfg.algorithm, cfg.optim, cfg.critic, group_size=4)
    batch = make_batch(
        records, trajs, run.make_reward(cfg), cfg.algorithm.filters, group_size=4, rows=8, pad_id=0
    )
    inputs, _ = step_inputs(batch, settings)
    rows = dict(inputs["rows"])
    noise = np.random.default_rng(3).normal(size=(3, *batch.tokens_RT.shape)).astype(np.float32)
    src = inputs["layout"]["src_PT"] if share else None
    to_rows = (lambda x: take_tokens(x, src)) if share else np.asarray  # noqa: E731
    rows["advantages"] = to_rows(noise[0])
    rows["old_logp"] = to_rows(noise[1] * 0.1 - 2.0)
    rows["ref_logp"] = to_rows(noise[2] * 0.1 - 2.0)
    pcfg, packed = settings.policy_loss, settings.pack
    denom = objectives.actor_denominator(pcfg, {k: v[None] for k, v in rows.items()}, packed)
    loss = functools.partial(
        objectives.actor_loss, model_cfg, pcfg, 1.0, False, cfg.algorithm.nll_coef, packed=packed
    )
    return jax.value_and_grad(lambda p: loss(p, rows, denom)[0])(params)


@pytest.mark.parametrize("case", list(LOSSES))
def test_loss_and_every_gradient_equal_the_padded_ones(tiny, case):
    """The actor loss of the step's own inputs, shared against padded, from the same state."""
    model_cfg, params = tiny
    (padded, g_padded), (shared, g_shared) = (
        _actor_loss_and_grad(model_cfg, params, LOSSES[case], share) for share in (False, True)
    )
    np.testing.assert_allclose(float(shared), float(padded), rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), g_padded, g_shared
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_shared_prefix_update_equals_the_padded_update(case):
    trajs = _varied_trajectories()
    records = [{"prompt": "q", "ground_truth": "7"}] * 2
    params, metrics = {}, {}
    wide = _rl_config(False).rollout
    wide = wide.max_prompt_len + wide.max_response_len  # optim.pack_width's least
    for layout, optim in (
        ("padded", {}),
        ("shared", {"share_prefix": True}),
        ("shared, wide rows", {"share_prefix": True, "pack_width": wide}),
    ):
        cfg = _rl_config(False, CASES[case], ppo_epochs=2, **optim)
        model_cfg = tiny_model_config()
        trainer = run.make_trainer(cfg, model_cfg, models.init_params(model_cfg, jax.random.key(0)))
        batch = make_batch(
            records, trajs, run.make_reward(cfg), cfg.algorithm.filters, group_size=4,
            rows=trainer.rows, pad_id=0,
        )  # fmt: skip
        metrics[layout] = trainer.step(batch)
        params[layout] = trainer.params
        if trainer.critic_state is not None:
            params[layout] = (params[layout], trainer.critic_state.params)
    # Two groups of 4, prompts of 4 and 7 tokens, 127 tokens in all. Neither group fits a row
    # of 32 with its prompt once, so each is split in two, with a copy each: 2 x 3 + 2 x 6 saved;
    # in wide rows each prompt is laid out once: 3 x 3 + 3 x 6.
    assert metrics["shared"]["packing/shared_frac"] == pytest.approx((2 * 3 + 2 * 6) / 127)
    assert metrics["shared, wide rows"]["packing/shared_frac"] == pytest.approx(27 / 127)
    # Two Adam updates at lr 1e-2 (shared rows on the chunked path, padded ones dense): float32
    # rounding in a near-zero gradient moves one weight in thousands by ~1e-5, as with packing;
    # a wrong mask moves most by ~1e-2.
    for layout in ("shared", "shared, wide rows"):
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-5),
            params["padded"],
            params[layout],
        )


def test_share_prefix_with_a_kernel_that_cannot_take_it_or_a_row_too_narrow_is_refused():
    cfg = {"tokenizer": {"path": "unused"}, "optim": {"share_prefix": True}}
    config_from_dict(cfg)
    for impl in ("cudnn", "pallas"):
        with pytest.raises(ValueError, match=f"model.attention.*'{impl}'"):
            config_from_dict({**cfg, "model": {"attention": impl}})
    rollout = {"max_prompt_len": 64, "max_response_len": 64}
    config_from_dict(
        {**cfg, "rollout": rollout, "optim": {"share_prefix": True, "pack_width": 128}}
    )
    with pytest.raises(ValueError, match="optim.pack_width.*at least .* = 128"):
        config_from_dict({**cfg, "rollout": rollout, "optim": {"pack": True, "pack_width": 100}})
    with pytest.raises(ValueError, match="optim.pack_width.*set optim.pack or optim.share_prefix"):
        config_from_dict({**cfg, "rollout": rollout, "optim": {"pack_width": 128}})
