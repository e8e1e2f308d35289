"""Per-device memory of a run's jitted functions, from compilation on abstract shapes.

`plan_memory` lowers the very RL step the trainer runs (`train.step.make_rl_step` of the same
settings: forwards, advantages, every mini-batch update) and one step of the very decode step the
engine runs (`EngineCore.decode_step`, from `rollout.decode_step.make_decode_step`) on the
engine's own decode state (all slots, reading whole cache rows: full occupancy), on
`jax.ShapeDtypeStruct`s (no weights exist, nothing is allocated), and compiles them: XLA's
`memory_analysis()` of each executable is the memory one device needs for its arguments, outputs
and temporaries. On a CPU host the mesh can be simulated
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`): the figures are those of the CPU
compiler's buffer assignment, an estimate of a GPU/TPU's (which fuses differently).

`plan_target` compiles the same objects with the accelerator's own compiler, without the
accelerator (`targets`: libtpu's TPU compiler, XLA:GPU given an H100's or H200's description),
on a mesh over that target's compile-only devices: its figures are that compiler's buffer
assignment, and each executable's HLO gives the work of one step, whose roofline floor on the
accelerator is printed (`Floor`).

`plan_run` does this for a run config (`jaxrl-tools plan`); `check` and `train` refuse a run
whose plan does not fit an accelerator's memory (`fit_error`). The run's step comes from
`step_config.run_step(cfg)`, the mapping `run.make_trainer` uses too: the step planned is the step
trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import models, sharding, targets
from jaxrl_tools.config import AlgorithmSection, ConfigError, CriticSection, OptimSection
from jaxrl_tools.rollout.engine import EngineCore
from jaxrl_tools.step_config import run_shapes, run_step
from jaxrl_tools.train.step import StepSettings, make_rl_step

FUNCTIONS = ("update", "decode")  # what `plan_memory` compiles: the RL step, a decode step

# Device memory of the accelerators `plan` knows, in bytes (`targets.ACCELERATORS` has the rest).
ACCELERATORS = {name: a.hbm_bytes for name, a in targets.ACCELERATORS.items()}


@dataclasses.dataclass(frozen=True)
class Memory:
    """One compiled function's memory on one device, in bytes."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # outputs written into donated arguments

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled) -> Memory:
        m = compiled.memory_analysis()
        return cls(
            arguments=int(m.argument_size_in_bytes),
            outputs=int(m.output_size_in_bytes),
            temporaries=int(m.temp_size_in_bytes),
            aliased=int(m.alias_size_in_bytes),
        )


def grpo_settings(
    model_cfg: models.ModelConfig,
    *,
    dtypes: models.DTypePolicy | None = None,
    micro_batch_size: int = 1,
    remat: bool | str = False,
    attention: str = "auto",
    lora: models.LoraConfig | None = None,
    algorithm: AlgorithmSection | None = None,
) -> StepSettings:
    """The settings of a plain step (GRPO without KL unless `algorithm` says otherwise, one
    update per batch): what plans of a model alone measure (benchmarks, tests)."""
    return StepSettings(
        model=model_cfg,
        algorithm=algorithm or AlgorithmSection(kl_coef=0.0),
        optim=OptimSection(micro_batch_size=micro_batch_size),
        critic=CriticSection(),
        group_size=1,
        remat=remat,
        dtypes=dtypes or models.DTypePolicy(),
        attention=attention,
        lora=lora,
    )


def lower_decode(
    model_cfg: models.ModelConfig,
    dtypes: models.DTypePolicy,
    *,
    slots: int,
    cache_len: int,
    mesh=None,
    rules=None,
):
    """One step of the engine's own decode step (`EngineCore.decode_step`, the object its
    `generate_steps` calls), all slots sampling and reading whole cache rows, lowered on the
    decode state the engine itself builds (`EngineCore.init_decode_state`) and its serving copy
    of the weights (compute dtype, sharded on the engine's mesh)."""
    engine = EngineCore(
        model_cfg,
        slots=slots,
        max_len=cache_len,
        max_prefill_length=16,
        mesh=mesh,
        rules=rules,
        dtype=dtypes.compute_dtype,
        cache_dtype=dtypes.cache_dtype,
        live_attention=False,  # whole cache rows: full occupancy
        unstack_layers=False,
    )
    state = jax.eval_shape(engine.init_decode_state)
    params = models.param_shapes(model_cfg, dtypes.compute_dtype)
    if mesh is not None:
        params_sh = sharding.tree_shardings(
            models.logical_axes(model_cfg), mesh, rules, shapes=params
        )
        replicated = NamedSharding(mesh, PartitionSpec())
        struct = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
        params = jax.tree.map(struct, params, params_sh)
        state = jax.tree.map(lambda x: struct(x, x.sharding or replicated), state)
        # The cache sharded as `models.init_cache` makes it (`sharding.sharded_init`):
        # jax.eval_shape keeps no sharding of the jitted init's outputs (jax 0.10), which left
        # the whole cache on every device here.
        cache_sh = sharding.tree_shardings(models.cache_axes(), mesh, rules, shapes=state.cache)
        state = state.replace(cache=jax.tree.map(struct, state.cache, cache_sh))
    return engine.decode_step.lower(
        params, state, engine.hook_data, num_steps=1, mode="sample", attend_len=None
    )


def compile_functions(
    settings: StepSettings,
    *,
    mesh,
    rows: int,
    seq_len: int,
    slots: int,
    cache_len: int,
    rules=None,
    functions: tuple[str, ...] = FUNCTIONS,
    decode_mesh=None,
) -> dict:
    """The RL step and a decode step compiled on abstract shapes for `mesh`'s devices (those of
    an accelerator's compiler when they are a target's, `targets.target_devices`): {name:
    jax.stages.Compiled}. Arguments: `plan_memory`'s."""
    lowered = {
        "update": lambda: make_rl_step(settings, mesh, rules).lower_shapes(rows, seq_len),
        "decode": lambda: lower_decode(
            settings.model,
            settings.dtypes,
            slots=slots,
            cache_len=cache_len,
            mesh=mesh if decode_mesh is None else decode_mesh,
            rules=rules,
        ),
    }
    return {name: lowered[name]().compile() for name in functions}


def plan_memory(
    settings: StepSettings,
    *,
    mesh,
    rows: int,
    seq_len: int,
    slots: int,
    cache_len: int,
    rules=None,
    functions: tuple[str, ...] = FUNCTIONS,
    decode_mesh=None,
    compiled: dict | None = None,
) -> dict[str, Memory]:
    """Compiles the RL step and a decode step on abstract shapes.

    Args:
      settings: the step's settings (`step_config.run_step(cfg).settings` for a run,
        `grpo_settings` for a model alone).
      mesh: the device mesh (data, fsdp, tensor), real or simulated.
      rows: sequences per RL step (a multiple of mini-batches x micro-batches).
      seq_len: tokens per sequence (prompt + response).
      slots, cache_len: the decode engine's KV cache.
      rules: logical -> mesh axes table.
      functions: which of `FUNCTIONS` to compile.
      decode_mesh: the engine's own mesh over the same devices (`rollout.mesh`; default
        `mesh`): the decode step and its serving copy of the weights are sharded on it.
      compiled: a dict that receives the executables ({name: jax.stages.Compiled}).

    Returns:
      {"update": Memory, "decode": Memory} (those of `functions`), per device.
    """
    executables = compile_functions(
        settings,
        mesh=mesh,
        rows=rows,
        seq_len=seq_len,
        slots=slots,
        cache_len=cache_len,
        rules=rules,
        functions=functions,
        decode_mesh=decode_mesh,
    )
    if compiled is not None:
        compiled.update(executables)
    return {name: Memory.of(c) for name, c in executables.items()}


class _BackendAs:
    """`jax` as `models.attention` sees it while compiling for another platform: its
    `default_backend()` is that platform's, everything else is jax's."""

    def __init__(self, backend: str):
        self._backend = backend

    def default_backend(self) -> str:
        return self._backend

    def __getattr__(self, name):
        return getattr(jax, name)


@contextlib.contextmanager
def attention_for(platform: str | None):
    """Attention "auto" resolves for `platform` ("cuda", "tpu"; None: the host's) inside.

    `models.attention.select_impl` picks an implementation from `jax.default_backend()`, the
    host's (CPU here): compiling for a GPU or a TPU, it must pick what that accelerator would
    (cuDNN flash, the Pallas kernel). Until `select_impl` takes the platform, the module's view
    of `jax.default_backend` is the target's while the target's steps are traced."""
    if platform is None:
        yield
        return
    from jaxrl_tools.models import attention as attn_lib  # noqa: PLC0415

    saved = attn_lib.jax
    attn_lib.jax = _BackendAs("gpu" if platform == "cuda" else platform)
    try:
        yield
    finally:
        attn_lib.jax = saved


def _device_bytes(shapes, shardings) -> int:
    """Bytes one device holds of a tree of shapes under its shardings (the largest shard)."""
    return sum(
        math.prod(sh.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings))
    )


def resident_bytes(
    settings: StepSettings,
    *,
    mesh,
    rules=None,
    lora_decode: str = "merged",
    decode_mesh=None,
) -> dict[str, int]:
    """Per device, what stays allocated across a step's phases.

    Returns:
      {"state": the RL state's trained part (weights or adapters, the critic, their AdamW
         moments, counters),
       "frozen": its frozen policy (LoRA's base, or a full fine-tune's reference; 0 if none),
       "serving": the engine's own copy of the weights (compute dtype, on `decode_mesh` when
         given; 0 when it decodes the resident weights themselves: float32 full fine-tuning on
         one mesh, LoRA with `decode: adapters`),
       "decode_reads": the resident weights decoding takes as arguments (0 with a copy)}.
    """
    step = make_rl_step(settings, mesh, rules)
    shapes, shardings = step.state_shapes, step.state_shardings
    state = _device_bytes(shapes.replace(frozen=None), shardings.replace(frozen=None))
    frozen = 0 if shapes.frozen is None else _device_bytes(shapes.frozen, shardings.frozen)
    model_cfg, dtypes = settings.model, settings.dtypes
    compute = models.param_shapes(model_cfg, dtypes.compute_dtype)
    param_sh = sharding.tree_shardings(models.logical_axes(model_cfg), mesh, rules, shapes=compute)
    compute_bytes = _device_bytes(compute, param_sh)
    if settings.lora is None:
        same = jnp.dtype(dtypes.compute_dtype) == jnp.dtype(dtypes.param_dtype)
        serving = 0 if same else compute_bytes
        decode_reads = _device_bytes(shapes.actor.params, shardings.actor.params) if same else 0
    else:
        serving = compute_bytes if lora_decode == "merged" else 0
        decode_reads = 0 if serving else frozen
    if decode_mesh is not None and decode_mesh is not mesh:  # a resharded copy, always
        dec_sh = sharding.tree_shardings(
            models.logical_axes(model_cfg), decode_mesh, rules, shapes=compute
        )
        serving, decode_reads = _device_bytes(compute, dec_sh), 0
    return {"state": state, "frozen": frozen, "serving": serving, "decode_reads": decode_reads}


def phase_totals(figures: dict[str, Memory], resident: dict[str, int]) -> dict[str, int]:
    """Each phase's peak plus what the other phase keeps allocated meanwhile: the engine's
    serving copy during the RL step (whose arguments are the state and frozen policy), the RL
    state and frozen policy during decoding (beyond the weights it reads)."""
    r = resident
    return {
        "update": figures["update"].peak + r["serving"],
        "decode": figures["decode"].peak + r["state"] + r["frozen"] - r["decode_reads"],
    }


def largest_fitting_micro_batch(fits, start: int, limit: int) -> int:
    """The largest power-of-two multiple of `start` up to `limit` for which `fits(b)` holds
    (0 when `start` does not fit); `fits` is monotone in b."""
    best, b = 0, start
    while b <= limit and fits(b):
        best, b = b, b * 2
    return best


def describe(
    figures: dict[str, Memory], hbm: int | None = None, totals: dict[str, int] | None = None
) -> list[str]:
    """One line per function: arguments / temporaries / peak in GiB, with `totals` the phase's
    total with what else stays allocated (`phase_totals`), and whether that fits in `hbm`."""
    gib = lambda n: f"{n / 2**30:.2f}"
    lines = []
    for name, m in figures.items():
        line = (
            f"{name:<9} arguments {gib(m.arguments)} GiB, temporaries {gib(m.temporaries)} GiB, "
            f"peak {gib(m.peak)} GiB per device"
        )
        need = m.peak if totals is None else totals[name]
        if totals is not None:
            line += f"; with the rest resident {gib(need)} GiB"
        if hbm is not None:
            line += f" ({'fits' if need <= hbm else 'does NOT fit'} in {gib(hbm)} GiB)"
        lines.append(line)
    return lines


# ------------------------------------------------------------------------------------------------
# A run's plan: its config's shapes on its mesh (`jaxrl-tools plan`, and the fit check of
# `check` / `train` on an accelerator)


@dataclasses.dataclass(frozen=True)
class Floor:
    """The roofline floor of one run of a compiled function on one device of an accelerator:
    its matmul FLOPs at the peak bf16 rate, or its HBM bytes at the peak bandwidth, whichever
    takes longer (`targets.Accelerator.floor_s`)."""

    cost: targets.Cost
    seconds: float
    bound: str  # "compute" or "memory"

    @classmethod
    def of(cls, cost: targets.Cost, accelerator: targets.Accelerator) -> Floor:
        compute = cost.flops / accelerator.peak_flops
        memory = cost.bytes / accelerator.hbm_bandwidth
        return cls(cost, max(compute, memory), "compute" if compute >= memory else "memory")


PER_STEP = {"update": "RL step", "decode": "decode step (one token per slot)"}


def floors(compiled: dict, accelerator: targets.Accelerator) -> dict[str, Floor]:
    """Each compiled function's floor per run on `accelerator`, from its optimised HLO."""
    return {
        name: Floor.of(targets.hlo_cost(c.as_text()), accelerator) for name, c in compiled.items()
    }


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _amount(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run's per-device memory and what it is compared with.

    Attributes:
      figures: Memory of the RL step ("update") and the decode step, per device.
      totals: each phase's bytes per device with what stays allocated meanwhile
        (`phase_totals`): what must fit.
      mesh: (data, fsdp, tensor).
      hbm: the device memory it must fit in (None: not known, e.g. a CPU host).
      micro_batch_size: the config's rows per micro-batch (all devices).
      largest_micro_batch: the largest power-of-two multiple of the config's data-parallel
        width that fits (None when not searched).
      rollout_mesh: the decode step's own mesh (`rollout.mesh`), or None (`mesh`).
      compiler: the compiler whose figures these are (None: the host's, unlabelled).
      accelerator: the accelerator judged against (floors' peak rates), or None.
      floors: each function's roofline floor per run on `accelerator`, or None.
      notes: lines printed first (e.g. why the CPU compiler's estimate stands in).
      topology: the slice compiled for (a target's), or None.
    """

    figures: dict[str, Memory]
    totals: dict[str, int]
    mesh: tuple[int, int, int]
    hbm: int | None
    micro_batch_size: int
    largest_micro_batch: int | None = None
    rollout_mesh: tuple[int, int, int] | None = None
    compiler: str | None = None
    accelerator: targets.Accelerator | None = None
    floors: dict[str, Floor] | None = None
    notes: tuple[str, ...] = ()
    topology: str | None = None

    @property
    def peak(self) -> int:
        return max(self.totals.values())

    @property
    def fits(self) -> bool:
        return self.hbm is None or self.peak <= self.hbm

    def lines(self) -> list[str]:
        d, f, t = self.mesh
        on = (
            ""
            if self.rollout_mesh is None
            else f", decode on {'x'.join(map(str, self.rollout_mesh))}"
        )
        out = list(self.notes)
        if self.compiler is not None:
            on_slice = "" if self.topology is None else f" for {self.topology}"
            out.append(f"figures of the {self.compiler}{on_slice}:")
        out.append(f"mesh {d}x{f}x{t} (data x fsdp x tensor){on}, per device:")
        out += ["  " + line for line in describe(self.figures, self.hbm, self.totals)]
        if self.largest_micro_batch is not None:
            out.append(
                f"largest optim.micro_batch_size that fits: {self.largest_micro_batch} "
                f"(configured: {self.micro_batch_size})"
            )
        if self.floors and self.accelerator is not None:
            a = self.accelerator
            out.append(
                f"roofline floor per device on {a.label} ({a.peak_flops / 1e12:,.0f} TFLOP/s "
                f"bf16, {a.hbm_bandwidth / 1e12:.3g} TB/s HBM), of "
                f"{'the program above' if self.compiler else 'the host compiler program'}:"
            )
            for name, fl in self.floors.items():
                c = fl.cost
                loops = f"; {c.unknown_loops} loops counted once" if c.unknown_loops else ""
                if c.conditionals:
                    loops += f"; {c.conditionals} conditionals at their costlier branch"
                out.append(
                    f"  {name:<9} {_seconds(fl.seconds)} per {PER_STEP.get(name, 'run')}, "
                    f"{fl.bound}-bound: {_amount(c.flops, 'FLOP')}, "
                    f"{_amount(c.bytes, 'B')} of HBM traffic{loops}"
                )
        return out


def plan_run(
    cfg,
    mesh,
    hbm: int | None = None,
    search: bool = False,
    *,
    accelerator: targets.Accelerator | None = None,
    compiler: str | None = None,
    platform: str | None = None,
    notes: tuple[str, ...] = (),
) -> RunPlan:
    """Compiles the run's RL step and decode step on abstract shapes on `mesh` (no weights).

    With `search`, also finds the largest micro-batch that fits in `hbm` (one compile of the
    step per doubling). With `accelerator`, each step's roofline floor on it (from the
    executables' HLO); `platform` ("cuda", "tpu") is what attention "auto" resolves for (the
    mesh's devices are a target's), `compiler` labels the figures, `notes` come first."""
    with attention_for(platform):
        return _plan_run(cfg, mesh, hbm, search, accelerator, compiler, notes)


def _plan_run(cfg, mesh, hbm, search, accelerator, compiler, notes) -> RunPlan:
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
    shape = tuple(mesh.shape[a] for a in mesh.axis_names)
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
            trial_figures = plan_memory(
                trial, mesh=mesh, **dict(shapes, rows=rows), functions=("update",)
            )
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
    the accelerator's default slice), judged against its HBM, with each step's floor.

    Raises:
      targets.TargetUnavailable: the compiler is not installed or gives no devices.
      ConfigError: the mesh does not multiply to the slice's device count, or the compiler
        refuses a step (one line each).
    """
    a = targets.ACCELERATORS[accelerator]
    shape = cfg.trainer.mesh_shape if mesh_shape is None else tuple(mesh_shape)
    wanted = None if shape is None else math.prod(shape)
    topo = targets.resolve_topology(a, topology, hosts, wanted)
    devices = targets.target_devices(accelerator, topo)
    if shape is None:  # trainer.mesh auto: fsdp over the whole slice
        shape = (1, len(devices), 1)
    if math.prod(shape) != len(devices):
        text = "x".join(map(str, shape))
        other = a.topology_for(math.prod(shape))
        hint = f", or compile for {other}" if other else ""
        raise ConfigError(
            f"plan: {mesh_name} {text} is {math.prod(shape)} devices and {a.label} topology "
            f"{topo} has {len(devices)}: set {mesh_name} to a shape of {len(devices)} devices"
            f"{hint} (--topology / --hosts)"
        )
    mesh = sharding.make_mesh(shape, devices)
    try:
        result = plan_run(
            cfg, mesh, a.hbm_bytes, search, accelerator=a, compiler=a.compiler, platform=a.platform
        )
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the target compiler refused: one line, with the fix
        raise ConfigError(_refusal(a, e)) from e
    n = len(devices)
    return dataclasses.replace(result, topology=f"{topo} ({n} device{'s' * (n > 1)})")


def _refusal(a: targets.Accelerator, e: Exception) -> str:
    message = " ".join(str(e).split())
    if "Mosaic kernels cannot be automatically partitioned" in message:
        return (
            f"plan: the {a.compiler} cannot partition the Pallas flash-attention kernel that "
            "model.attention auto picks on TPU (models/attention.py calls it outside a "
            "shard_map, so a sharded TPU run would fail the same way): plan with "
            "model.attention=chunked"
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
