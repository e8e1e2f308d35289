"""LoRA (models/lora.py, models/peft_io.py, the trainer's adapter mode): parity with the base,
with the dense gradient, with merged-weight decoding, and with `peft` on transformers."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from fakes import VOCAB, fixed_batch, fixed_trajectories, tiny_model_config

from jaxrl_tools import algorithms, models, run
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict, load_config
from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.models import peft_io
from jaxrl_tools.sharding import logical_to_spec
from jaxrl_tools.train import objectives
from jaxrl_tools.train.batch import pad_trajectories
from jaxrl_tools.train.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = models.LoraConfig(rank=4, alpha=8.0)  # all seven projections, scale 2
FWD = jax.jit(models.forward, static_argnums=0)
CACHED = jax.jit(models.forward_cached, static_argnums=0)


def _nonzero_adapters(config, lora, seed=1, b_std=0.05):
    """Fresh adapters with B drawn at random (a trained adapter): B = 0 would hide any bug."""
    ad = models.init_lora(config, lora, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: b_std * jax.random.normal(next(keys), x.shape) if p[-1].key == "lora_b" else x,
        ad,
    )


def _ids(B=3, T=12, seed=0, vocab=VOCAB):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (B, T)), jnp.int32)


# ------------------------------------------------------------------------------ the model


def test_zero_b_gives_exactly_the_base_logits(tiny):
    config, params = tiny
    ad = models.init_lora(config, LORA, jax.random.key(1))
    assert all(np.any(np.asarray(v["lora_a"])) for v in _targets(ad))  # A random, B zero
    view = models.with_lora(params, ad, LORA)
    ids = _ids()
    np.testing.assert_array_equal(FWD(config, params, ids), FWD(config, view, ids))
    cache = models.init_cache(config, 3, 16)
    pos = jnp.broadcast_to(jnp.arange(12), (3, 12))
    base, _ = CACHED(config, params, ids, pos, cache)
    adapted, _ = CACHED(config, view, ids, pos, cache)
    np.testing.assert_array_equal(base, adapted)


def _targets(adapters):
    return [models.lora.get_path(adapters, models.LORA_TARGETS[t][0]) for t in models.LORA_TARGETS]


def test_adapter_shapes_and_logical_axes_follow_the_base_kernels(tiny):
    config, params = tiny
    ad = models.init_lora(config, LORA, jax.random.key(1))
    axes, base_axes = models.lora_logical_axes(LORA), models.logical_axes(config)
    for name, (path, ins, _) in models.LORA_TARGETS.items():
        kernel = models.lora.get_path(params, path)["kernel"]
        a, b = (models.lora.get_path(ad, path)[k] for k in ("lora_a", "lora_b"))
        n_in = len(ins)
        assert a.shape == (*kernel.shape[: 1 + n_in], 4) and b.shape == (
            kernel.shape[0],
            4,
            *kernel.shape[1 + n_in :],
        ), name
        kernel_axes = models.lora.get_path(base_axes, path)["kernel"]
        a_axes, b_axes = models.lora.get_path(axes, path).values()
        assert a_axes == (*kernel_axes[: 1 + n_in], "lora_rank")
        assert b_axes == (kernel_axes[0], "lora_rank", *kernel_axes[1 + n_in :])
        # Sharded by the same rules table as their kernel: A by its input axes, B by its output
        # axes, the rank replicated.
        spec = tuple(logical_to_spec(kernel_axes))
        assert tuple(logical_to_spec(a_axes)) == (*spec[: 1 + n_in], None)
        assert tuple(logical_to_spec(b_axes)) == (spec[0], None, *spec[1 + n_in :])


def test_merged_weights_equal_the_adapters_applied(tiny):
    config, params = tiny
    ad = _nonzero_adapters(config, LORA)
    ids = _ids()
    applied = FWD(config, models.with_lora(params, ad, LORA), ids)
    merged = FWD(config, models.merge(params, ad, LORA), ids)
    base = FWD(config, params, ids)
    assert float(jnp.abs(applied - base).max()) > 1e-2  # the adapters do something
    np.testing.assert_allclose(applied, merged, atol=2e-5, rtol=0)


def _grpo_micro_batch():
    """A packed GRPO micro-batch of the fixed trajectories, with group-normalised advantages."""
    trajs = fixed_trajectories()
    b = {k: jnp.asarray(v) for k, v in pad_trajectories(trajs, pad_id=0, rows=8).items()}
    scores = jnp.asarray([1.0, 1, 0, 0, 1, 0, 0, 0])
    adv, _ = algorithms.compute_advantages(
        "grpo",
        algorithms.AdvantageInputs(loss_mask_BT=b["loss_mask"], scores_B=scores),
        config=algorithms.AdvantageConfig(group_size=4),
    )
    b.update(advantages=adv, correct=scores)
    return b


def _chain_rule(gw, a, b, n_in, s):
    """(dL/dA, dL/dB) from dL/dW' per layer: gw [*in, *out], A [*in, r], B [r, *out]."""
    out_g = tuple(range(n_in, gw.ndim - 1))
    ins = tuple(range(n_in))

    def layer(g, aa, bb):
        da = jnp.tensordot(g, bb, (out_g, tuple(range(1, bb.ndim))))
        db = jnp.tensordot(aa, g, (ins, ins))
        return s * da, s * db

    return jax.vmap(layer)(gw, a, b)


def test_lora_grpo_gradient_is_the_dense_gradient_chained_to_a_and_b(tiny):
    """dL/dA = s * dL/dW' . B^T and dL/dB = s * A^T . dL/dW' with W' = W + s * A @ B."""
    config, params = tiny
    cfg = config_from_dict({"tokenizer": {"path": "unused"}, "algorithm": {"kl_coef": 0.0}})
    pcfg = objectives.policy_loss_config(cfg.algorithm, 16)
    mb = _grpo_micro_batch()
    denom = objectives.actor_denominator(pcfg, jax.tree.map(lambda x: x[None], mb))
    loss = functools.partial(objectives.actor_loss, config, pcfg, 1.0, False, 0.0)
    ad = _nonzero_adapters(config, LORA)

    g_lora = jax.jit(jax.grad(lambda a: loss(models.with_lora(params, a, LORA), mb, denom)[0]))(ad)
    merged = models.merge(params, ad, LORA)
    g_dense = jax.jit(jax.grad(lambda p: loss(p, mb, denom)[0]))(merged)
    s = LORA.scale
    for name, (path, ins, _) in models.LORA_TARGETS.items():
        a, b = (models.lora.get_path(ad, path)[k] for k in ("lora_a", "lora_b"))
        gw = models.lora.get_path(g_dense, path)["kernel"]  # [L, *in, *out]
        want_a, want_b = _chain_rule(gw, a, b, len(ins), s)
        got = models.lora.get_path(g_lora, path)
        scale_a = float(jnp.abs(want_a).max())
        scale_b = float(jnp.abs(want_b).max())
        assert scale_a > 0 and scale_b > 0, name
        np.testing.assert_allclose(got["lora_a"], want_a, atol=1e-4 * scale_a, err_msg=name)
        np.testing.assert_allclose(got["lora_b"], want_b, atol=1e-4 * scale_b, err_msg=name)


# ------------------------------------------------------------------------------ the trainer


def _lora_run_config(**lora):
    return config_from_dict(
        {
            "model": {"lora": {"enabled": True, "rank": 4, "alpha": 8.0, **lora}},
            "tokenizer": {"path": "unused"},
            "data": {"batch_size": 2},
            "rollout": {"group_size": 4, "max_response_len": 16},
            "algorithm": {"kl_coef": 0.01},  # the reference policy is the base
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {"lr": 1e-2, "micro_batch_size": 4, "grad_clip": None},
            "trainer": {"steps": 10},
        }
    )


def _trainer_and_batch(cfg, params):
    config = tiny_model_config()
    trainer = run.make_trainer(cfg, config, params)
    batch = fixed_batch(cfg, trainer.rows)
    return trainer, batch


def test_a_trainer_step_changes_only_the_adapters(tiny):
    config, params = tiny
    base_host = jax.tree.map(np.array, params)
    trainer, batch = _trainer_and_batch(_lora_run_config(), params)
    assert trainer.ref_params is trainer.base  # no second copy of the weights
    adapters0 = jax.tree.map(np.array, trainer.state.params)
    # The optimizer state holds adapter-sized moments only.
    biggest_adapter = max(x.size for x in jax.tree.leaves(adapters0))
    assert max(x.size for x in jax.tree.leaves(trainer.state.opt_state)) <= biggest_adapter
    assert np.asarray(trainer.params["layers"]["attn"]["q_proj"]["kernel"]).shape == (
        base_host["layers"]["attn"]["q_proj"]["kernel"].shape
    )

    metrics = trainer.step(batch)
    assert metrics["lora/merged_decode"] == 1.0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.base), base_host)
    for a0, a1 in zip(jax.tree.leaves(adapters0), jax.tree.leaves(trainer.state.params)):
        assert np.abs(np.asarray(a1) - a0).max() > 0  # every A and every B moved
    # The engine's weights: base + scale * A @ B, merged once per update.
    merged = trainer.params
    assert trainer.params is merged
    want = models.merge(trainer.base, trainer.state.params, trainer.lora)
    jax.tree.map(np.testing.assert_allclose, jax.tree.map(np.asarray, merged), want)
    # Checkpoints hold the adapters (and optimizer), not the frozen base nor a reference copy.
    assert set(trainer.checkpoint_state()) == {"actor", "step", "rng"}
    trainer.step(batch)
    assert trainer.params is not merged


def test_adapter_dropout_is_on_in_the_loss_only(tiny):
    config, params = tiny
    ad = _nonzero_adapters(config, LORA)
    drop = models.LoraConfig(rank=4, alpha=8.0, dropout=0.5)
    ids = _ids()
    plain = FWD(config, models.with_lora(params, ad, drop), ids)  # no key: no dropout
    np.testing.assert_array_equal(plain, FWD(config, models.with_lora(params, ad, LORA), ids))
    noisy = FWD(config, models.with_lora(params, ad, drop, jax.random.key(7)), ids)
    assert float(jnp.abs(noisy - plain).max()) > 1e-3


def test_adapter_decode_mode_and_dropout_in_the_trainer(tiny):
    config, params = tiny
    cfg = _lora_run_config(decode="adapters", dropout=0.5)
    trainer, batch = _trainer_and_batch(cfg, params)
    before = jax.tree.map(np.array, trainer.state.params)
    assert trainer.step(batch)["lora/merged_decode"] == 0.0
    assert any(
        np.abs(np.asarray(b) - a).max() > 0
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.state.params))
    )
    view = trainer.params  # the engine runs the base with the adapters, without dropout
    assert isinstance(view, models.LoraParams) and view.base is trainer.base
    assert view.adapters is trainer.state.params and view.dropout_key is None


def test_a_resumed_lora_run_gets_its_adapters_and_its_sft_base_back(tiny, tmp_path):
    """After an SFT stage the base is not model.path's weights: the checkpoint keeps it."""
    config, params = tiny
    cfg = dataclasses.replace(
        _lora_run_config(), sft=dataclasses.replace(_lora_run_config().sft, enabled=True)
    )
    trainer, batch = _trainer_and_batch(cfg, params)
    trainer.step(batch)
    assert set(trainer.checkpoint_state()) == {"actor", "base", "step", "rng"}
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1, async_save=False)
    ckpt.save(1, trainer.checkpoint_state(), {}, force=True)
    other = models.init_params(config, jax.random.key(5))  # what a restart loads: not the base
    resumed, _ = _trainer_and_batch(cfg, other)
    step, state, _ = ckpt.restore(resumed.checkpoint_state())
    ckpt.close()
    resumed.load_checkpoint_state(state)
    assert step == 1 and resumed.ref_params is resumed.base
    same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)  # noqa: E731
    same(resumed.base, params)
    same(resumed.state.params, trainer.state.params)
    same(resumed.params, trainer.params)


# ------------------------------------------------------------------------------ decoding


def test_merged_weight_decode_equals_adapter_decode_token_for_token():
    config = tiny_model_config()
    # Larger weights than the 0.02 init: fewer near-tied argmaxes.
    params = jax.tree.map(
        lambda x: 0.15 * jax.random.normal(jax.random.key(x.size), x.shape) + (x.ndim == 1),
        models.init_params(config, jax.random.key(0)),
    )
    ad = _nonzero_adapters(config, LORA, b_std=0.3)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[5, 17, 33, 2, 9, 41, 12], [7, 3], [11, 60, 25, 18, 9, 4, 31, 56]]

    def decode(p, n=8):
        eng = EngineCore(config, p, slots=4, max_len=64, max_prefill_length=16, sampling=greedy)
        state = eng.init_decode_state()
        for slot, prompt in enumerate(prompts):
            prefix = eng.prefill(params=p, padded_tokens=np.array(prompt), true_length=len(prompt))
            state = eng.insert(prefix, state, slot)
        outs = []
        for _ in range(n // 4):
            state, out = eng.generate_steps(p, state, 4)
            outs.append(np.asarray(out.tokens)[: len(prompts)])
        return np.concatenate(outs, axis=1)

    merged = decode(models.merge(params, ad, LORA))
    applied = decode(models.with_lora(params, ad, LORA))
    np.testing.assert_array_equal(merged, applied)
    assert (decode(params) != applied).any()  # the adapters change what is decoded


# ------------------------------------------------------------------------------ PEFT format


@pytest.fixture(scope="module")
def hf_qwen2(tiny_hf):
    """(folder, our config, our params) of a tiny random transformers Qwen2."""
    _, folder = tiny_hf("qwen2", num_key_value_heads=2, tie_word_embeddings=True)
    config, params = models.from_pretrained(folder)
    return folder, config, params


def _fresh_hf(folder):
    # A fresh copy: PEFT injects its layers into the model it is given.
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(np.array(ids))).logits.numpy()


def test_peft_export_loads_with_peft_and_gives_our_logits(hf_qwen2, tmp_path):
    folder, config, params = hf_qwen2
    ad = _nonzero_adapters(config, LORA)
    peft_io.save_peft(config, LORA, ad, tmp_path / "adapter", base_model_name_or_path=str(folder))
    model = peft.PeftModel.from_pretrained(_fresh_hf(folder), tmp_path / "adapter").eval()
    ids = _ids(vocab=config.vocab_size, T=16)
    ours = FWD(config, models.with_lora(params, ad, LORA), ids)
    base = _torch_logits(_fresh_hf(folder), ids)
    assert np.abs(np.asarray(ours) - base).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(ours, _torch_logits(model, ids), atol=1e-4, rtol=0)


def test_peft_made_adapter_imports_and_round_trips_losslessly(hf_qwen2, tmp_path):
    folder, config, params = hf_qwen2
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    made = peft.get_peft_model(
        _fresh_hf(folder),
        peft.LoraConfig(
            r=4,
            lora_alpha=16,
            target_modules=targets,
            init_lora_weights=False,  # random B: a trained adapter, not a no-op
            task_type="CAUSAL_LM",
        ),
    ).eval()
    made.save_pretrained(tmp_path / "made")
    lora, ad = peft_io.load_peft(config, tmp_path / "made")
    assert lora == models.LoraConfig(rank=4, alpha=16.0, targets=tuple(sorted(targets)))
    ids = _ids(vocab=config.vocab_size, T=16)
    np.testing.assert_allclose(
        FWD(config, models.with_lora(params, ad, lora), ids),
        _torch_logits(made, ids),
        atol=1e-4,
        rtol=0,
    )
    # Exported again, every tensor is bit-identical to PEFT's own file.
    peft_io.save_peft(config, lora, ad, tmp_path / "again")
    theirs = models.hf_io.SafetensorsFile(str(tmp_path / "made" / peft_io.WEIGHTS_FILE))
    ours = models.hf_io.SafetensorsFile(str(tmp_path / "again" / peft_io.WEIGHTS_FILE))
    assert sorted(ours.keys()) == sorted(theirs.keys())
    for name in theirs.keys():
        np.testing.assert_array_equal(ours.get(name), theirs.get(name), err_msg=name)
    lora2, ad2 = peft_io.load_peft(config, tmp_path / "again")
    assert lora2 == lora
    jax.tree.map(np.testing.assert_array_equal, ad2, ad)


def test_peft_import_errors_name_the_field(hf_qwen2, tmp_path):
    folder, config, _ = hf_qwen2
    ad = _nonzero_adapters(config, LORA)
    peft_io.save_peft(config, LORA, ad, tmp_path / "a")
    cfg_file = tmp_path / "a" / peft_io.CONFIG_FILE
    raw = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**raw, "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora=True is not supported"):
        peft_io.load_peft(config, tmp_path / "a")
    cfg_file.write_text(json.dumps(raw))
    # Continuing training from it: the section must describe the same adapter.
    run_cfg = _lora_run_config(init_from=str(tmp_path / "a"), rank=8)
    with pytest.raises(ConfigError, match=r"model.lora.rank=8 but the adapter .* has 4"):
        run.import_adapters(run_cfg, config)
    got = run.import_adapters(_lora_run_config(init_from=str(tmp_path / "a")), config)
    jax.tree.map(np.testing.assert_array_equal, got, ad)
    with pytest.raises(ConfigError, match="model.lora.init_from: no adapter_config.json"):
        run.import_adapters(_lora_run_config(init_from=str(tmp_path / "nowhere")), config)


# ------------------------------------------------------------------------------ the recipe


def test_the_lora_recipe_is_the_demo_with_lora_on():
    lora_cfg = load_config(os.path.join(ROOT, "configs", "grpo_tool_math_lora.yaml"))
    full = load_config(os.path.join(ROOT, "configs", "grpo_tool_math.yaml"))
    assert lora_cfg.model.lora.enabled and not full.model.lora.enabled
    assert lora_cfg.model.lora.config.targets == tuple(models.LORA_TARGETS)
    # Same task, rollout, algorithm and rewards as the full fine-tuning demo.
    for section in ("data", "rollout", "algorithm", "reward", "tools", "sft", "tokenizer"):
        assert getattr(lora_cfg, section) == getattr(full, section), section
    assert lora_cfg.trainer.checkpoint_dir != full.trainer.checkpoint_dir
