"""Per-device memory of a run's jitted functions, from compilation on abstract shapes.

`plan_memory` lowers the very RL step the trainer runs (`train.step.make_rl_step` of the same
settings: forwards, advantages, every mini-batch update) and one step of the very decode step the
engine runs (`EngineCore.decode_step`, from `engine.decode_step.make_decode_step`) on the
engine's own decode state (all slots, reading whole cache rows: full occupancy), on
`jax.ShapeDtypeStruct`s (no weights exist, nothing is allocated), and compiles them for the
mesh's devices: XLA's `memory_analysis()` of each executable is the memory one device needs for
its arguments, outputs and temporaries. The devices may be this host's (a CPU mesh, simulated
with `XLA_FLAGS=--xla_force_host_platform_device_count=8`: the CPU compiler's buffer assignment,
an estimate of an accelerator's), a real accelerator's, or a target's compile-only devices
(`targets.target_devices`: that accelerator's own compiler, without the accelerator).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import models, sharding
from jaxrl_tools.config import AlgorithmSection, CriticSection, OptimSection, RolloutSection
from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.rollout.sampler import make_engine
from jaxrl_tools.train.step import StepSettings, make_rl_step

FUNCTIONS = ("update", "decode")  # what `plan_memory` compiles: the RL step, a decode step


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


def decode_engine(
    model_cfg: models.ModelConfig,
    dtypes: models.DTypePolicy,
    *,
    slots: int,
    cache_len: int,
    mesh=None,
    rules=None,
) -> EngineCore:
    """The run's engine (`rollout.sampler.make_engine`) without weights, whose decode step
    `lower_decode` plans: every slot reads whole cache rows (full occupancy). A decode step's
    shapes do not depend on the prompt bucket: the smallest (16) takes the rest of `cache_len`
    as the response."""
    rollout = RolloutSection(slots=slots, max_prompt_len=16, max_response_len=cache_len - 16)
    return make_engine(
        model_cfg,
        None,
        None,
        rollout,
        mesh=mesh,
        dtypes=dtypes,
        engine="core",
        rules=rules,
        live_attention=False,
        unstack_layers=False,
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
    of the weights (compute dtype, sharded on the engine's mesh). Its executable takes
    `(params, state, engine.hook_data)` of `decode_engine` of the same arguments."""
    engine = decode_engine(
        model_cfg, dtypes, slots=slots, cache_len=cache_len, mesh=mesh, rules=rules
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
