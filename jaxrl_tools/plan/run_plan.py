"""A run's plan: its config's steps compiled on its mesh, what each phase needs per device,
whether that fits, and each step's floor on an accelerator.

`plan_run` compiles on a given mesh (this host's devices, or a real accelerator's); `plan_target`
on the compile-only devices of an accelerator (its own compiler, without it: `targets`);
`plan_command` is `jaxrl-tools plan`: the target's compiler where it is installed, else the CPU
compiler's estimate, saying so. `check` and `train` refuse a run whose plan does not fit an
accelerator's memory (`check_fits`). The run's step comes from `step_config.run_step(cfg)`, the
mapping `run.make_trainer` uses too: the step planned is the step trained.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxrl_tools import sharding, targets
from jaxrl_tools.check import check_batch
from jaxrl_tools.config import ConfigError
from jaxrl_tools.plan.memory import (
    largest_fitting_micro_batch,
    phase_totals,
    plan_memory,
    resident_bytes,
)
from jaxrl_tools.plan.report import RunPlan, floors
from jaxrl_tools.step_config import run_shapes, run_step


def plan_run(
    cfg,
    mesh,
    hbm: int | None = None,
    search: bool = False,
    *,
    accelerator: targets.Accelerator | None = None,
    compiler: str | None = None,
    notes: tuple[str, ...] = (),
) -> RunPlan:
    """Compiles the run's RL step and decode step on abstract shapes for `mesh`'s devices (no
    weights); attention "auto" resolves for their platform (`models.attention.select_impl`).

    With `search`, also finds the largest micro-batch that fits in `hbm` (one compile of the
    step per doubling). With `accelerator`, each step's roofline floor on it (from the
    executables' HLO); `compiler` labels the figures, `notes` come first."""
    shape = tuple(mesh.shape[a] for a in mesh.axis_names)
    check_batch(cfg, shape)  # a batch that does not split: the one-line error, before compiling
    step = run_step(cfg, mesh)
    settings, shapes = step.settings, run_shapes(cfg)
    decode_mesh = None
    if cfg.rollout.mesh_shape is not None:  # the engine's mesh, over the same devices
        decode_mesh = sharding.make_mesh(cfg.rollout.mesh_shape, list(mesh.devices.flat))
    compiled = {}
    figures = plan_memory(settings, mesh=mesh, decode_mesh=decode_mesh, compiled=compiled, **shapes)
    step_floors = None if accelerator is None or not compiled else floors(compiled, accelerator)
    del compiled
    resident = resident_bytes(
        settings, mesh=mesh, lora_decode=cfg.model.lora.decode, decode_mesh=decode_mesh
    )
    totals = phase_totals(figures, resident)
    largest = None
    if search and hbm is not None:
        width = shape[0] * shape[1]  # rows of a micro-batch split over data x fsdp
        n_mini = settings.optim.num_mini_batches

        def fits(b: int) -> bool:
            # The micro-batch changes the RL step, not decoding; rows rounded up to split.
            trial = dataclasses.replace(
                settings, optim=dataclasses.replace(settings.optim, micro_batch_size=b)
            )
            rows = -(-shapes["rows"] // (n_mini * b)) * n_mini * b
            try:
                trial_figures = plan_memory(
                    trial, mesh=mesh, **dict(shapes, rows=rows), functions=("update",)
                )
            except Exception as e:  # noqa: BLE001 - out of memory: this micro-batch does not fit
                if _out_of_memory(e):
                    return False
                raise
            trial_figures["decode"] = figures["decode"]
            return max(phase_totals(trial_figures, resident).values()) <= hbm

        rows_per_mini = shapes["rows"] // n_mini
        largest = largest_fitting_micro_batch(fits, width, max(rows_per_mini, width))
    return RunPlan(
        figures,
        totals,
        shape,
        hbm,
        settings.optim.micro_batch_size,
        largest,
        cfg.rollout.mesh_shape,
        compiler=compiler,
        accelerator=accelerator,
        floors=step_floors,
        notes=tuple(notes),
    )


def plan_target(
    cfg,
    accelerator: str,
    *,
    topology: str | None = None,
    hosts: int | None = None,
    mesh_shape: tuple[int, int, int] | None = None,
    mesh_name: str = "trainer.mesh",
    search: bool = False,
) -> RunPlan:
    """`plan_run` with the accelerator's own compiler, without the accelerator: the run's mesh
    (`mesh_shape`, default trainer.mesh; rollout.mesh for decoding) over the compile-only
    devices of `topology` (default: `hosts` full hosts, else the slice of the mesh's size, else
    the accelerator's default slice), judged against its HBM, with each step's floor. A slice
    of another size than trainer.mesh gets the mesh's fsdp axis resized to it (`_refit`, said
    in the plan's first line).

    Raises:
      targets.TargetUnavailable: the compiler is not installed or gives no devices.
      ConfigError: `mesh_shape` (--mesh) does not multiply to the slice's device count, or
        trainer.mesh cannot be refitted to it (the slice's devices not a multiple of its data x
        tensor), or the compiler refuses a step (one line each).
    """
    a = targets.ACCELERATORS[accelerator]
    shape = cfg.trainer.mesh_shape if mesh_shape is None else tuple(mesh_shape)
    wanted = None if shape is None else math.prod(shape)
    topo = targets.resolve_topology(a, topology, hosts, wanted)
    devices = targets.target_devices(accelerator, topo)
    if shape is None:  # trainer.mesh auto: fsdp over the whole slice
        shape = (1, len(devices), 1)
    notes = ()
    if math.prod(shape) != len(devices):
        d, _, t = shape
        if mesh_name != "trainer.mesh" or len(devices) % (d * t):
            text = "x".join(map(str, shape))
            other = a.topology_for(math.prod(shape))
            hint = f", or compile for {other}" if other else ""
            raise ConfigError(
                f"plan: {mesh_name} {text} is {math.prod(shape)} devices and {a.label} topology "
                f"{topo} has {len(devices)}: set {mesh_name} to a shape of {len(devices)} "
                f"devices{hint} (--topology / --hosts)"
            )
        cfg, note = _refit(cfg, shape, (d, len(devices) // (d * t), t), topo)
        shape, notes = cfg.trainer.mesh_shape, (note,)
    mesh = sharding.make_mesh(shape, devices)
    try:
        result = plan_run(
            cfg, mesh, a.hbm_bytes, search, accelerator=a, compiler=a.compiler, notes=notes
        )
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the target compiler refused: one line, with the fix
        raise ConfigError(_refusal(a, e)) from e
    n = len(devices)
    return dataclasses.replace(result, topology=f"{topo} ({n} device{'s' * (n > 1)})")


def _refit(cfg, old: tuple, new: tuple, topology: str):
    """The recipe's trainer.mesh refitted to a slice of another size: its fsdp axis resized,
    each micro-batch keeping its rows per device where a mini-batch has as many, decoding on
    the trainer mesh. (cfg, a note)."""
    d, f, _ = old
    width = new[0] * new[1]
    micro, rows = cfg.optim.micro_batch_size, cfg.update_rows // cfg.optim.num_mini_batches
    per = max(micro // (d * f), 1)
    while per > 1 and rows % (per * width):
        per //= 2
    text = lambda s: "x".join(map(str, s))  # noqa: E731
    note = (
        f"trainer.mesh {text(old)} is {math.prod(old)} devices and {topology} has "
        f"{math.prod(new)}: planned on {text(new)} (fsdp resized; optim.micro_batch_size "
        f"{micro} -> {per * width}, {per} row{'s' * (per > 1)} per device"
    )
    if cfg.rollout.mesh is not None:
        note += f"; decoding on the trainer mesh, not rollout.mesh {cfg.rollout.mesh}"
    cfg = dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, mesh=text(new)),
        optim=dataclasses.replace(cfg.optim, micro_batch_size=per * width),
        rollout=dataclasses.replace(cfg.rollout, mesh=None),
    )
    return cfg, note + ")"


def plan_command(
    cfg,
    *,
    mesh_shape: tuple[int, int, int] | None = None,
    mesh_name: str = "trainer.mesh",
    accelerator: str | None = None,
    topology: str | None = None,
    hosts: int | None = None,
    memory_gib: float | None = None,
) -> RunPlan:
    """`jaxrl-tools plan`: with `accelerator`, its own compiler when installed (`plan_target`),
    else the CPU compiler's estimate with a first line saying why and how to install it;
    without, this host's compiler on `mesh_shape` (default trainer.mesh), judged against
    `memory_gib` or the device's memory. The largest fitting micro-batch is searched."""
    a = targets.ACCELERATORS[accelerator] if accelerator else None
    if (topology or hosts) and a is None:
        raise ConfigError("plan: --topology and --hosts name a slice of --accelerator: add it")
    notes = ()
    if a is not None and memory_gib is None:
        toolchain = targets.toolchain(a.platform)
        why = toolchain.detail
        if toolchain.installed:
            targets.prepare(a.platform)
            try:
                return plan_target(
                    cfg,
                    a.name,
                    topology=topology,
                    hosts=hosts,
                    mesh_shape=mesh_shape,
                    mesh_name=mesh_name,
                    search=True,
                )
            except targets.TargetUnavailable as e:
                why = str(e)
        notes = (f"{a.compiler}: {why}; below, the CPU compiler's estimate",)
    if memory_gib is not None:
        hbm = int(memory_gib * 2**30)
    else:
        hbm = a.hbm_bytes if a is not None else device_memory()
    shape = mesh_shape or cfg.trainer.mesh_shape or (1, len(jax.devices()), 1)
    have = len(jax.devices())
    if jax.devices()[0].platform == "cpu" and have < (need := math.prod(shape)):
        raise ConfigError(
            f"plan: {mesh_name} {'x'.join(map(str, shape))} needs {need} devices and this host "
            f"has {have}: run it with XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            "(simulated CPU devices)"
        )
    mesh = sharding.make_mesh(shape, jax.devices()[: math.prod(shape)])
    return plan_run(
        cfg,
        mesh,
        hbm,
        search=True,
        accelerator=a if memory_gib is None else None,
        compiler="CPU compiler (an estimate)" if notes else None,
        notes=notes,
    )


def _out_of_memory(e: Exception) -> bool:
    """The compiler refused a step for memory (the TPU compiler stops where temporaries exceed
    the device's HBM): a run, or a micro-batch, that does not fit."""
    return "RESOURCE_EXHAUSTED" in str(e)


def _refusal(a: targets.Accelerator, e: Exception) -> str:
    message = " ".join(str(e).split())
    if _out_of_memory(e):
        return (
            f"plan: the run does not fit: the {a.compiler} ran out of device memory compiling "
            f"its steps ({message[:240]}): lower optim.micro_batch_size or rollout.slots, set "
            "model.remat: true, or widen trainer.mesh"
        )
    return f"plan: the {a.compiler} refused the run's steps: {type(e).__name__}: {message[:400]}"


def device_memory() -> int | None:
    """Bytes one accelerator can hold (None on a CPU host, where plans are not enforced)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def fit_error(plan: RunPlan) -> str | None:
    """The one-line refusal of a run that does not fit, naming the knobs to turn."""
    if plan.fits:
        return None
    worst = max(plan.totals, key=plan.totals.get)
    knob = {
        "update": "lower optim.micro_batch_size, set model.remat: true, or widen trainer.mesh",
        "decode": "lower rollout.slots, set model.kv_cache_dtype: bfloat16, or widen trainer.mesh",
    }[worst]
    gib = lambda n: f"{n / 2**30:.1f} GiB"
    return (
        f"the run does not fit: its {worst} step needs {gib(plan.totals[worst])} per device "
        f"of {gib(plan.hbm)}: {knob} (details: jaxrl-tools plan --config ...)"
    )


def check_fits(cfg, mesh) -> None:
    """On an accelerator, a ConfigError (one line) when the run's plan does not fit its memory;
    on a CPU host nothing (host memory is not what XLA plans against)."""
    hbm = device_memory()
    if hbm is None:
        return
    error = fit_error(plan_run(cfg, mesh or sharding.make_mesh((1, 1, 1)), hbm))
    if error:
        raise ConfigError(error)
