"""Sequence packing: the layout places every token once; the model, the losses, the RL update and
SFT on packed rows equal the same on padded rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import VOCAB, fixed_batch, tiny_model_config

from jaxrl_tools import algorithms, models, run
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.models import attention as A
from jaxrl_tools.train import sft
from jaxrl_tools.train.packing import plan_packing
from jaxrl_tools.types import Span, Trajectory

LENGTHS = [30, 3, 12, 0, 17, 5, 9, 25]  # row 3 is an all-padding row


def _padded(lengths, width, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), width), np.int32)
    attention = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(1, VOCAB, n)
        attention[r, :n] = 1
        positions[r, :n] = np.arange(n)
    return tokens, positions, attention


def test_layout_places_every_token_once_and_round_trips():
    width = 32
    lay = plan_packing(LENGTHS, width, multiple=2)
    tokens, positions, attention = _padded(LENGTHS, width)
    # First-fit decreasing: 30 | 25+5 | 17+12+3 | 9, rounded up to a multiple of 2.
    assert lay.packed_rows == 4
    np.testing.assert_array_equal((lay.segments_PT > 0).sum(1), [30, 30, 32, 9])
    assert lay.segments_PT.max(axis=1).tolist() == [1, 2, 3, 1]
    packed = lay.pack(tokens)
    assert sorted(packed[lay.segments_PT > 0].tolist()) == sorted(tokens[attention > 0].tolist())
    np.testing.assert_array_equal(lay.unpack(packed), tokens)  # padding comes back as 0
    # Positions restart at each segment's start.
    pos = lay.pack(positions)
    starts = np.flatnonzero(np.diff(lay.segments_PT[2], prepend=0) != 0)
    assert pos[2, starts].tolist() == [0, 0, 0]
    assert lay.fill_fraction == pytest.approx(sum(LENGTHS) / (4 * width))
    # The jax path (inside the trainer's jit) gives the same.
    np.testing.assert_array_equal(np.asarray(lay.pack(jnp.asarray(tokens))), packed)
    with pytest.raises(ValueError, match="row 0 has 30 tokens, more than width 16"):
        plan_packing(LENGTHS, 16)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_packed_forward_equals_each_sequence_alone(tiny, impl):
    cfg, params = tiny
    width = 32
    lay = plan_packing(LENGTHS, width, multiple=2)
    tokens, positions, attention = _padded(LENGTHS, width)
    fwd = jax.jit(models.forward, static_argnums=0, static_argnames=("attention", "packed"))
    alone = fwd(cfg, params, tokens, attention_mask=attention, positions=positions, attention=impl)
    packed = fwd(
        cfg,
        params,
        lay.pack(tokens),
        attention_mask=lay.segments_PT,
        positions=lay.pack(positions),
        attention=impl,
        packed=True,
    )
    back = np.stack([lay.unpack(np.asarray(packed[..., v])) for v in range(VOCAB)], -1)
    m = attention > 0
    np.testing.assert_allclose(back[m], np.asarray(alone)[m], atol=1e-5, rtol=1e-5)


def test_chunked_attention_with_segments_equals_dense_value_and_gradient():
    B, T, H, K, Dh = 2, 40, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, Dh)), jnp.float32) for n in (H, K, K))
    seg = np.zeros((B, T), np.int32)
    seg[0, :11], seg[0, 11:30], seg[0, 30:37] = 1, 2, 3
    seg[1, :25], seg[1, 25:40] = 1, 2
    seg = jnp.asarray(seg)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    w = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32) * (seg > 0)[..., None, None]

    def loss(impl, q, k, v):
        out = A.attention(q, k, v, pos, seg > 0, segment_ids_BT=seg, impl=impl, chunk=8)
        return jnp.sum(out * w), out

    (ld, od), gd = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("dense", q, k, v)
    (lc, oc), gc = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("chunked", q, k, v)
    m = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(oc)[m], np.asarray(od)[m], atol=1e-5)
    for a, b in zip(gc, gd, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # A token of segment 2 does not see segment 1: changing segment 1's keys leaves it alone.
    k2 = k.at[0, :11].add(1.0)
    out2 = A.attention(q, k2, v, pos, seg > 0, segment_ids_BT=seg, impl="dense")
    np.testing.assert_allclose(np.asarray(out2)[0, 11:37], np.asarray(od)[0, 11:37], atol=1e-6)
    with pytest.raises(ValueError, match="'cudnn' takes no packed rows"):
        A.attention(q, k, v, pos, seg > 0, segment_ids_BT=seg, impl="cudnn")


@pytest.mark.parametrize("mode", algorithms.LOSS_AGG_MODES)
@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_losses_on_packed_rows_equal_the_padded_ones(mode, ratio_type):
    width = 32
    lay = plan_packing(LENGTHS, width)
    rng = np.random.default_rng(1)
    R = len(LENGTHS)
    mask = np.zeros((R, width), np.float32)
    for r, n in enumerate(LENGTHS):
        mask[r, n // 3 : n] = rng.random(n - n // 3) < 0.8  # a prompt, then some masked tokens
    logp, old, ref, adv = (rng.normal(size=(R, width)).astype(np.float32) * 0.3 for _ in range(4))
    ent = rng.random((R, width)).astype(np.float32)
    cfg = algorithms.PolicyLossConfig(
        loss_agg_mode=mode, max_len=24, ratio_type=ratio_type, kl_coef=0.1, entropy_coef=0.01
    )

    def loss(x, seg=None):
        logp, old, ref, adv, mask, ent = x
        return algorithms.policy_loss(
            cfg, logp, old, adv, mask, ref_logp_BT=ref, entropy_BT=ent, segment_ids_BT=seg
        )

    padded = loss((logp, old, ref, adv, mask, ent))
    packed = loss([lay.pack(x) for x in (logp, old, ref, adv, mask, ent)], lay.segments_PT)
    np.testing.assert_allclose(float(packed.loss), float(padded.loss), rtol=1e-5, atol=1e-7)
    assert float(packed.denominator) == float(padded.denominator)


def _varied_trajectories(seed=0):
    """Two groups of four with responses of 2 to 21 tokens (the second group half correct)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(2):
        prompt = list(rng.integers(3, VOCAB, size=4 + 3 * g))
        for j, n in enumerate((21, 2, 9, 14) if g == 0 else (5, 18, 3, 11)):
            resp = list(rng.integers(3, VOCAB, size=n))
            mask = [1] * n
            if n > 4:
                mask[1] = mask[2] = 0  # an observation inside the response
            text = "\\boxed{7}" if (j + g) % 2 == 0 else "\\boxed{8}"
            spans = [Span("model", 0, n)]
            out.append(
                Trajectory(
                    g, j, prompt, resp, mask, [0.0] * n, spans, response_text=text, model_text=text
                )
            )
    return out


def _rl_config(pack, algorithm=None, **optim):
    return config_from_dict(
        {
            "tokenizer": {"path": "unused"},
            "data": {"batch_size": 2},
            "rollout": {"group_size": 4, "max_response_len": 24},
            "algorithm": {"kl_coef": 0.0, **(algorithm or {})},
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {
                "lr": 1e-2,
                "micro_batch_size": 2,
                "grad_clip": None,
                "weight_decay": 0.0,
                "pack": pack,
                **optim,
            },
            "critic": {"enabled": (algorithm or {}).get("adv_estimator") == "gae"},
            "trainer": {"steps": 4},
        }
    )


CASES = {
    # KL in the loss, VAPO's NLL, GSPO's sequence ratio, per-sequence means, two epochs
    "gspo-seq-mean-kl-nll": dict(
        policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", kl_coef=0.05, nll_coef=0.1
    ),
    # values and KL moved to the padded layout for GAE, a critic update on packed rows
    "ppo-critic-kl-in-reward": dict(adv_estimator="gae", kl_coef=0.05, kl_in_reward=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_update_equals_padded_update(case):
    trajs = _varied_trajectories()
    params = {}
    for pack in (False, True):
        cfg = _rl_config(pack, CASES[case], ppo_epochs=2)
        model_cfg = tiny_model_config()
        trainer = run.make_trainer(cfg, model_cfg, models.init_params(model_cfg, jax.random.key(0)))
        batch = fixed_batch(cfg, trainer.rows, trajs)
        metrics = trainer.step(batch)  # two epochs: two updates
        if pack:
            # 8 sequences of 6..25 tokens in rows of 32 fill 5 rows, rounded up to 6 (micro 2).
            assert metrics["packing/rows"] == 6.0
        params[pack] = trainer.params
        if trainer.critic_state is not None:
            params[pack] = (params[pack], trainer.critic_state.params)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-5),
        params[False],
        params[True],
    )


class _CharTokenizer:
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % (VOCAB - 3) for c in text]


def test_packed_sft_equals_padded_sft():
    rng = np.random.default_rng(0)
    words = ["ab", "hello there", "x", "a longer trace of text", "tool", "call(1)", "ok", "yes"]
    traces = [[[w, False], [words[(i * 3) % 8] * (1 + i % 3), True]] for i, w in enumerate(words)]
    rng.shuffle(traces)
    model_cfg = tiny_model_config()
    out = {}
    for pack in (False, True):
        out[pack] = sft.train_sft(
            model_cfg,
            models.init_params(model_cfg, jax.random.key(0)),
            _CharTokenizer(),
            traces,
            epochs=1,
            lr=1e-2,
            batch_size=4,
            max_len=128,
            micro_batch_size=2,
            pack=pack,
        )
    # 2 Adam steps at lr 1e-2: float32 rounding in near-zero gradients moves a weight by ~1e-4
    # at most; a real difference is a whole step (~1e-2).
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=2e-4)
    jax.tree.map(close, out[False], out[True])


def test_cudnn_with_packing_is_refused_by_the_config():
    cfg = {"tokenizer": {"path": "unused"}, "model": {"attention": "cudnn"}}
    config_from_dict(cfg)  # without packing, cuDNN is a choice
    for section in ("optim", "sft"):
        with pytest.raises(ValueError, match="model.attention.*'cudnn' takes no packed rows"):
            config_from_dict({**cfg, section: {"pack": True}})


def test_sft_stops_at_a_step_that_is_not_finite():
    # A weight that is inf makes the first step's loss NaN: SFT stops there, in one line,
    # instead of training on and returning NaN weights.
    traces = [[["question", False], ["answer", True]]] * 4
    model_cfg = tiny_model_config()
    params = models.init_params(model_cfg, jax.random.key(0))
    params["final_norm"]["scale"] = params["final_norm"]["scale"].at[0].set(jnp.inf)
    with pytest.raises(sft.NonFiniteSFT, match=r"^sft step 1: the update is not finite \(loss "):
        sft.train_sft(
            model_cfg, params, _CharTokenizer(), traces, epochs=2, lr=1e-2, batch_size=4, max_len=64
        )
