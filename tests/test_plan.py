"""jaxrl_tools.plan: compiled memory figures account for the state, the batch and the KV cache."""

import dataclasses
import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from fakes import run_on_8_devices, tiny_model_config

from jaxrl_tools import models, plan, sharding, targets
from jaxrl_tools.config import AlgorithmSection
from jaxrl_tools.models.lora import lora_shapes
from jaxrl_tools.plan import run_plan


def test_plan_memory_accounts_for_master_weights_adam_and_bf16_cache():
    cfg = tiny_model_config()
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(cfg)))
    M, b, T, slots, cache_len = 2, 4, 32, 4, 64
    settings = plan.grpo_settings(
        cfg, dtypes=models.DTypePolicy(compute="bfloat16"), micro_batch_size=b
    )
    figures = plan.plan_memory(
        settings,
        mesh=sharding.make_mesh((1, -1, 1)),
        rows=M * b,
        seq_len=T,
        slots=slots,
        cache_len=cache_len,
    )
    # The RL step's arguments: fp32 weights + Adam mu and nu (12 bytes a parameter), the batch
    # (tokens, positions, attention, loss mask: four [M * b, T] 4-byte arrays; the estimator's
    # scores and row mask: two [M * b]), and a few counters (steps, RNG key, Adam's count).
    batch = 4 * 4 * M * b * T + 2 * 4 * M * b
    extra = figures["update"].arguments - 12 * n - batch
    assert 0 <= extra <= 64, extra
    assert figures["update"].aliased >= 12 * n  # the state is donated
    # Decode arguments: the bf16 serving copy and the bf16 KV cache (plus small per-slot state).
    cache = models.cache_bytes(cfg, slots, cache_len, jnp.bfloat16)
    small = slots * (4 * cfg.vocab_size + 64)
    extra = figures["decode"].arguments - 2 * n - cache
    assert 0 <= extra <= small, extra
    assert all(m.peak >= m.arguments for m in figures.values())
    lines = plan.describe(figures, targets.ACCELERATORS["v5e"].hbm_bytes)
    assert len(lines) == 2 and all("fits in 16.00 GiB" in line for line in lines)


def test_resident_state_and_serving_copy_are_added_to_each_phase():
    cfg = tiny_model_config()
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(cfg)))
    mesh = sharding.make_mesh((1, -1, 1))
    settings = lambda **kw: plan.grpo_settings(cfg, **kw)  # noqa: E731
    fp32 = plan.resident_bytes(settings(), mesh=mesh)
    bf16 = plan.resident_bytes(settings(dtypes=models.DTypePolicy(compute="bfloat16")), mesh=mesh)
    assert fp32["frozen"] == 0  # no KL: no reference copy
    assert 12 * n <= fp32["state"] <= 12 * n + 64  # weights, mu, nu (+ counters)
    assert fp32["serving"] == 0 and bf16["serving"] == 2 * n  # fp32 serves the weights themselves
    assert fp32["decode_reads"] == 4 * n and bf16["decode_reads"] == 0
    m = plan.Memory(arguments=100, outputs=10, temporaries=50, aliased=0)
    figures = {"update": m, "decode": m}
    t32, t16 = plan.phase_totals(figures, fp32), plan.phase_totals(figures, bf16)
    assert t32["update"] == 160 and t16["update"] == 160 + 2 * n
    assert t32["decode"] == 160 + fp32["state"] - 4 * n and t16["decode"] == 160 + bf16["state"]

    # KL on: the full fine-tune's reference policy (bf16) stays resident as the frozen policy.
    kl = plan.resident_bytes(
        settings(
            dtypes=models.DTypePolicy(compute="bfloat16"),
            algorithm=AlgorithmSection(kl_coef=0.01),
        ),
        mesh=mesh,
    )
    assert kl["frozen"] == 2 * n and kl["state"] == bf16["state"]

    # LoRA: the state is the adapters' (and their moments), the bf16 base stays resident, and
    # the engine's merged copy is another bf16 set of weights.
    lora = models.LoraConfig(rank=4, alpha=8.0)
    a = sum(math.prod(x.shape) for x in jax.tree.leaves(lora_shapes(cfg, lora)))
    lo = plan.resident_bytes(
        settings(dtypes=models.DTypePolicy(compute="bfloat16"), lora=lora), mesh=mesh
    )
    assert 12 * a <= lo["state"] <= 12 * a + 64 and lo["frozen"] == lo["serving"] == 2 * n
    assert lo["decode_reads"] == 0


def test_lora_update_holds_adapter_moments_and_the_base_once():
    cfg = tiny_model_config()
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(cfg)))
    lora = models.LoraConfig(rank=4, alpha=8.0)
    a = sum(math.prod(x.shape) for x in jax.tree.leaves(lora_shapes(cfg, lora)))
    M, b, T = 2, 4, 32
    settings = plan.grpo_settings(
        cfg, dtypes=models.DTypePolicy(compute="bfloat16"), micro_batch_size=b, lora=lora
    )
    figures = plan.plan_memory(
        settings,
        mesh=sharding.make_mesh((1, -1, 1)),
        rows=M * b,
        seq_len=T,
        slots=4,
        cache_len=64,
        functions=("update",),
    )
    # Adapters + their two moments (fp32), the bf16 base, the batch: no base-sized moments.
    batch = 4 * 4 * M * b * T + 2 * 4 * M * b
    extra = figures["update"].arguments - 12 * a - 2 * n - batch
    assert 0 <= extra <= 64, extra
    assert figures["update"].aliased >= 12 * a


def _run_config(tmp_path):
    import yaml
    from fakes import TINY_RUN_MODEL

    cfg = {
        "model": {"tiny": TINY_RUN_MODEL},
        "tokenizer": {"path": str(tmp_path / "tok"), "vocab_size": 300},
        "data": {"task": "tool_arithmetic", "batch_size": 1},
        "rollout": {"group_size": 4, "max_prompt_len": 48, "max_response_len": 16, "slots": 8},
        "optim": {"micro_batch_size": 2},
        "trainer": {"checkpoint_dir": str(tmp_path / "ckpt"), "log_dir": str(tmp_path / "logs")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_plan_command_says_whether_the_run_fits_and_the_largest_micro_batch(
    tmp_path, capsys, monkeypatch
):
    # The command's logic on figures that grow with the micro-batch (compiling is tested above
    # and end to end below): 1 MiB per row in the RL step.
    from jaxrl_tools.cli import main

    calls = []

    def figures(settings, *, functions=plan.FUNCTIONS, **kw):
        micro_batch_size = settings.optim.micro_batch_size
        calls.append((micro_batch_size, functions))
        m = plan.Memory(arguments=micro_batch_size << 20, outputs=0, temporaries=0, aliased=0)
        return {f: m for f in functions}

    monkeypatch.setattr(run_plan, "plan_memory", figures)
    path = _run_config(tmp_path)
    assert main(["plan", "--config", str(path), "--memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh 1x1x1 (data x fsdp x tensor), per device:" in out
    assert out.count("fits in 4.00 GiB") == 2, out
    # 4 rows a step: micro-batches of 1, 2 and 4 are tried (the RL step), all fit.
    assert "largest optim.micro_batch_size that fits: 4 (configured: 2)" in out
    assert calls == [(2, plan.FUNCTIONS)] + [(b, ("update",)) for b in (1, 2, 4)]

    assert main(["plan", "--config", str(path), "--memory-gib", "0.0001"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit in 0.00 GiB" in out
    assert "largest optim.micro_batch_size that fits: 0" in out

    assert main(["plan", "--config", str(path), "--mesh", "1x8x1"]) == 2
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in capsys.readouterr().err


def test_train_and_check_refuse_a_run_that_cannot_fit(tmp_path, capsys, monkeypatch):
    # On an accelerator `device_memory` is its bytes_limit; pretend one of 1 MiB.
    from jaxrl_tools import run
    from jaxrl_tools.config import ConfigError
    from jaxrl_tools.config_loader import load_config

    monkeypatch.setattr(run_plan, "device_memory", lambda: 2**20)
    # The tiny run's real figures are well over 1 MiB; faked here (compiling is tested above).
    # The RL step is the phase that does not fit by the most.
    m = plan.Memory(arguments=2**21, outputs=0, temporaries=0, aliased=0)
    step = dataclasses.replace(m, arguments=2**30)
    monkeypatch.setattr(run_plan, "plan_memory", lambda *a, **kw: {"update": step, "decode": m})
    cfg = load_config(_run_config(tmp_path), [])
    try:
        plan.check_fits(cfg, None)
    except ConfigError as e:
        message = str(e)
    else:
        raise AssertionError("a 1 MiB device took the run")
    assert re.match(r"the run does not fit: its update step needs", message)
    assert "optim.micro_batch_size" in message and "\n" not in message
    monkeypatch.setattr(run.check, "preflight", lambda cfg, **kw: None)  # no tokenizer here
    with pytest.raises(ConfigError, match="does not fit"):
        run.train(cfg)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


def test_decode_on_a_rollout_mesh_of_its_own(tmp_path):
    """`rollout.mesh`: the decode step planned beside a 1x8x1 update on its own 4x1x2 mesh is the
    decode step planned on 4x1x2 itself, and the engine's resharded copy of the weights is
    counted (with one mesh, float32 weights are decoded in place: no copy). 8 simulated devices,
    in a subprocess (this file as a script)."""
    r = run_on_8_devices(__file__, tmp_path, timeout=300)
    assert r["own"] == r["alone"] != r["trainer"]
    assert r["serving_same_mesh"] == 0 and r["serving_own"] == r["params_per_device_own"] > 0


def _main(out_dir: str) -> None:
    """Plans the tiny model's decode step on 8 devices (see the test above)."""
    from pathlib import Path

    assert jax.device_count() == 8
    cfg = tiny_model_config()
    train, own = sharding.make_mesh((1, 8, 1)), sharding.make_mesh((4, 1, 2))
    shapes = dict(rows=8, seq_len=16, slots=8, cache_len=32)
    settings = plan.grpo_settings(cfg, micro_batch_size=8)

    def decode(mesh, decode_mesh=None):
        figures = plan.plan_memory(
            settings, mesh=mesh, functions=("decode",), decode_mesh=decode_mesh, **shapes
        )
        return [figures["decode"].arguments, figures["decode"].temporaries]

    params = models.param_shapes(cfg)
    own_sh = sharding.tree_shardings(models.logical_axes(cfg), own, shapes=params)
    report = {
        "own": decode(train, own),
        "alone": decode(own),
        "trainer": decode(train),
        "serving_same_mesh": plan.resident_bytes(settings, mesh=train)["serving"],
        "serving_own": plan.resident_bytes(settings, mesh=train, decode_mesh=own)["serving"],
        "params_per_device_own": plan.memory._device_bytes(params, own_sh),
    }
    Path(out_dir, "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _main(sys.argv[1])


def test_the_planned_step_is_the_trained_step(monkeypatch):
    """`plan` compiles the very function the trainer runs: one `RLStep` object, for a run with
    truncated importance weights, packed rows and a critic."""
    from fakes import TINY_RUN_MODEL, fixed_batch

    from jaxrl_tools import run, step_config
    from jaxrl_tools.config_loader import config_from_dict
    from jaxrl_tools.train.step import RLStep

    cfg = config_from_dict(
        {
            "model": {"tiny": TINY_RUN_MODEL},
            "tokenizer": {"path": "unused", "vocab_size": 300},
            "data": {"batch_size": 2},
            "rollout": {"group_size": 4, "max_prompt_len": 16, "max_response_len": 16},
            "algorithm": {"adv_estimator": "gae", "kl_coef": 0.0, "tis_cap": 2.0},
            "critic": {"enabled": True},
            "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
            "optim": {"micro_batch_size": 2, "pack": True},
        }
    )
    used = {"lowered": [], "called": []}
    lower, call = RLStep.lower, RLStep.__call__
    monkeypatch.setattr(RLStep, "lower", lambda s, *a: used["lowered"].append(s) or lower(s, *a))
    monkeypatch.setattr(RLStep, "__call__", lambda s, *a: used["called"].append(s) or call(s, *a))
    mesh = sharding.make_mesh((1, 1, 1))
    figures = plan.plan_run(cfg, mesh).figures
    assert figures["update"].arguments > 0

    model_cfg = step_config.model_config(cfg)
    trainer = run.make_trainer(
        cfg, model_cfg, models.init_params(model_cfg, jax.random.key(0)), mesh
    )
    batch = fixed_batch(cfg, trainer.rows)
    metrics = trainer.step(batch)
    want = {"actor/off_policy/is_weight_mean", "critic/loss", "packing/rows"}
    assert want <= set(metrics), metrics
    assert used["lowered"] == used["called"] == [trainer.step_fn]
    assert used["lowered"][0] is used["called"][0] is step_config.run_step(cfg, mesh)


def test_the_planned_decode_step_is_the_engines_decode_step(monkeypatch):
    """`plan` compiles the very decode step the engine runs: one `DecodeStep` object, the
    engine's `decode_step` (from `make_decode_step`), which its `generate_steps` calls."""
    import numpy as np

    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.decode_step import DecodeStep, make_decode_step

    used = {"lowered": [], "called": []}
    lower, call = DecodeStep.lower, DecodeStep.__call__
    record = lambda key, fn: lambda s, *a, **kw: used[key].append(s) or fn(s, *a, **kw)  # noqa: E731
    monkeypatch.setattr(DecodeStep, "lower", record("lowered", lower))
    monkeypatch.setattr(DecodeStep, "__call__", record("called", call))
    cfg, mesh = tiny_model_config(), sharding.make_mesh((1, 1, 1))
    figures = plan.plan_memory(
        plan.grpo_settings(cfg),
        mesh=mesh,
        rows=1,
        seq_len=16,
        slots=4,
        cache_len=32,
        functions=("decode",),
    )
    assert figures["decode"].arguments > 0

    engine = EngineCore(cfg, slots=4, max_len=32, max_prefill_length=16, mesh=mesh)
    params = models.init_params(cfg, jax.random.key(0))
    prefix = engine.prefill(params=params, padded_tokens=np.array([5, 6, 7]), true_length=3)
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    state, out = engine.generate_steps(params, state, 2)
    assert out.valid[0].all() and not out.valid[1:].any()
    assert used["lowered"] == used["called"] == [engine.decode_step]
    # One object per (config, cache length, hook, mesh, rules): another mesh traces its own.
    assert engine.decode_step is make_decode_step(cfg, 32, None, mesh)
    assert make_decode_step(cfg, 32, None, None) is not engine.decode_step


_DECODE_ON_8 = """
import json, sys
sys.path.insert(0, {tests!r})
import jax
from fakes import tiny_model_config
from jaxrl_tools import models, plan, sharding
cfg = tiny_model_config()
mesh = sharding.make_mesh((1, 8, 1), jax.devices()[:8])
m = plan.Memory.of(
    plan.lower_decode(cfg, models.DTypePolicy(compute="bfloat16"), slots=8, cache_len=4096,
                      mesh=mesh).compile()
)
cache = models.cache_bytes(cfg, 8, 4096, "bfloat16")
json.dump(dict(arguments=m.arguments, aliased=m.aliased, cache=cache),
          open(sys.argv[1] + "/report.json", "w"))
"""


def test_decode_plan_shards_the_kv_cache_over_the_mesh(tmp_path):
    # The engine makes its cache sharded (`models.init_cache` on a mesh); `lower_decode` once
    # took the cache's sharding from `jax.eval_shape`, which keeps none: every device held the
    # whole cache in the plan (and the step's donated cache was not aliased).
    from pathlib import Path

    from fakes import run_on_8_devices

    script = tmp_path / "decode.py"
    script.write_text(_DECODE_ON_8.format(tests=str(Path(__file__).parent)))
    r = run_on_8_devices(str(script), tmp_path, timeout=300)
    assert r["arguments"] < r["cache"] / 8 + 2**20, r  # a slot row per device, + small state
    assert r["aliased"] >= r["cache"] / 8, r  # the cache shard is updated in place
