"""Shared prompts in the update (`optim.share_prefix`): each group's prompt laid out once before its
samples. The layout round-trips every token; log-probs, values, every loss and its gradient, and
whole RL steps equal the padded update's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import VOCAB, fixed_batch, tiny_model_config
from test_packing import CASES, _rl_config, _varied_trajectories

from jaxrl_tools import algorithms, models, run
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.models import attention as A
from jaxrl_tools.train import objectives, policy
from jaxrl_tools.train.packing import plan_packing, plan_shared_packing, slot_width, take_tokens
from jaxrl_tools.train.step import StepSettings
from jaxrl_tools.train.step_inputs import shared_slots, step_inputs

PROMPTS = (23, 20, 1)  # three groups of 4; the last prompt is 1 token: nothing to share
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


def test_each_prompt_is_laid_out_once_in_its_slot_and_every_token_round_trips():
    tokens, positions, attention, mask = _groups()
    lay = plan_shared_packing(tokens, attention.sum(1), mask, width=120, multiple=2)
    # Prompt slot: the longest shared context, 23 - 1 tokens. Sample slots: the longest sample
    # from its context's last token, 1 + 14 tokens; the 4 samples of a prompt a row.
    assert lay.slots == (22, 4, 15) and lay.width == 82
    # Group 2's 1-token prompt shares nothing: its whole rows (5, 8, 3, 6 tokens) fill a
    # third row's sample slots, which see no prompt. Rounded up to 2 mini-batches: 4 rows.
    assert lay.packed_rows == 4
    np.testing.assert_array_equal(
        lay.prompt_keys_PNS.sum(-1), [[22] * 4, [19] * 4, [0] * 4, [0] * 4]
    )
    placed = sum(p - 1 + sum(1 + n for n in ns) for p, ns in zip(PROMPTS[:2], RESPONSES))
    assert (lay.segments_PT > 0).sum() == placed + sum(1 + n for n in RESPONSES[2])
    packed = lay.pack(tokens)
    np.testing.assert_array_equal(lay.unpack(packed), tokens)  # the prompts are the same
    np.testing.assert_array_equal(lay.unpack(lay.pack(positions)), positions)
    for g, p in enumerate(PROMPTS[:2]):
        assert packed[g, : p - 1].tolist() == tokens[4 * g, : p - 1].tolist()
        for j in range(4):  # each sample's slot starts at its copy of the prompt's last token
            r, at = 4 * g + j, 22 + 15 * j
            assert lay.dst_RT[r, p - 1] == g * lay.width + at
            assert lay.pack(positions)[g, at] == p - 1
            assert lay.segments_PT[g, at] == j + 2
    # The loss tokens are placed once each: nothing trained is shared.
    np.testing.assert_array_equal(lay.unpack(lay.pack(mask)), mask)
    assert lay.pack(mask).sum() == mask.sum()


def test_a_group_is_split_to_fit_the_width_and_sharing_that_saves_nothing_is_plain_packing():
    tokens, _, attention, mask = _groups()
    lengths = attention[:8].sum(1)
    split = plan_shared_packing(tokens[:8], lengths, mask[:8], width=52)  # 22 + 2 x 15 a row
    assert split.slots == (22, 2, 15) and split.packed_rows == 4
    keys = [[22, 22], [22, 22], [19, 19], [19, 19]]
    np.testing.assert_array_equal(split.prompt_keys_PNS.sum(-1), keys)
    np.testing.assert_array_equal(split.unpack(split.pack(tokens[:8])), tokens[:8])
    # Rows of 40 hold one sample slot: no sharing, the plain packing of `plan_packing`.
    narrow = plan_shared_packing(tokens[:8], lengths, mask[:8], width=40)
    assert narrow.slots is None and narrow.prompt_keys_PNS is None
    np.testing.assert_array_equal(narrow.segments_PT, plan_packing(lengths, 40).segments_PT)
    # Nothing shared (every prompt of its own): plain packing too.
    alone = plan_shared_packing(tokens[::4], attention[::4].sum(1), mask[::4], width=120)
    assert alone.slots is None
    assert slot_width(15) == 15 and slot_width(33) == 34 and slot_width(257) == 272


def test_a_later_batch_that_fits_the_slots_so_far_keeps_their_shapes():
    """The trainer passes the widest slots so far (`shared_slots`): a batch of shorter prompts
    and samples is laid out in them, so its step's shapes are the compiled ones."""
    tokens, _, attention, mask = _groups()
    first = plan_shared_packing(tokens, attention.sum(1), mask, width=120, multiple=2)
    short = tokens * (np.arange(40) < 33)  # every row cut to 33 tokens
    lengths, cut = np.minimum(attention.sum(1), 33), mask * (np.arange(40) < 33)
    alone = plan_shared_packing(short, lengths, cut, width=120, multiple=2)
    assert alone.slots == (22, 4, 12)  # its own longest sample: 1 + 11 tokens (prompt 20)
    later = plan_shared_packing(short, lengths, cut, width=120, multiple=2, least=(22, 15))
    assert later.slots == first.slots and later.width == first.width
    np.testing.assert_array_equal(later.unpack(later.pack(short)), short)
    rows = {"prompt_keys": later.prompt_keys_PNS, "tokens": later.pack(short)}
    assert shared_slots({"rows": rows}) == (24, 16)  # rounded up: 4 widths per doubling
    assert shared_slots({"rows": rows}, (30, 9)) == (30, 16)
    assert shared_slots({"rows": {"tokens": short}}, (22, 15)) == (22, 15)  # plain: unchanged


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_logprobs_entropies_and_values_equal_the_padded_ones(tiny, impl):
    cfg, params = tiny
    tokens, positions, attention, mask = _groups()
    lay = plan_shared_packing(tokens, attention.sum(1), mask, width=120)
    assert lay.slots is not None
    kw = dict(attention=impl)
    logp, ent = policy.token_logprobs(cfg, params, tokens, positions, attention, mask, **kw)
    s_logp, s_ent = policy.token_logprobs(
        cfg, params, lay.pack(tokens), lay.pack(positions), lay.segments_PT, lay.pack(mask),
        packed=True, prompt_keys=lay.prompt_keys_PNS, **kw,
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
        packed=True, prompt_keys=lay.prompt_keys_PNS,
    )  # fmt: skip
    np.testing.assert_allclose(lay.unpack(np.asarray(s_v))[m], np.asarray(v)[m], atol=1e-5)


def _reference_attention(q, k, v, valid, keys, S, L):
    """Masked softmax attention over the whole row, the mask written out token by token: the
    prompt slot causal, sample slot j causal within itself and over the prompt keys keys[j]."""
    T, H, K = q.shape[1], q.shape[2], k.shape[2]
    slot = np.where(np.arange(T) < S, -1, (np.arange(T) - S) // L)
    ok = np.zeros((q.shape[0], T, T), bool)
    for t in range(T):
        for s in range(t + 1):
            ok[:, t, s] = valid[:, s] & (slot[s] == slot[t])
            if slot[t] >= 0 and slot[s] < 0:
                ok[:, t, s] = keys[:, slot[t], s]
    k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    probs = jax.nn.softmax(jnp.where(ok[:, None], scores, -1e30), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v), ok


@pytest.mark.parametrize("impl", ["dense", "chunked", "auto", "rows-dense", "rows-chunked"])
def test_shared_prompt_attention_equals_the_mask_written_out_and_samples_see_only_the_prompt(impl):
    """rows-*: the samples' attention as a GPU or TPU runs it (each sample gathered into a
    right-padded row of its own, for the kernel), here through the dense and chunked paths."""
    B, S, N, L, H, K, Dh = 2, 9, 3, 7, 4, 2, 8
    T = S + N * L
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, Dh)), jnp.float32) for n in (H, K, K))
    valid = np.zeros((B, T), bool)
    valid[0, :6], valid[1, :9] = True, True  # prompts of 6 and 9 tokens
    for b, lengths in enumerate(((7, 3, 0), (5, 7, 2))):  # a sample of 0 tokens: an empty slot
        for j, n in enumerate(lengths):
            valid[b, S + j * L : S + j * L + n] = True
    keys = np.zeros((B, N, S), bool)
    keys[0, :2, :6], keys[1, :, :9] = True, True
    keys[1, 2] = False  # row 1's last sample is a whole row: it sees no prompt
    w = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32) * valid[..., None, None]
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(attend, q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * w), out

    def shared(q, k, v):
        if impl.startswith("rows-"):
            out = A.attention(q, k, v, pos, valid, prompt_keys_BNS=keys, impl="dense")
            rows = A._samples_as_rows(q, k, v, valid, keys, impl[5:], 4)
            return jnp.concatenate([out[:, :S], rows], axis=1)
        return A.attention(
            q, k, v, pos, valid, segment_ids_BT=jnp.asarray(valid, jnp.int32),
            prompt_keys_BNS=keys, impl=impl, chunk=4,
        )  # fmt: skip

    written = lambda q, k, v: _reference_attention(q, k, v, valid, keys, S, L)[0]  # noqa: E731
    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, out), g = grad(shared, q, k, v)
    (_, ref), g_ref = grad(written, q, k, v)
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

    base = np.asarray(shared(q, k, v))
    first = slice(S, S + L)
    changed = np.asarray(shared(q, k.at[:, first].add(1.0), v))  # the first sample's keys
    np.testing.assert_allclose(changed[:, S + L :], base[:, S + L :], atol=1e-6)  # others: same
    prompt = np.asarray(shared(q, k.at[:, :S].add(1.0), v))  # the prompt's keys: every sample
    for j in range(N):  # ... that sees it
        at = slice(S + j * L, S + j * L + 2)
        assert np.allclose(prompt[1, at], base[1, at]) == (j == 2)
    with pytest.raises(ValueError, match="not a prompt slot of 9 and 3 equal slots"):
        A.attention(
            q[:, :-1], k[:, :-1], v[:, :-1], pos[:, :-1], valid[:, :-1], prompt_keys_BNS=keys
        )


# optim.pack_width's least: the rollout's longest row (a group of _varied_trajectories takes
# 6 + 4 x 22 tokens in slots)
WIDE = _rl_config(False).rollout.max_prompt_len + _rl_config(False).rollout.max_response_len
LOSSES = {
    **{f"grpo-{mode}": dict(loss_agg_mode=mode) for mode in algorithms.LOSS_AGG_MODES},
    "gspo-kl-in-loss-nll": dict(policy_loss="gspo", kl_coef=0.05, nll_coef=0.1),
}


def _actor_loss_and_grad(model_cfg, params, algorithm: dict, share: bool):
    """The actor loss, and its gradient, of the step's own inputs for two groups of 4."""
    trajs = _varied_trajectories()
    cfg = _rl_config(False, algorithm, share_prefix=share, pack_width=WIDE if share else None)
    settings = StepSettings(model_cfg, cfg.algorithm, cfg.optim, cfg.critic, group_size=4)
    batch = fixed_batch(cfg, 8, trajs)
    inputs, _ = step_inputs(batch, settings)
    rows = dict(inputs["rows"])
    assert ("prompt_keys" in rows) == share  # each group's prompt once, in its slot
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
    params, metrics = {}, {}
    for layout, optim in (
        ("padded", {}),
        ("shared", {"share_prefix": True}),
        ("shared, wide rows", {"share_prefix": True, "pack_width": WIDE}),
    ):
        cfg = _rl_config(False, CASES[case], ppo_epochs=2, **optim)
        model_cfg = tiny_model_config()
        trainer = run.make_trainer(cfg, model_cfg, models.init_params(model_cfg, jax.random.key(0)))
        batch = fixed_batch(cfg, trainer.rows, trajs)
        metrics[layout] = trainer.step(batch)
        params[layout] = trainer.params
        if trainer.critic_state is not None:
            params[layout] = (params[layout], trainer.critic_state.params)
    # Two groups of 4, prompts of 4 and 7 tokens, 127 tokens in all. In rows of the padded
    # width (32) no group fits with its prompt once: plain packing, nothing shared. In wide rows
    # each prompt is laid out once: 3 x 3 + 3 x 6 tokens saved.
    assert metrics["shared"]["packing/shared_frac"] == 0.0
    assert metrics["shared, wide rows"]["packing/shared_frac"] == pytest.approx(27 / 127)

    # Two Adam updates at lr 1e-2: every weight but one in a thousand (or one) within 1e-6.
    # Adam divides a near-zero gradient by its own size, float32 rounding and all, so that one
    # moves up to ~1e-5; a wrong mask moves most by ~1e-2.
    def same(x, y):
        off = np.abs(np.asarray(x) - np.asarray(y))
        beyond = int(np.sum(off > 1e-6))
        assert off.max() < 5e-5 and beyond <= max(1, off.size // 1000), (off.max(), beyond)

    for layout in ("shared", "shared, wide rows"):
        jax.tree.map(same, params["padded"], params[layout])


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
