"""Sharded RL updates == unsharded ones: 3 train steps on 1 device and on 8 simulated devices.

XLA_FLAGS must be set before jax starts, and the rest of the suite runs on one device, so the
8-device side runs in a subprocess: this file executed as a script (`python
tests/test_train_rl_sharding.py OUT_DIR` with --xla_force_host_platform_device_count=8) runs the
same fixed trajectories through RLTrainer (and SFT on fixed traces) without a mesh and on a
mesh (GRPO and SFT on 2x2x2, PPO on 1x4x2: each mesh shape once, each run once, CI time), and
writes a JSON report that the tests below read.

The model (4 heads, 2 kv heads, hidden 32, mlp 64, vocab 64) divides both meshes under
DEFAULT_RULES: batch over (data, fsdp) = 4 devices, embed over fsdp, heads/mlp/vocab over tensor.
"""

import json
import os
import sys

import pytest
from fakes import (
    FAST_COMPILE,
    VOCAB,
    fixed_batch,
    fixed_trajectories,
    run_on_8_devices,
    tiny_model_config,
)

MESHES = ("2x2x2", "1x4x2")
# (name, algorithm section, extra config): GRPO with a reference policy (KL in the loss), and
# PPO with GAE and a critic, two mini-batches per step.
RUNS = {
    "grpo": ({"adv_estimator": "grpo", "kl_coef": 0.01}, {}),
    "ppo": (
        {"adv_estimator": "gae", "kl_coef": 0.0, "lam": 0.95},
        {"critic": {"enabled": True, "lr": 1e-2}, "optim": {"num_mini_batches": 2}},
    ),
}
STEPS = 3
# One mesh per run, each mesh shape once (every sharded run compiles its own programs, CI time):
# the critic's sharding is the policy's plus a head, so PPO also checks the policy on 1x4x2.
RUN_MESHES = {"grpo": MESHES[:1], "ppo": MESHES[1:]}
SFT_MESHES = ("2x2x2",)  # SFT shares the update with RL: one mesh is enough (CI time)
CASES = [(run, mesh) for run, meshes in RUN_MESHES.items() for mesh in meshes]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_sharding")
    # Both sides of every comparison run in the subprocess, compiled alike.
    return run_on_8_devices(__file__, out, timeout=900, xla_flags=FAST_COMPILE)


@pytest.mark.parametrize(("run", "mesh"), CASES)
def test_sharded_steps_match_single_device(report, run, mesh):
    r = report[run][mesh]
    assert r["devices"] == 8
    # Params moved by ~STEPS * lr; the sharded run differs only by float32 summation order.
    assert r["params_max_update"] > 1e-3
    assert r["params_max_abs_diff"] <= 2e-5, r
    assert r["metrics_max_rel_diff"] <= 1e-3, r
    if run == "ppo":
        assert r["critic_max_abs_diff"] <= 2e-5, r


@pytest.mark.parametrize("mesh", SFT_MESHES)
def test_sharded_sft_matches_single_device(report, mesh):
    r = report["sft"][mesh]
    assert r["params_max_update"] > 1e-3
    assert r["params_max_abs_diff"] <= 2e-5, r
    assert r["q_proj"] == str((None, "fsdp", "tensor", None))


@pytest.mark.parametrize(("run", "mesh"), CASES)
def test_state_is_placed_by_the_logical_axes(report, run, mesh):
    r = report[run][mesh]
    tensor_axis = "tensor"
    # [layers, embed, heads, head_dim] and [vocab, embed] (tied embedding)
    assert r["specs"]["q_proj"] == str((None, "fsdp", tensor_axis, None))
    assert r["specs"]["embedding"] == str((tensor_axis, "fsdp"))
    # Adam's moments mirror their params; counters are replicated.
    assert r["specs"]["mu_q_proj"] == r["specs"]["q_proj"]
    assert r["specs"]["nu_embedding"] == r["specs"]["embedding"]
    assert r["specs"]["count"] == "()"
    assert r["specs"]["step"] == "()"
    if run != "ppo":
        return
    # The critic: the trunk like the policy, the value head's kernel over embed.
    assert r["specs"]["critic_q_proj"] == r["specs"]["q_proj"]
    assert r["specs"]["critic_head"] == str(("fsdp",))
    assert r["specs"]["critic_bias"] == "()"


# ------------------------------------------------------------------------------------------------
# the 8-device side (runs in the subprocess)


def _run(name: str, mesh):
    import jax
    import numpy as np

    from jaxrl_tools import models, run
    from jaxrl_tools.config_loader import config_from_dict

    algorithm, extra = RUNS[name]
    raw = {
        "tokenizer": {"path": "unused"},
        "data": {"batch_size": 2},
        "rollout": {"group_size": 4, "max_response_len": 16},
        "algorithm": algorithm,
        "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
        "optim": {"lr": 1e-3, "micro_batch_size": 4, "grad_clip": 1.0, "weight_decay": 0.0},
        "trainer": {"steps": STEPS},
    }
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v}
    cfg = config_from_dict(raw)
    model_cfg = tiny_model_config()
    params = models.init_params(model_cfg, jax.random.key(0), mesh=mesh)
    init = jax.tree.map(np.asarray, params)
    trajs = fixed_trajectories()
    trainer = run.make_trainer(cfg, model_cfg, params, mesh)
    batch = fixed_batch(cfg, trainer.rows, trajs)
    metrics = [trainer.step(batch) for _ in range(STEPS)]
    return trainer, init, metrics


def _sft_init():
    import jax

    from jaxrl_tools import models

    return models.init_params(tiny_model_config(), jax.random.key(0))


class _CharTokenizer:
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % (VOCAB - 3) for c in text]


def _sft(mesh):
    import jax

    from jaxrl_tools import models
    from jaxrl_tools.train.sft import train_sft

    params = models.init_params(tiny_model_config(), jax.random.key(0), mesh=mesh)
    traces = [[[f"what is {i} * 7? ", False], [f"{i * 7}.", True]] for i in range(16)]
    return train_sft(
        tiny_model_config(),
        params,
        _CharTokenizer(),
        traces,
        epochs=2,
        lr=1e-3,
        batch_size=8,
        max_len=32,
        micro_batch_size=4,
        mesh=mesh,
    )


def _main(out_dir: str) -> None:
    import jax
    import numpy as np

    from jaxrl_tools.sharding import make_mesh

    assert jax.device_count() == 8, jax.devices()
    flat = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]
    spec = lambda x: str(tuple(x.sharding.spec))
    report: dict = {}
    for name in RUNS:
        ref, init, ref_metrics = _run(name, None)
        report[name] = {}
        for shape in RUN_MESHES[name]:
            trainer, _, metrics = _run(name, make_mesh(shape))
            r = {
                "devices": jax.device_count(),
                "params_max_update": max(
                    float(np.abs(a - b).max()) for a, b in zip(flat(ref.params), flat(init))
                ),
                "params_max_abs_diff": max(
                    float(np.abs(a - b).max())
                    for a, b in zip(flat(ref.params), flat(trainer.params))
                ),
                "metrics_max_rel_diff": max(
                    abs(m[k] - rm[k]) / max(abs(rm[k]), 1e-3)
                    for m, rm in zip(metrics, ref_metrics)
                    for k in rm
                    if not k.startswith(("time/", "throughput/"))
                ),
            }
            p = trainer.state.params
            adam = trainer.state.opt_state[-1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
            r["specs"] = {
                "q_proj": spec(p["layers"]["attn"]["q_proj"]["kernel"]),
                "embedding": spec(p["embed"]["embedding"]),
                "mu_q_proj": spec(adam.mu["layers"]["attn"]["q_proj"]["kernel"]),
                "nu_embedding": spec(adam.nu["embed"]["embedding"]),
                "count": spec(adam.count),
                "step": spec(trainer.state.step),
            }
            if trainer.critic_state is not None:
                c = trainer.critic_state.params
                r["critic_max_abs_diff"] = max(
                    float(np.abs(a - b).max())
                    for a, b in zip(flat(ref.critic_state.params), flat(c))
                )
                r["specs"]["critic_q_proj"] = spec(c["trunk"]["layers"]["attn"]["q_proj"]["kernel"])
                r["specs"]["critic_head"] = spec(c["value_head"]["kernel"])
                r["specs"]["critic_bias"] = spec(c["value_head"]["bias"])
            report[name][shape] = r
    sft_ref, sft_init = _sft(None), jax.tree.map(np.asarray, _sft_init())
    report["sft"] = {}
    for shape in SFT_MESHES:
        sharded = _sft(make_mesh(shape))
        report["sft"][shape] = {
            "params_max_update": max(
                float(np.abs(a - b).max()) for a, b in zip(flat(sft_ref), flat(sft_init))
            ),
            "params_max_abs_diff": max(
                float(np.abs(a - b).max()) for a, b in zip(flat(sft_ref), flat(sharded))
            ),
            "q_proj": spec(sharded["layers"]["attn"]["q_proj"]["kernel"]),
        }
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    _main(sys.argv[1])
