"""jaxrl_tools.models: parity with transformers (PyTorch), KV cache, HF I/O, errors."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from jaxrl_tools import models as M
from jaxrl_tools.sharding import make_mesh

FWD = jax.jit(M.forward, static_argnums=0)
HIDDEN = jax.jit(M.hidden_states, static_argnums=0)
CACHED = jax.jit(M.forward_cached, static_argnums=0, donate_argnums=4)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # the tests run to position 31: beyond it
}
# (family, overrides): GQA 4:4, 4:2, 4:1; tied and untied heads; Qwen3 q/k norm; Llama3 rope.
VARIANTS = {
    "qwen2-4:2-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-4:4-untied": ("qwen2", dict(num_key_value_heads=4, rope_theta=1e6)),
    "qwen3-4:1-untied": ("qwen3", dict(num_key_value_heads=1)),
    "qwen3-4:2-tied": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3-4:2-rope-scaling": (
        "llama",
        dict(num_key_value_heads=2, rope_theta=5e5, rope_scaling=LLAMA3_ROPE),
    ),
}
T = 32
LENGTHS = (32, 20, 9)  # rows of a left-padded batch


def _hf_logits(model, ids_BT) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids_BT))).logits.float().numpy()


def _left_padded(lengths, total, seed=0):
    rng = np.random.RandomState(seed)
    rows = [rng.randint(0, 256, n) for n in lengths]
    ids = np.zeros((len(rows), total), np.int32)
    mask = np.zeros((len(rows), total), np.int32)
    for b, r in enumerate(rows):
        ids[b, total - len(r) :] = r
        mask[b, total - len(r) :] = 1
    return rows, ids, mask


@pytest.fixture(scope="module")
def loaded(tiny_hf):
    """name -> (torch model, folder, config, float32 params)."""
    out = {}

    def get(name):
        if name not in out:
            family, overrides = VARIANTS[name]
            model, folder = tiny_hf(family, **overrides)
            config, params = M.from_pretrained(folder)
            out[name] = (model, folder, config, params)
        return out[name]

    return get


# ------------------------------------------------------------------------------------------------
# parity with transformers


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_left_padded(loaded, name):
    model, _, config, params = loaded(name)
    rows, ids, mask = _left_padded(LENGTHS, T)
    logits = np.asarray(FWD(config, params, jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert logits.dtype == np.float32
    for b, row in enumerate(rows):
        ref = _hf_logits(model, row[None])[0]
        diff = np.abs(logits[b, T - len(row) :] - ref).max()
        assert diff <= 1e-4, f"{name} row {b}: max abs diff {diff}"
    assert np.isfinite(logits).all()  # padding rows too


def test_logits_match_transformers_batched(loaded):
    model, _, config, params = loaded("qwen3-4:1-untied")
    ids = np.random.RandomState(1).randint(0, 256, (3, T))
    out = FWD(config, params, jnp.asarray(ids), attention_mask=jnp.ones((3, T), jnp.int32))
    assert np.abs(np.asarray(out) - _hf_logits(model, ids)).max() <= 1e-4


def test_explicit_positions_match_transformers(loaded):
    model, _, config, params = loaded("llama3-4:2-rope-scaling")
    ids = np.random.RandomState(2).randint(0, 256, (3, 8))
    pos = np.stack([np.arange(8) + 20, np.arange(8) + 3, np.arange(8)])
    with torch.no_grad():
        ref = model(torch.as_tensor(ids), position_ids=torch.as_tensor(pos)).logits.numpy()
    out = FWD(config, params, jnp.asarray(ids), positions=jnp.asarray(pos))
    assert np.abs(np.asarray(out) - ref).max() <= 1e-4


def test_hidden_states_times_unembed_is_logits(loaded):
    _, _, config, params = loaded("qwen2-4:2-tied")
    ids = jnp.asarray(np.random.RandomState(3).randint(0, 256, (3, T)))
    mask = jnp.ones((3, T), jnp.int32)
    h = HIDDEN(config, params, ids, attention_mask=mask)
    w = M.unembed(config, params)
    assert h.shape == (3, T, config.hidden_size) and w.shape == (64, 256)
    np.testing.assert_allclose(h @ w, FWD(config, params, ids, attention_mask=mask), atol=1e-5)
    _, _, config, params = loaded("qwen3-4:1-untied")
    assert M.unembed(config, params) is params["lm_head"]["kernel"]


def test_bfloat16_logits_close_to_float32_reference(loaded):
    # bfloat16 params and compute (8-bit mantissa) against the float32 PyTorch model.
    model, folder, _, _ = loaded("qwen3-4:2-tied")
    config, params = M.from_pretrained(folder, dtype=jnp.bfloat16)
    assert params["layers"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    rows, ids, mask = _left_padded(LENGTHS, T)
    logits = FWD(config, params, jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    assert logits.dtype == jnp.float32
    for b, row in enumerate(rows):
        ref = _hf_logits(model, row[None])[0]
        diff = np.abs(np.asarray(logits)[b, T - len(row) :] - ref).max()
        assert diff <= 0.05 * np.abs(ref).max(), f"row {b}: {diff} vs scale {np.abs(ref).max()}"


# ------------------------------------------------------------------------------------------------
# KV cache


def test_prefill_then_decode_equals_full_forward(loaded):
    # Same shapes as the next test (batch 3, prompt 11, cache 20): the compiled steps are reused.
    _, _, config, params = loaded("llama3-4:2-rope-scaling")
    ids = np.random.RandomState(4).randint(0, 256, (3, 20))
    full = np.asarray(FWD(config, params, jnp.asarray(ids), attention_mask=jnp.ones((3, 20))))
    cache = M.init_cache(config, 3, 20)
    n = 11
    pos = np.broadcast_to(np.arange(n), (3, n))
    logits, cache = CACHED(
        config,
        params,
        jnp.asarray(ids[:, :n]),
        jnp.asarray(pos),
        cache,
        valid_BT=jnp.ones((3, n), jnp.int32),
    )
    np.testing.assert_allclose(logits, full[:, :n], atol=1e-5)
    for t in range(n, 20):  # past original_max_position_embeddings=16
        step, cache = CACHED(
            config, params, jnp.asarray(ids[:, t : t + 1]), jnp.full((3, 1), t, jnp.int32), cache
        )
        np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-5)


def test_cache_chunks_at_explicit_positions_rows_of_different_lengths(loaded):
    # Slots with prompts of 5, 11 and 8 tokens; then a 4-token chunk (e.g. a tool observation)
    # appended to each at its own position; then one decode step. Compared with full forwards.
    model, _, config, params = loaded("llama3-4:2-rope-scaling")
    rng = np.random.RandomState(5)
    lens = [5, 11, 8]
    seqs = [rng.randint(0, 256, n + 5) for n in lens]  # prompt + 4-token chunk + 1 decode token
    P = max(lens)
    prompt = np.zeros((3, P), np.int32)
    ppos = np.zeros((3, P), np.int32)
    valid = np.zeros((3, P), np.int32)
    for b, n in enumerate(lens):  # right-padded prompts: filler is not written (valid=0)
        prompt[b, :n], ppos[b, :n], valid[b, :n] = seqs[b][:n], np.arange(n), 1
        ppos[b, n:] = np.arange(n, P)
    cache = M.init_cache(config, 3, 20)
    out, cache = CACHED(
        config, params, jnp.asarray(prompt), jnp.asarray(ppos), cache, valid_BT=jnp.asarray(valid)
    )
    chunk = np.stack([s[n : n + 4] for s, n in zip(seqs, lens)])
    cpos = np.stack([np.arange(n, n + 4) for n in lens])
    out2, cache = CACHED(config, params, jnp.asarray(chunk), jnp.asarray(cpos), cache)
    last = np.stack([s[n + 4 : n + 5] for s, n in zip(seqs, lens)])
    out3, cache = CACHED(config, params, jnp.asarray(last), jnp.asarray(cpos[:, -1:] + 1), cache)
    for b, n in enumerate(lens):
        ref = _hf_logits(model, seqs[b][None])[0]
        np.testing.assert_allclose(out[b, :n], ref[:n], atol=1e-4)
        np.testing.assert_allclose(out2[b], ref[n : n + 4], atol=1e-4)
        np.testing.assert_allclose(out3[b, 0], ref[n + 4], atol=1e-4)
    # Nothing was written past each row's last position.
    for b, n in enumerate(lens):
        assert not np.asarray(cache.k[:, b, :, n + 5 :]).any()

    # A prefill that asks only for each row's last logits gets those, and the same cache.
    def prefill(**kwargs):
        fresh = M.init_cache(config, 3, 20)
        tokens, positions, valid_BT = jnp.asarray(prompt), jnp.asarray(ppos), jnp.asarray(valid)
        return M.forward_cached(
            config, params, tokens, positions, fresh, valid_BT=valid_BT, **kwargs
        )

    last_BV, cache_last = prefill(logits_at_B=jnp.asarray(lens) - 1)
    _, cache_full = prefill()
    assert last_BV.shape == (3, config.vocab_size)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(last_BV[b], out[b, n - 1], atol=1e-5)
    np.testing.assert_array_equal(cache_last.k, cache_full.k)


@pytest.mark.parametrize("name", ["qwen2-4:2-tied", "qwen3-4:1-untied"])
def test_unstacked_layers_give_the_same_logits_and_cache(loaded, name):
    """Params with one tree per layer and, with tied embeddings, an LM head of their own (what
    the engine decodes with on CPU) run the same model: a full forward, and a prefill then two
    decode steps against the cache."""
    _, _, config, params = loaded(name)
    flat = jax.jit(lambda p: M.untie_head(M.unstack_layers(p)))(params)
    assert "layers" not in flat and len([k for k in flat if k.startswith("layers_")]) == 2
    if config.tie_word_embeddings:
        assert "lm_head" not in params
        np.testing.assert_array_equal(flat["lm_head"]["kernel"], params["embed"]["embedding"].T)
    else:
        np.testing.assert_array_equal(flat["lm_head"]["kernel"], params["lm_head"]["kernel"])
    np.testing.assert_array_equal(
        flat["layers_1"]["mlp"]["up_proj"]["kernel"],
        params["layers"]["mlp"]["up_proj"]["kernel"][1],
    )
    _, ids, mask = _left_padded(LENGTHS, T)
    np.testing.assert_allclose(
        FWD(config, flat, ids, attention_mask=mask),
        FWD(config, params, ids, attention_mask=mask),
        atol=1e-5,
    )
    runs = []
    for p in (params, flat):  # the cache is donated: keep the logits and the last cache
        pos = np.broadcast_to(np.arange(20), (3, 20))
        logits, cache = CACHED(config, p, ids[:, :20], pos, M.init_cache(config, 3, 24))
        steps = [logits]
        for t in (20, 21):
            logits, cache = CACHED(config, p, ids[:, t : t + 1], np.full((3, 1), t), cache)
            steps.append(logits)
        runs.append((steps, cache))
    (steps_a, cache_a), (steps_b, cache_b) = runs
    for a, b in zip(steps_a, steps_b):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(cache_a.k, cache_b.k, atol=1e-5)
    np.testing.assert_allclose(cache_a.v, cache_b.v, atol=1e-5)


def test_cache_axes_and_shapes():
    config = M.ModelConfig("qwen2", 256, 64, 128, 2, 4, 2, 16, attention_bias=True)
    cache = M.init_cache(config, 3, 7, dtype=jnp.bfloat16)
    assert cache.k.shape == (2, 3, 2, 7, 16) and cache.dtype == jnp.bfloat16
    assert M.cache_axes().k == ("layers", "batch", "kv_heads", "cache_length", "head_dim")


def test_bf16_cache_writes_in_place():
    """A decode step's temporaries stay far below the cache with a bfloat16 cache, as with a
    float32 one (XLA's CPU backend once converted the whole bfloat16 cache to float32 and back in
    every layer's write: 2x the cache in temporaries)."""
    config = M.ModelConfig("qwen2", 256, 64, 128, 2, 4, 2, 16)
    params = M.param_shapes(config, jnp.bfloat16)
    tok = jax.ShapeDtypeStruct((8, 1), jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = jax.eval_shape(functools.partial(M.init_cache, config, 8, 8192, dtype=dtype))
        step = jax.jit(
            lambda p, c, t: M.forward_cached(config, p, t, t, c, attend_len=64), donate_argnums=1
        )
        memory = step.lower(params, cache, tok).compile().memory_analysis()
        assert memory.temp_size_in_bytes < 0.1 * M.cache_bytes(config, 8, 8192, dtype), dtype


# ------------------------------------------------------------------------------------------------
# HF I/O


def _assert_same_weights(config, params, hf_model):
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    assert state["model.embed_tokens.weight"].shape == (256, 64)
    np.testing.assert_array_equal(
        state["model.embed_tokens.weight"], np.asarray(params["embed"]["embedding"], np.float32)
    )
    q = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"][1], np.float32)
    np.testing.assert_array_equal(
        state["model.layers.1.self_attn.q_proj.weight"], q.reshape(64, -1).T
    )
    o = np.asarray(params["layers"]["attn"]["o_proj"]["kernel"][0], np.float32)
    np.testing.assert_array_equal(
        state["model.layers.0.self_attn.o_proj.weight"], o.reshape(-1, 64).T
    )
    # Every tensor: round-trip back through our loader's table gives identical arrays.
    for name, spec, layer in M.hf_io._entries(config):
        leaf = np.asarray(M.hf_io._get(params, spec.path), np.float32)
        ours = M.hf_io._to_hf(spec, leaf if layer is None else leaf[layer])
        np.testing.assert_array_equal(state[name], ours, err_msg=name)
    if config.tie_word_embeddings:
        np.testing.assert_array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", ["qwen2-4:2-tied", "qwen3-4:1-untied", "llama3-4:2-rope-scaling"])
def test_save_pretrained_loads_in_transformers_with_identical_weights(loaded, tmp_path, name):
    model, _, config, _ = loaded(name)
    rng = np.random.RandomState(7)  # different weights from the HF model the config came from
    params = jax.tree.map(
        lambda x: x + 0.01 * rng.standard_normal(x.shape).astype(np.float32), loaded(name)[3]
    )
    M.save_pretrained(config, params, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(hf) is type(model)
    _assert_same_weights(config, params, hf)
    assert M.load_config(tmp_path) == config
    ids = np.random.RandomState(6).randint(0, 256, (3, T))
    out = FWD(config, params, jnp.asarray(ids), attention_mask=jnp.ones((3, T), jnp.int32))
    assert np.abs(np.asarray(out) - _hf_logits(hf, ids)).max() <= 1e-4


def test_save_pretrained_bfloat16_sharded_files(loaded, tmp_path):
    _, _, config, params32 = loaded("qwen3-4:2-tied")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    M.save_pretrained(config, params, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).exists() for f in files)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.dtype == torch.bfloat16
    _assert_same_weights(config, params, hf)
    config2, params2 = M.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert config2 == config
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2
    )


def test_from_pretrained_multi_file_checkpoint(loaded, tiny_hf, tmp_path):
    _, _, config, params = loaded("qwen2-4:4-untied")
    family, overrides = VARIANTS["qwen2-4:4-untied"]
    model, _ = tiny_hf(family, **overrides)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    config2, params2 = M.from_pretrained(tmp_path)
    assert config2 == config
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2
    )


def test_load_config_transformers_4x_and_5x_spellings(tmp_path):
    base = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}
    v4 = dict(base, rope_theta=5e5, rope_scaling=dict(scaling, type="llama3"))
    v5 = dict(base, rope_parameters=dict(scaling, rope_theta=5e5, rope_type="llama3"))
    c4, c5 = M.ModelConfig.from_hf(v4), M.ModelConfig.from_hf(v5)
    assert c4 == c5 and hash(c4) == hash(c5)
    assert c5.rope_theta == 5e5 and c5.rope_type == "llama3" and c5.head_dim == 16
    assert M.ModelConfig.from_hf(c5.to_hf()) == c5
    plain = M.ModelConfig.from_hf(dict(base, model_type="qwen2", rope_theta=1e6))
    assert plain.rope_scaling is None and plain.attention_bias and not plain.qk_norm
    # Family defaults when built directly: head_dim, qwen2 q/k/v bias, qwen3 q/k norm.
    assert M.ModelConfig("qwen2", 256, 64, 128, 2, 4, 2) == dataclasses.replace(
        plain, rope_theta=1e4
    )
    q3 = M.ModelConfig("qwen3", 256, 64, 128, 2, 4, 2)
    assert (q3.head_dim, q3.qk_norm, q3.attention_bias) == (16, True, False)
    # What transformers 5.x itself writes.
    transformers.Qwen3Config(
        **{k: v for k, v in base.items() if k != "model_type"}, head_dim=16, rope_theta=1e6
    ).save_pretrained(tmp_path)
    c = M.load_config(tmp_path)
    assert (c.model_type, c.qk_norm, c.head_dim, c.rope_theta) == ("qwen3", True, 16, 1e6)


# ------------------------------------------------------------------------------------------------
# errors


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8}))
    with pytest.raises(ValueError, match=r"'gpt2'.*qwen2, qwen3, llama"):
        M.load_config(tmp_path)


def test_folder_without_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        M.from_pretrained(tmp_path)


def _copy_with(folder, dest, edit):
    from safetensors.numpy import load_file, save_file

    for f in os.listdir(folder):
        if f == "config.json":
            (dest / f).write_text((folder / f).read_text())
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(loaded, tmp_path):
    _, folder, _, _ = loaded("qwen3-4:1-untied")
    _copy_with(folder, tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*missing"):
        M.from_pretrained(tmp_path)


def test_wrong_shape_names_tensor_and_both_shapes(loaded, tmp_path):
    _, folder, _, _ = loaded("qwen3-4:1-untied")

    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)

    _copy_with(folder, tmp_path, edit)
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(100, 64\).*\(128, 64\)"):
        M.from_pretrained(tmp_path)


def test_bad_configs_and_meshes():
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        M.ModelConfig("llama", 256, 64, 128, 2, 4, 3, 16)
    with pytest.raises(ValueError, match="'yarn'"):
        M.ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16, rope_scaling={"rope_type": "yarn"})
    with pytest.raises(ValueError, match="hidden_size"):
        M.ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 8})
    with pytest.raises(ValueError, match="does not match the 1 available devices"):
        make_mesh("2x2x2")


def test_safetensors_reader_matches_library(tmp_path):
    from safetensors.torch import save_file

    x = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"x": x, "y": torch.arange(4, dtype=torch.int64)}, tmp_path / "a.safetensors")
    f = M.hf_io.SafetensorsFile(str(tmp_path / "a.safetensors"))
    np.testing.assert_array_equal(f.get("x").astype(np.float32), x.float().numpy())
    assert f.get("x").dtype == ml_dtypes.bfloat16 and f.get("y").tolist() == [0, 1, 2, 3]


def test_init_params_matches_shapes_axes_and_transformers_init():
    config = M.ModelConfig(
        "qwen2", 256, 64, 128, 2, 4, 2, 16, attention_bias=True, tie_word_embeddings=True
    )
    params = M.init_params(config, jax.random.key(0), dtype=jnp.bfloat16)
    shapes = M.param_shapes(config, jnp.bfloat16)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), shapes
    )
    assert jax.tree.structure(params) == jax.tree.structure(
        M.logical_axes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    assert "lm_head" not in params
    q = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"], np.float32)
    assert abs(q.std() - 0.02) < 0.002 and not np.array_equal(q[0], q[1])  # layers differ
    assert (np.asarray(params["final_norm"]["scale"]) == 1).all()
    assert not np.asarray(params["layers"]["attn"]["k_proj"]["bias"], np.float32).any()


def test_remat_gradients_match_finite_differences(loaded):
    _, _, config, params = loaded("qwen3-4:1-untied")
    _, ids, mask = _left_padded((12, 7), 12)

    def loss(p, remat):
        logits = M.forward(
            config, p, jnp.asarray(ids), attention_mask=jnp.asarray(mask), remat=remat
        )
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1)[..., 0]
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

    g = jax.jit(jax.grad(loss), static_argnums=1)(params, True)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    assert np.abs(np.asarray(g["layers"]["attn"]["q_norm"]["scale"])).max() > 0
    # Directional derivative along the gradient: (L(p + eps g) - L(p - eps g)) / 2 eps = |g|^2.
    f = jax.jit(loss, static_argnums=1)
    eps = 1e-3
    shifted = lambda sign: jax.tree.map(lambda x, d: x + sign * eps * d, params, g)
    numeric = (f(shifted(1), False) - f(shifted(-1), False)) / (2 * eps)
    exact = sum(float((x**2).sum()) for x in jax.tree.leaves(g))
    assert abs(float(numeric) - exact) <= 2e-2 * exact


def test_remat_policies_give_the_gradient_without_remat(loaded):
    # "dots" keeps the matmul outputs and recomputes the rest: the same gradient ("layer", which
    # recomputes everything, is checked against finite differences above).
    _, _, config, params = loaded("qwen3-4:2-tied")
    _, ids, mask = _left_padded(LENGTHS, T)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def loss(p, remat):
        logits = M.forward(config, p, ids, attention_mask=mask, remat=remat)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    plain = grad(params, "none")
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        grad(params, "dots"),
        plain,
    )
    with pytest.raises(ValueError, match="remat='all' is not one of"):
        grad(params, "all")
