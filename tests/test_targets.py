"""jaxrl_tools.targets and `plan --accelerator`: the accelerator registry, the deviceless
compilers (skipped without the aot-tpu / aot-gpu extras), the HLO cost walker and the fallback
to the CPU compiler's estimate."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import tiny_model_config
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_tools import models, plan, sharding, targets
from jaxrl_tools.config import AlgorithmSection, ConfigError
from jaxrl_tools.models import attention as attn_lib
from jaxrl_tools.plan import run_plan
from jaxrl_tools.targets import compilers
from jaxrl_tools.train.step_inputs import full_batch, step_inputs


def _needs(platform: str):
    tc = targets.toolchain(platform)
    return pytest.mark.skipif(not tc.installed, reason=tc.detail)


# ------------------------------------------------------------------------------ the registry


def test_registry_figures_are_the_published_ones_with_their_source():
    acc = targets.ACCELERATORS
    assert set(acc) == {"h100-80g", "h200", "v5e", "v5p", "v6e"}
    assert {a.platform for a in acc.values()} == {"cuda", "tpu"}
    for a in acc.values():
        assert a.hbm_bytes > 10 * 2**30 and a.peak_flops > 1e14 and a.hbm_bandwidth > 5e11
        # the ridge point (FLOPs per HBM byte) of every one of these parts is 160-600
        assert 150 < a.peak_flops / a.hbm_bandwidth < 600, a.name
        vendor = "NVIDIA" if a.platform == "cuda" else "Google Cloud TPU"
        assert vendor in a.source and a.source.count(",") >= 2
        n = targets.topology_devices(a.default_topology)
        assert a.topology_for(n) == a.default_topology
    assert acc["h100-80g"].hbm_bytes == 80 * 10**9 and acc["h200"].hbm_bandwidth == 4.8e12
    assert acc["v5p"].peak_flops == 459e12 and acc["v6e"].hbm_bytes == 32 * 2**30
    assert acc["h100-80g"].compiler == "XLA:GPU (deviceless, H100 80GB)"
    assert acc["v5p"].compiler == "TPU compiler (v5p)"


def test_topologies_of_a_mesh_size_and_of_hosts():
    h100, v5p, v5e = (targets.ACCELERATORS[n] for n in ("h100-80g", "v5p", "v5e"))
    assert h100.topology_for(8) == "1x1x8" and h100.topology_for(32) == "1x4x8"
    assert h100.topology_for(2) == "1x1x2" and h100.topology_for(12) is None
    assert v5p.topology_for(64) == "v5p:4x4x4" and v5p.topology_for(12) is None
    assert v5e.topology_for(16) == "v5e:4x4"
    assert targets.resolve_topology(v5p, "4x4x4", None, 32) == "v5p:4x4x4"  # as given
    assert targets.resolve_topology(v5p, None, 16, None) == "v5p:4x4x4"  # 16 hosts of 4
    assert targets.resolve_topology(h100, None, 4, None) == "1x4x8"
    assert targets.resolve_topology(h100, None, None, 32) == "1x4x8"  # the mesh's size
    assert targets.resolve_topology(v5e, None, None, None) == "v5e:2x2"  # the default
    with pytest.raises(targets.TargetUnavailable, match="--topology"):
        targets.resolve_topology(v5p, None, 3, None)


def test_gpu_target_configs_describe_the_parts():
    for name, bandwidth, description in (
        ("h100-80g", 3350000000000, "NVIDIA H100 80GB HBM3"),
        ("h200", 4800000000000, "NVIDIA H200"),
    ):
        text = targets.gpu_target_config(name)
        a = targets.ACCELERATORS[name]
        for field in (
            "core_count: 132",
            "fpus_per_core: 128",
            "clock_rate_ghz: 1.98",
            f"memory_bandwidth: {bandwidth}",
            f"device_memory_size: {a.hbm_bytes}",
            "l2_cache_size: 52428800",
            "shared_memory_per_core: 233472",
            "major: 9\n    minor: 0",
            'platform_name: "CUDA"',
            f'device_description_str: "{description}"',
        ):
            assert field in text, (name, field)
        assert text.count("{") == text.count("}")
    with pytest.raises(ValueError, match="not a GPU"):
        targets.gpu_target_config("v5p")


def test_toolchain_says_how_to_install_what_is_missing(monkeypatch):
    monkeypatch.setattr(compilers.importlib.util, "find_spec", lambda name: None)
    tpu, gpu = targets.toolchain("tpu"), targets.toolchain("cuda")
    assert not tpu.installed and "pip install 'jaxrl-tools[aot-tpu]'" in tpu.detail
    assert not gpu.installed and "pip install 'jaxrl-tools[aot-gpu]'" in gpu.detail
    with pytest.raises(targets.TargetUnavailable, match=r"aot-tpu"):
        targets.target_devices("v5e")


# ------------------------------------------------------------------------------ HLO costs


def _scan(x, w):
    def body(c, wi):
        return jnp.tanh(c @ wi), None

    return jax.lax.scan(body, x, w)[0]


def test_hlo_cost_counts_each_loop_iteration_that_xla_counts_once():
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((6, 512, 512), jnp.bfloat16)
    compiled = jax.jit(_scan).lower(x, w).compile()
    one = 2 * 256 * 512 * 512
    cost = targets.hlo_cost(compiled.as_text())
    assert cost.flops == 6 * one and cost.unknown_loops == 0
    # XLA's own analysis counts the body once: the reason `plan` walks the HLO itself.
    assert compiled.cost_analysis()["flops"] < 1.1 * one
    # Each iteration reads its layer's slice of w, not all of w: about w once in all.
    assert 6 * 512 * 512 * 2 <= cost.bytes < 40 * 6 * 512 * 512 * 2

    # No loop: the same matmul FLOPs as XLA's (which adds the elementwise ones).
    single = jax.jit(lambda x, w: jnp.tanh(x @ w[0])).lower(x, w).compile()
    c1 = targets.hlo_cost(single.as_text())
    assert c1.flops == one
    assert one <= single.cost_analysis()["flops"] < 1.05 * one


def test_hlo_cost_of_fusions_reads_slices_and_writes_updates(monkeypatch):
    # dynamic-update-slice of one row into a big buffer (in place): the row is the traffic
    big = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)
    row = jax.ShapeDtypeStruct((1, 1024), jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    f = jax.jit(lambda b, r, i: jax.lax.dynamic_update_slice(b, r * 2, (i, 0)), donate_argnums=0)
    cost = targets.hlo_cost(f.lower(big, row, i).compile().as_text())
    assert cost.bytes < 64 * 1024 * 4, cost  # not the 16 MiB buffer
    g = jax.jit(lambda b, i: jax.lax.dynamic_slice(b, (i, 0), (8, 1024)) * 2)
    cost = targets.hlo_cost(g.lower(big, i).compile().as_text())
    assert cost.bytes < 64 * 1024 * 4, cost


def test_floor_is_the_slower_of_compute_and_memory():
    h100 = targets.ACCELERATORS["h100-80g"]
    fl = plan.Floor.of(targets.Cost(flops=989e12, bytes=1.0), h100)
    assert fl.bound == "compute" and fl.seconds == pytest.approx(1.0)
    fl = plan.Floor.of(targets.Cost(flops=1.0, bytes=6.7e12), h100)
    assert fl.bound == "memory" and fl.seconds == pytest.approx(2.0)


# ------------------------------------------------------------------------------ attention


def test_attention_auto_resolves_for_the_platform_of_the_mesh_it_is_placed_on():
    pick = lambda **kw: attn_lib.select_impl(  # noqa: E731 - a training forward's attention
        "auto", T=256, S=256, Dh=128, dtype=jnp.bfloat16, has_lengths=True, **kw
    )
    assert pick(platform="gpu") == "cudnn" and pick(platform="tpu") == "pallas"
    assert pick(platform="cpu") == "dense"
    # no mesh: jax's default backend; inside `use_mesh`: the mesh's devices' platform (a
    # target's compile-only devices when planning for one: the compiler tests below)
    assert attn_lib.compute_platform() == jax.default_backend()
    with sharding.use_mesh(sharding.make_mesh((1, 1, 1), jax.devices("cpu")[:1])):
        assert attn_lib.compute_platform() == "cpu" and pick() == "dense"


# ------------------------------------------------------------------------------ the command


def test_plan_without_the_toolchain_falls_back_to_the_cpu_estimate(tmp_path, capsys, monkeypatch):
    from test_plan import _run_config

    from jaxrl_tools.cli import main

    monkeypatch.setattr(
        targets, "toolchain", lambda p: targets.Toolchain(False, f"{p} missing: pip install x")
    )
    m = plan.Memory(arguments=1 << 20, outputs=0, temporaries=0, aliased=0)
    monkeypatch.setattr(run_plan, "plan_memory", lambda s, *, functions=plan.FUNCTIONS, **kw: {
        f: m for f in functions
    })  # fmt: skip
    path = _run_config(tmp_path)
    assert main(["plan", "--config", str(path), "--accelerator", "v5p"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "TPU compiler (v5p): tpu missing: pip install x; below, the CPU compiler's estimate"
    )
    assert out[1] == "figures of the CPU compiler (an estimate):"
    assert "fits in 95.00 GiB" in out[3]
    assert main(["plan", "--config", str(path), "--topology", "v5p:2x2x1"]) == 2
    assert "--accelerator" in capsys.readouterr().err


def test_a_mesh_that_is_not_the_slice_is_refitted_or_one_line(tmp_path, monkeypatch):
    from test_plan import _run_config

    from jaxrl_tools.config_loader import load_config

    cfg = load_config(_run_config(tmp_path), ["trainer.mesh=1x2x1"])
    calls = []
    monkeypatch.setattr(
        targets, "target_devices", lambda name, topo: calls.append(topo) or [object()] * 6
    )
    # --mesh is the user's own: a slice of another size is an error naming it
    with pytest.raises(ConfigError, match=r"--mesh 1x2x1 is 2 devices .* 1x1x6 has 6: .* or "):
        plan.plan_target(
            cfg, "h100-80g", topology="1x1x6", mesh_shape=(1, 2, 1), mesh_name="--mesh"
        )
    # trainer.mesh whose data x tensor does not divide the slice: the same
    bad = load_config(_run_config(tmp_path), ["trainer.mesh=1x1x4"])
    with pytest.raises(ConfigError, match=r"trainer.mesh 1x1x4 is 4 devices .* 1x1x6 has 6"):
        plan.plan_target(bad, "h100-80g", topology="1x1x6")
    assert calls == ["1x1x6", "1x1x6"]
    # else its fsdp axis is resized, keeping each micro-batch's rows per device where the
    # step's 4 rows allow (micro-batch 2 on 2 devices: 1 row each)
    refit, note = run_plan._refit(cfg, (1, 2, 1), (1, 4, 1), "v5e:2x2")
    assert refit.trainer.mesh_shape == (1, 4, 1) and refit.optim.micro_batch_size == 4
    assert note == (
        "trainer.mesh 1x2x1 is 2 devices and v5e:2x2 has 4: planned on 1x4x1 (fsdp resized; "
        "optim.micro_batch_size 2 -> 4, 1 row per device)"
    )


def test_a_compiler_out_of_memory_is_a_run_that_does_not_fit():
    v5p = targets.ACCELERATORS["v5p"]
    oom = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (236.26G) exceeds available HBM (95.74G)."
    )
    line = run_plan._refusal(v5p, oom)
    assert line.startswith("plan: the run does not fit: the TPU compiler (v5p) ran out of")
    assert "(236.26G)" in line and line.endswith("or widen trainer.mesh")
    other = run_plan._refusal(v5p, TypeError("bad"))
    assert other == "plan: the TPU compiler (v5p) refused the run's steps: TypeError: bad"


def test_the_micro_batch_search_stops_where_the_compiler_runs_out_of_memory(tmp_path, monkeypatch):
    from test_plan import _run_config

    from jaxrl_tools.config_loader import load_config

    def figures(settings, *, functions=plan.FUNCTIONS, **kw):
        if settings.optim.micro_batch_size > 2:  # what the TPU compiler does past its HBM
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total ...")
        m = plan.Memory(arguments=1 << 20, outputs=0, temporaries=0, aliased=0)
        return {f: m for f in functions}

    monkeypatch.setattr(run_plan, "plan_memory", figures)
    cfg = load_config(_run_config(tmp_path), [])
    p = plan.plan_run(cfg, sharding.make_mesh((1, 1, 1), jax.devices()[:1]), 2**30, search=True)
    assert p.fits and p.largest_micro_batch == 2


# ------------------------------------------------------------------------------ the compilers


def _tiny_plan(devices, head_dim=8, attention="auto", rows=None, seq_len=128, kl=0.0):
    """The tiny Qwen2's RL step and decode step compiled for `devices` (fsdp over them); with
    `kl`, the step also runs the reference policy's log-prob forward."""
    cfg = dataclasses.replace(tiny_model_config(), head_dim=head_dim)
    mesh = sharding.make_mesh((1, -1, 1), devices)
    settings = plan.grpo_settings(
        cfg,
        dtypes=models.DTypePolicy(compute="bfloat16"),
        micro_batch_size=len(devices),
        attention=attention,
        algorithm=AlgorithmSection(kl_coef=kl),
    )
    compiled = {}
    figures = plan.plan_memory(
        settings,
        mesh=mesh,
        rows=rows or 2 * len(devices),
        seq_len=seq_len,
        slots=len(devices),
        cache_len=256,
        compiled=compiled,
    )
    return cfg, figures, compiled


def _check_tiny(cfg, figures, compiled, accelerator, n_devices):
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(cfg)))
    # fp32 weights and AdamW moments, split over the devices (TPU tiles pad small arrays)
    assert figures["update"].arguments >= 12 * n / n_devices
    assert figures["update"].aliased > 0  # the state is donated
    assert figures["decode"].arguments > 0 and all(m.peak > 0 for m in figures.values())
    fl = plan.floors(compiled, accelerator)
    # The update's matmul FLOPs: at least forward and backward of every weight matmul
    # (2 + 4 per weight and token; the logits' embedding counted once), per device.
    tokens = 2 * n_devices * 128
    assert (
        fl["update"].cost.flops >= 6 * (n - cfg.vocab_size * cfg.hidden_size) * tokens / n_devices
    )
    assert fl["update"].cost.unknown_loops == 0 and fl["decode"].cost.bytes > 0
    assert all(f.seconds > 0 for f in fl.values())


@pytest.mark.target_compiler
@_needs("tpu")
def test_tpu_compiler_plans_the_tiny_model_on_v5e_2x2():
    devices = targets.target_devices("v5e", "v5e:2x2")
    assert len(devices) == 4 and devices[0].device_kind.startswith("TPU v5")
    cfg, figures, compiled = _tiny_plan(devices)
    _check_tiny(cfg, figures, compiled, targets.ACCELERATORS["v5e"], 4)
    assert "tpu_custom_call" not in compiled["update"].as_text()  # head_dim 8: no Pallas
    # The same step's FLOPs as the CPU compiler's program (one device, 4x the rows each): the
    # TPU's loops carry no trip count (read from their counters: start, step, bound) and its
    # batched matmuls are dilated convolutions (only the taps that meet a value count).
    _, _, on_cpu = _tiny_plan(jax.devices("cpu")[:1], rows=8)
    tpu = targets.hlo_cost(compiled["update"].as_text()).flops
    assert 4 * tpu == pytest.approx(targets.hlo_cost(on_cpu["update"].as_text()).flops, rel=0.02)
    (one,) = targets.target_devices("v5e", "v5e:1x1")
    s = NamedSharding(Mesh(np.array([one]), ("a",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=s)
    w = jax.ShapeDtypeStruct((6, 512, 512), jnp.bfloat16, sharding=s)
    cost = targets.hlo_cost(jax.jit(_scan).lower(x, w).compile().as_text())
    assert cost.flops == 6 * 2 * 256 * 512 * 512 and cost.unknown_loops == 0


@pytest.mark.target_compiler
@_needs("tpu")
def test_tpu_auto_attention_is_the_pallas_kernel_inside_the_sharded_step():
    # "auto" on TPU devices (head_dim 128, T % 128 == 0) is the Pallas flash kernel, in the
    # update's forward and backward: on one chip, and on four, where it runs inside a
    # shard_map (the compiler cannot partition a Mosaic kernel itself).
    for topology in ("v5e:1x1", "v5e:2x2"):
        devices = targets.target_devices("v5e", topology)
        _, figures, compiled = _tiny_plan(devices, head_dim=128)
        text = compiled["update"].as_text()
        assert text.count("tpu_custom_call") >= 2, topology  # the kernel's forward, backward
        assert "tpu_custom_call" not in compiled["decode"].as_text()  # cache reads: XLA
        assert figures["update"].peak > 0


@pytest.mark.target_compiler
@_needs("cuda")
def test_xla_gpu_plans_the_tiny_model_on_8_h100s_with_cudnn_attention():
    targets.prepare("cuda")
    devices = targets.target_devices("h100-80g", "1x1x8")
    assert len(devices) == 8 and devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    cfg, figures, compiled = _tiny_plan(devices)
    _check_tiny(cfg, figures, compiled, targets.ACCELERATORS["h100-80g"], 8)
    # fsdp over 8 GPUs: the weights are gathered and the gradients reduced across them
    moved = targets.hlo_cost(compiled["update"].as_text()).collective_bytes
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(cfg)))
    assert moved >= 2 * n * 7 / 8, (moved, n)  # at least every bf16 weight gathered once
    # "auto" resolved for the GPU: cuDNN flash attention in the update (bf16, head_dim 128),
    # the reference log-prob forward's included (KL in the loss): forward, forward, backward
    _, _, compiled = _tiny_plan(devices, head_dim=128, kl=0.01)
    assert compiled["update"].as_text().count("__cudnn$fmha") >= 3
    cost = targets.hlo_cost(compiled["update"].as_text())
    assert cost.flops > 0 and cost.unknown_loops == 0


@pytest.mark.target_compiler
@pytest.mark.parametrize(
    "platform, accelerator, topology, kernel",
    [("tpu", "v5e", "v5e:2x2", "tpu_custom_call"), ("cuda", "h100-80g", "1x1x4", "__cudnn$fmha")],
)
def test_shared_prompt_rows_compile_for_the_target_with_its_kernel_on_prompt_and_samples(
    platform, accelerator, topology, kernel
):
    """`optim.share_prefix` rows, compiled by the target's own compiler: the prompt slot (256
    tokens, head_dim 128) and the samples (each gathered into a row of its own) run the
    target's flash kernel; the step fits and costs work."""
    tc = targets.toolchain(platform)
    if not tc.installed:
        pytest.skip(tc.detail)
    if platform == "cuda":
        targets.prepare("cuda")
    devices = targets.target_devices(accelerator, topology)
    cfg = dataclasses.replace(tiny_model_config(), head_dim=128)
    settings = plan.grpo_settings(
        cfg, dtypes=models.DTypePolicy(compute="bfloat16"), micro_batch_size=len(devices)
    )
    # 8 rows of the same 256-token context and 256-token samples: slots of 256 and 2 x 272
    optim = dataclasses.replace(settings.optim, share_prefix=True, pack_width=1024)
    settings = dataclasses.replace(settings, optim=optim, group_size=8)
    rows = step_inputs(full_batch(8, 512, group_size=8), settings)[0]["rows"]
    assert rows["tokens"].shape == (4, 256 + 2 * 272) and rows["prompt_keys"].shape == (4, 2, 256)
    compiled = {}
    mesh = sharding.make_mesh((1, -1, 1), devices)
    figures = plan.plan_memory(
        settings, mesh=mesh, rows=8, seq_len=512, slots=4, cache_len=256, compiled=compiled
    )
    text = compiled["update"].as_text()
    # forward and backward, of the prompt slot and of the samples (XLA on the samples: 2 and 3)
    assert text.count(kernel) >= 4
    assert figures["update"].peak > 0 and targets.hlo_cost(text).flops > 0


@pytest.mark.target_compiler
@_needs("cuda")
def test_hlo_cost_counts_cublas_gemms_of_a_gpu_program():
    targets.prepare("cuda")
    (device,) = targets.target_devices("h100-80g", "1x1x1")
    s = NamedSharding(Mesh(np.array([device]), ("a",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=s)
    w = jax.ShapeDtypeStruct((6, 1024, 1024), jnp.bfloat16, sharding=s)
    compiled = jax.jit(_scan).lower(x, w).compile()
    assert compiled.cost_analysis() is None  # XLA:GPU's deviceless executables have none
    cost = targets.hlo_cost(compiled.as_text())
    assert cost.flops == 6 * 2 * 512 * 1024 * 1024 and cost.collective_bytes == 0


@pytest.mark.target_compiler
@_needs("tpu")
def test_plan_command_on_the_tpu_compiler(tmp_path, capsys):
    from test_plan import _run_config

    from jaxrl_tools.cli import main

    path = _run_config(tmp_path)  # trainer.mesh 1x1x1: one v5e chip
    assert main(["plan", "--config", str(path), "--accelerator", "v5e"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "figures of the TPU compiler (v5e) for v5e:1x1 (1 device):", out
    assert "fits in 16.00 GiB" in out[2] and "fits in 16.00 GiB" in out[3]
    assert out[-3].startswith("roofline floor per device on TPU v5e (197 TFLOP/s bf16")
    assert out[-2].startswith("  update ") and "per RL step" in out[-2]
    assert out[-1].startswith("  decode ") and "per decode step" in out[-1]
    # a slice of 4 chips: trainer.mesh refitted to it, said first
    assert main(["plan", "--config", str(path), "--accelerator", "v5e", "--hosts", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("trainer.mesh 1x1x1 is 1 devices and v5e:2x2 has 4: planned on 1x4x1")
    assert out[1] == "figures of the TPU compiler (v5e) for v5e:2x2 (4 devices):", out
