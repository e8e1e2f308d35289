"""Sharded == unsharded: one model on 1 device and on 8 simulated CPU devices (2x2x2, 1x1x8).

XLA_FLAGS must be set before jax starts, and the rest of the suite runs on one device, so the
8-device checks run in a subprocess: this file executed as a script (`python
tests/test_models_sharding.py OUT_DIR` with --xla_force_host_platform_device_count=8) writes a JSON
report that the tests below read. Mesh axes are (data, fsdp, tensor).

The model has 8 query heads and 4 kv heads: 2x2x2 uses DEFAULT_RULES; on 1x1x8 the 4 kv heads do
not split over 8 tensor devices, so that mesh uses a rules variant with kv_heads replicated
(`RULES_1x1x8`); heads, mlp and vocab are still split 8 ways.
"""

import contextlib
import json
import os
import sys

import pytest
from fakes import run_on_8_devices
from jax.sharding import PartitionSpec as P

from jaxrl_tools import models as M
from jaxrl_tools.sharding import DEFAULT_RULES, logical_to_spec

CONFIG = M.ModelConfig(
    "qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    qk_norm=True,
    rope_theta=1e6,
)
RULES_1x1x8 = {**DEFAULT_RULES, "kv_heads": None}
MESHES = {"2x2x2": None, "1x1x8": RULES_1x1x8}

# The golden shardings of every parameter of CONFIG under DEFAULT_RULES.
GOLDEN_2x2x2 = {
    "['embed']['embedding']": P("tensor", "fsdp"),
    "['final_norm']['scale']": P("fsdp"),
    "['layers']['attn']['k_norm']['scale']": P(None, None),
    "['layers']['attn']['k_proj']['kernel']": P(None, "fsdp", "tensor", None),
    "['layers']['attn']['o_proj']['kernel']": P(None, "tensor", None, "fsdp"),
    "['layers']['attn']['q_norm']['scale']": P(None, None),
    "['layers']['attn']['q_proj']['kernel']": P(None, "fsdp", "tensor", None),
    "['layers']['attn']['v_proj']['kernel']": P(None, "fsdp", "tensor", None),
    "['layers']['input_norm']['scale']": P(None, "fsdp"),
    "['layers']['mlp']['down_proj']['kernel']": P(None, "tensor", "fsdp"),
    "['layers']['mlp']['gate_proj']['kernel']": P(None, "fsdp", "tensor"),
    "['layers']['mlp']['up_proj']['kernel']": P(None, "fsdp", "tensor"),
    "['layers']['post_attention_norm']['scale']": P(None, "fsdp"),
    "['lm_head']['kernel']": P("fsdp", "tensor"),
}


def _specs(rules=None) -> dict[str, P]:
    import jax

    is_axes = lambda x: isinstance(x, tuple)
    flat = jax.tree_util.tree_flatten_with_path(M.logical_axes(CONFIG), is_leaf=is_axes)[0]
    return {jax.tree_util.keystr(p): logical_to_spec(a, rules) for p, a in flat}


def test_golden_param_shardings():
    assert _specs() == GOLDEN_2x2x2
    variant = _specs(RULES_1x1x8)
    assert variant["['layers']['attn']['k_proj']['kernel']"] == P(None, "fsdp", None, None)
    assert (
        variant["['layers']['attn']['q_proj']['kernel']"]
        == GOLDEN_2x2x2["['layers']['attn']['q_proj']['kernel']"]
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_on_8_devices(__file__, tmp_path_factory.mktemp("sharding"), timeout=600)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_logits_equal_single_device(report, mesh):
    r = report[mesh]
    assert r["devices"] == 8
    assert r["forward_max_abs_diff"] <= 1e-5
    assert r["cached_max_abs_diff"] <= 1e-5


def test_mesh_that_does_not_divide_a_parameter_is_an_error(report):
    error = report["default_rules_1x1x8_error"]
    assert error is not None and "k_proj" in error and "size 4" in error, error


@pytest.mark.parametrize("mesh", list(MESHES))
def test_loaded_params_are_placed_by_the_rules(report, mesh):
    expected = {k: str(v) for k, v in _specs(MESHES[mesh]).items()}
    assert report[mesh]["param_specs"] == expected
    assert report[mesh]["cache_spec"] == str(logical_to_spec(M.CACHE_AXES, MESHES[mesh]))


# ------------------------------------------------------------------------------------------------
# the 8-device side (runs in the subprocess)


def _main(out_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from jaxrl_tools.sharding import make_mesh, use_mesh

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.RandomState(0)
    shapes = M.param_shapes(CONFIG)
    params = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    folder = os.path.join(out_dir, "model")
    M.save_pretrained(CONFIG, params, folder, max_shard_size="60KB")

    B, T, S = 8, 16, 20
    lengths = rng.randint(4, T + 1, B)
    ids = rng.randint(0, 256, (B, T)).astype(np.int32)
    mask = (np.arange(T)[None] >= T - lengths[:, None]).astype(np.int32)  # left padding
    steps = rng.randint(0, 256, (B, 2)).astype(np.int32)

    def run(mesh, rules):
        config, p = M.from_pretrained(folder, mesh=mesh, rules=rules)
        # constrain() reads the mesh while tracing: a fresh jit per mesh.
        fwd = jax.jit(M.forward, static_argnums=0)
        step = jax.jit(M.forward_cached, static_argnums=0, donate_argnums=4)
        ids_, mask_ = jnp.asarray(ids), jnp.asarray(mask)
        if mesh is not None:
            batch = NamedSharding(mesh, logical_to_spec(("batch", "length"), rules))
            ids_, mask_ = jax.device_put(ids_, batch), jax.device_put(mask_, batch)
        ctx = use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext()
        with ctx:
            logits = fwd(config, p, ids_, attention_mask=mask_)
            cache = M.init_cache(config, B, S, mesh=mesh, rules=rules)
            cache_spec = str(cache.k.sharding.spec) if mesh is not None else None
            pos = jnp.broadcast_to(jnp.arange(T), (B, T))
            outs = [step(config, p, ids_, pos, cache)]
            cache = outs[0][1]
            for t in range(2):
                outs.append(
                    step(
                        config,
                        p,
                        jnp.asarray(steps[:, t : t + 1]),
                        jnp.full((B, 1), T + t, jnp.int32),
                        cache,
                    )
                )
                cache = outs[-1][1]
        cached = np.concatenate([np.asarray(o[0]) for o in outs], axis=1)
        specs = {
            jax.tree_util.keystr(k): str(getattr(v.sharding, "spec", None))
            for k, v in jax.tree_util.tree_flatten_with_path(p)[0]
        }
        return np.asarray(logits), cached, specs, cache_spec

    ref_logits, ref_cached, _, _ = run(None, None)
    report = {}
    try:  # 4 kv heads over 8 tensor devices: an error naming the parameter, before any read
        M.from_pretrained(folder, mesh=make_mesh("1x1x8"))
        report["default_rules_1x1x8_error"] = None
    except ValueError as e:
        report["default_rules_1x1x8_error"] = str(e)
    for shape, rules in MESHES.items():
        logits, cached, specs, cache_spec = run(make_mesh(shape), rules)
        valid = mask.astype(bool)
        report[shape] = {
            "devices": jax.device_count(),
            "forward_max_abs_diff": float(np.abs(logits - ref_logits)[valid].max()),
            "cached_max_abs_diff": float(np.abs(cached - ref_cached).max()),
            "param_specs": specs,
            "cache_spec": cache_spec,
        }
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    _main(sys.argv[1])
