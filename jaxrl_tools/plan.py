"""Per-device memory of a run's jitted functions, from compilation on abstract shapes.

`plan_memory` builds the train step (micro-batched actor update with AdamW), the log-prob
forward (one micro-batch) and one decode step (all slots, reading whole cache rows: full
occupancy) for a model config on a mesh, lowers them on `jax.ShapeDtypeStruct`s (no weights
exist, nothing is allocated) and compiles them: XLA's `memory_analysis()` of each executable
is the memory one device needs for its arguments, outputs and temporaries. On a CPU host the
mesh can be simulated
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`): the figures are those of the CPU
compiler's buffer assignment, an estimate of a GPU/TPU's (which fuses differently).

`plan_run` does this for a run config (`jaxrl-tools plan`); `check` and `train` refuse a run
whose plan does not fit an accelerator's memory (`fit_error`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import models, sharding
from jaxrl_tools.config import AlgorithmSection, ConfigError
from jaxrl_tools.models.lora import lora_shapes
from jaxrl_tools.rollout.kernels import DecodeState, generate_kernel
from jaxrl_tools.train import objectives
from jaxrl_tools.train.lora import make_lora_update
from jaxrl_tools.train.state import (
    create_train_state,
    make_optimizer,
    make_update,
    train_state_shardings,
)

FUNCTIONS = ("update", "logprobs", "decode")  # what `plan_memory` compiles

# Device memory of the accelerators `plan` knows, in bytes.
ACCELERATORS = {
    "h100-80g": 80 * 10**9,
    "h200": 141 * 10**9,
    "v5e": 16 * 2**30,
    "v5p": 95 * 2**30,
    "v6e": 32 * 2**30,
}


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


def _struct(shape, dtype, sh=None):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh)


def plan_memory(
    model_cfg: models.ModelConfig,
    *,
    mesh,
    dtypes: models.DTypePolicy,
    micro_batch_size: int,
    num_micro: int,
    seq_len: int,
    slots: int,
    cache_len: int,
    remat: bool | str = False,
    attention: str = "auto",
    algorithm: AlgorithmSection | None = None,
    rules=None,
    lora: models.LoraConfig | None = None,
    functions: tuple[str, ...] = FUNCTIONS,
    decode_mesh=None,
) -> dict[str, Memory]:
    """Compiles the update, the log-prob forward and a decode step on abstract shapes.

    Args:
      model_cfg: the architecture.
      mesh: the device mesh (data, fsdp, tensor), real or simulated.
      dtypes: master / compute / cache dtypes.
      micro_batch_size, num_micro: rows per micro-batch and micro-batches per optimizer step.
      seq_len: tokens per packed sequence (prompt + response).
      slots, cache_len: the decode engine's KV cache.
      remat, attention: as in the model (`models.hidden_states`).
      algorithm: the loss's settings (default: GRPO without KL).
      rules: logical -> mesh axes table.
      lora: train LoRA adapters (the state holds them; the base is a frozen argument of the
        update, in the compute dtype, and decoding reads a merged copy of the same shapes).
      functions: which of the three to compile.
      decode_mesh: the engine's own mesh over the same devices (`rollout.mesh`; default
        `mesh`): the decode step and its serving copy of the weights are sharded on it.

    Returns:
      {"update": Memory, "logprobs": Memory, "decode": Memory} (those of `functions`), per
      device.
    """
    param_shapes = models.param_shapes(model_cfg, dtypes.param_dtype)
    param_sh = sharding.tree_shardings(
        models.logical_axes(model_cfg), mesh, rules, shapes=param_shapes
    )
    optimizer = make_optimizer(1e-6, total_steps=1)
    trained, trained_sh, frozen, policy, policy_sh = _trained(
        model_cfg, param_shapes, param_sh, mesh, dtypes, rules, lora
    )
    state_shapes = jax.eval_shape(lambda p: create_train_state(p, optimizer, 0), trained)
    state_sh = train_state_shardings(state_shapes, trained_sh, mesh)
    batch_axes = sharding.logical_to_spec(("batch",), rules)[0]
    micro_sh = NamedSharding(mesh, PartitionSpec(None, batch_axes))
    rows_sh = NamedSharding(mesh, PartitionSpec(batch_axes))
    replicated = NamedSharding(mesh, PartitionSpec())

    algorithm = algorithm or AlgorithmSection(kl_coef=0.0)
    pcfg = objectives.policy_loss_config(algorithm, seq_len)
    loss = functools.partial(objectives.actor_loss, model_cfg, pcfg, 1.0, remat, 0.0)

    def loss_in_compute(params, mb, denom):
        return loss(dtypes.cast_for_compute(params), mb, denom, attention=attention)

    denoms = functools.partial(objectives.actor_denominator, pcfg)
    if lora is None:
        update = make_update(loss_in_compute, optimizer, denoms_fn=denoms)
    else:
        update = make_lora_update(loss_in_compute, optimizer, lora, denoms_fn=denoms)
    M, b, T = num_micro, micro_batch_size, seq_len
    batch = {
        "tokens": _struct((M, b, T), jnp.int32),
        "positions": _struct((M, b, T), jnp.int32),
        "attention": _struct((M, b, T), jnp.int32),
        "loss_mask": _struct((M, b, T), jnp.float32),
        "advantages": _struct((M, b, T), jnp.float32),
        "correct": _struct((M, b), jnp.float32),
        "old_logp": _struct((M, b, T), jnp.float32),
    }
    if pcfg.kl_coef:
        batch["ref_logp"] = _struct((M, b, T), jnp.float32)
    batch_sh = jax.tree.map(lambda _: micro_sh, batch)

    def logprobs(params, seqs):
        return objectives.sequence_logprobs(
            model_cfg, 1.0, False, dtypes.cast_for_compute(params), seqs, attention=attention
        )

    seqs = {k: _struct((b, T), batch[k].dtype) for k in ("tokens", "positions", "attention")}
    seqs["loss_mask"] = _struct((b, T), jnp.float32)

    cache_axes = models.cache_axes()
    cache = jax.eval_shape(
        lambda: models.init_cache(model_cfg, slots, cache_len, dtype=dtypes.cache_dtype)
    )
    dmesh = mesh if decode_mesh is None else decode_mesh
    cache_sh = sharding.tree_shardings(cache_axes, dmesh, rules, shapes=cache)
    B, V = slots, model_cfg.vocab_size
    state = DecodeState(
        cache=cache,
        lengths=_struct((B,), jnp.int32),
        logits=_struct((B, V), jnp.float32),
        keys=_struct((B, 2), jnp.uint32),
        temperature=_struct((B,), jnp.float32),
        top_k=_struct((B,), jnp.int32),
        top_p=_struct((B,), jnp.float32),
        sampled=_struct((B,), jnp.int32),
        seq=_struct((B,), jnp.int32),
        active=_struct((B,), bool),
    )
    dec_replicated = NamedSharding(dmesh, PartitionSpec())
    state_dec_sh = DecodeState(
        cache=cache_sh,
        **{f: dec_replicated for f in DecodeState.__dataclass_fields__ if f != "cache"},
    )
    compute_sh = param_sh  # the serving copy keeps the master weights' sharding ...
    if dmesh is not mesh:  # ... unless it is resharded onto the engine's mesh
        compute_sh = sharding.tree_shardings(
            models.logical_axes(model_cfg), dmesh, rules, shapes=param_shapes
        )
    compute_shapes = jax.tree.map(lambda x: _struct(x.shape, dtypes.compute_dtype), param_shapes)

    def decode(params, st):
        # The kernel's body, traced afresh: the jitted kernel's trace cache would reuse the
        # sharding constraints of the first mesh it was traced under (one process may plan
        # several meshes).
        return generate_kernel.__wrapped__(
            params,
            st,
            None,
            num_steps=1,
            mode="sample",
            config=model_cfg,
            max_len=cache_len,
            hook=None,
        )

    lowered = {
        "update": lambda: jax.jit(
            update,
            in_shardings=(state_sh, batch_sh, *([param_sh] if lora else [])),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        ).lower(state_shapes, batch, *([frozen] if lora else [])),
        "logprobs": lambda: jax.jit(
            logprobs,
            in_shardings=(policy_sh, jax.tree.map(lambda _: rows_sh, seqs)),
            out_shardings=(rows_sh, rows_sh),
        ).lower(policy, seqs),
        "decode": lambda: jax.jit(
            decode, in_shardings=(compute_sh, state_dec_sh), donate_argnums=1
        ).lower(compute_shapes, state),
    }
    out = {}
    for name in functions:
        with sharding.use_mesh(dmesh if name == "decode" else mesh, rules):
            out[name] = Memory.of(lowered[name]().compile())
    return out


def _trained(model_cfg, param_shapes, param_sh, mesh, dtypes, rules, lora):
    """(trained shapes, their shardings, the frozen base or None, the policy the log-prob pass
    reads, its shardings): the weights for full fine-tuning; adapters over a compute-dtype
    base with LoRA."""
    if lora is None:
        return param_shapes, param_sh, None, param_shapes, param_sh
    adapters = lora_shapes(model_cfg, lora, dtypes.param_dtype)
    adapters_sh = sharding.tree_shardings(
        models.lora_logical_axes(lora), mesh, rules, shapes=adapters
    )
    base = models.param_shapes(model_cfg, dtypes.compute_dtype)
    policy = models.with_lora(base, adapters, lora)
    return adapters, adapters_sh, base, policy, models.with_lora(param_sh, adapters_sh, lora)


def _device_bytes(shapes, shardings) -> int:
    """Bytes one device holds of a tree of shapes under its shardings (the largest shard)."""
    return sum(
        math.prod(sh.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings))
    )


def resident_bytes(
    model_cfg: models.ModelConfig,
    *,
    mesh,
    dtypes: models.DTypePolicy,
    rules=None,
    lora: models.LoraConfig | None = None,
    lora_decode: str = "merged",
    decode_mesh=None,
) -> dict[str, int]:
    """Per device, what stays allocated across a step's phases.

    Returns:
      {"state": the train state (trained weights and their AdamW moments),
       "frozen": LoRA's base weights (0 without LoRA),
       "read": the resident weights the log-prob pass takes as arguments,
       "serving": the engine's own copy of the weights (compute dtype, on `decode_mesh` when
         given; 0 when it decodes the resident weights themselves: float32 full fine-tuning on
         one mesh, LoRA with `decode: adapters`),
       "decode_reads": the resident weights decoding takes as arguments (0 with a copy)}.
    """
    shapes = models.param_shapes(model_cfg, dtypes.param_dtype)
    param_sh = sharding.tree_shardings(models.logical_axes(model_cfg), mesh, rules, shapes=shapes)
    trained, trained_sh, frozen, policy, policy_sh = _trained(
        model_cfg, shapes, param_sh, mesh, dtypes, rules, lora
    )
    optimizer = make_optimizer(1e-6, total_steps=1)
    state_shapes = jax.eval_shape(lambda p: create_train_state(p, optimizer, 0), trained)
    state = _device_bytes(state_shapes, train_state_shardings(state_shapes, trained_sh, mesh))
    compute = models.param_shapes(model_cfg, dtypes.compute_dtype)
    compute_bytes = _device_bytes(compute, param_sh)
    if lora is None:
        same = jnp.dtype(dtypes.compute_dtype) == jnp.dtype(dtypes.param_dtype)
        serving = 0 if same else compute_bytes
        frozen_bytes, decode_reads = 0, (_device_bytes(shapes, param_sh) if same else 0)
    else:
        frozen_bytes = _device_bytes(frozen, param_sh)
        serving = compute_bytes if lora_decode == "merged" else 0
        decode_reads = 0 if serving else frozen_bytes
    if decode_mesh is not None and decode_mesh is not mesh:  # a resharded copy, always
        dec_sh = sharding.tree_shardings(
            models.logical_axes(model_cfg), decode_mesh, rules, shapes=compute
        )
        serving, decode_reads = _device_bytes(compute, dec_sh), 0
    return {
        "state": state,
        "frozen": frozen_bytes,
        "read": _device_bytes(policy, policy_sh),
        "serving": serving,
        "decode_reads": decode_reads,
    }


def phase_totals(figures: dict[str, Memory], resident: dict[str, int]) -> dict[str, int]:
    """Each phase's peak plus what the other phases keep allocated meanwhile: the engine's
    serving copy during the update and log-prob passes, the train state and LoRA's base during
    the log-prob pass (beyond the weights it reads) and during decoding."""
    r = resident
    kept = r["state"] + r["frozen"]
    return {
        "update": figures["update"].peak + r["serving"],
        "logprobs": figures["logprobs"].peak + kept - r["read"] + r["serving"],
        "decode": figures["decode"].peak + kept - r["decode_reads"],
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
class RunPlan:
    """A run's per-device memory and what it is compared with.

    Attributes:
      figures: Memory of the update, log-prob forward and decode step, per device.
      totals: each phase's bytes per device with what stays allocated meanwhile
        (`phase_totals`): what must fit.
      mesh: (data, fsdp, tensor).
      hbm: the device memory it must fit in (None: not known, e.g. a CPU host).
      micro_batch_size: the config's rows per micro-batch (all devices).
      largest_micro_batch: the largest power-of-two multiple of the config's data-parallel
        width that fits (None when not searched).
      rollout_mesh: the decode step's own mesh (`rollout.mesh`), or None (`mesh`).
    """

    figures: dict[str, Memory]
    totals: dict[str, int]
    mesh: tuple[int, int, int]
    hbm: int | None
    micro_batch_size: int
    largest_micro_batch: int | None = None
    rollout_mesh: tuple[int, int, int] | None = None

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
        out = [f"mesh {d}x{f}x{t} (data x fsdp x tensor){on}, per device:"]
        out += ["  " + line for line in describe(self.figures, self.hbm, self.totals)]
        if self.largest_micro_batch is not None:
            out.append(
                f"largest optim.micro_batch_size that fits: {self.largest_micro_batch} "
                f"(configured: {self.micro_batch_size})"
            )
        return out


def model_config(cfg) -> models.ModelConfig:
    """The run's architecture without its weights: `config.json` of `model.path`, or the tiny
    model with the tokenizer's vocabulary (`tokenizer.vocab_size` when it is not built yet)."""
    if cfg.model.path is not None:
        return models.load_config(cfg.model.path)
    tiny = dataclasses.asdict(cfg.model.tiny)
    tiny.pop("seed")
    return models.ModelConfig(
        **tiny,
        vocab_size=cfg.tokenizer.vocab_size,
        attention_bias=tiny["model_type"] == "qwen2",
        qk_norm=tiny["model_type"] == "qwen3",
    )


def run_shapes(cfg) -> dict:
    """plan_memory's shape arguments for one RL step of the run."""
    r, o = cfg.rollout, cfg.optim
    rows = cfg.update_rows // o.num_mini_batches
    prefill = max(16, 1 << (r.max_prompt_len - 1).bit_length())  # the engine's prompt bucket
    return dict(
        micro_batch_size=o.micro_batch_size,
        num_micro=max(1, rows // o.micro_batch_size),
        seq_len=r.max_prompt_len + r.max_response_len,
        slots=r.slots,
        cache_len=prefill + r.max_response_len,
        remat=cfg.model.remat_policy if cfg.model.remat else False,
        attention=cfg.model.attention,
        algorithm=cfg.algorithm,
    )


def plan_run(cfg, mesh, hbm: int | None = None, search: bool = False) -> RunPlan:
    """Compiles the run's step functions on abstract shapes on `mesh` (no weights loaded).

    With `search`, also finds the largest micro-batch that fits in `hbm` (one compile of the
    update per doubling)."""
    model_cfg = model_config(cfg)
    shapes = run_shapes(cfg)
    lora = dict(lora=cfg.model.lora.config)
    decode_mesh = None
    if cfg.rollout.mesh_shape is not None:  # the engine's mesh, over the same devices
        decode_mesh = sharding.make_mesh(cfg.rollout.mesh_shape, list(mesh.devices.flat))
    figures = plan_memory(
        model_cfg, mesh=mesh, dtypes=cfg.model.dtypes, decode_mesh=decode_mesh, **shapes, **lora
    )
    resident = resident_bytes(
        model_cfg,
        mesh=mesh,
        dtypes=cfg.model.dtypes,
        lora_decode=cfg.model.lora.decode,
        decode_mesh=decode_mesh,
        **lora,
    )
    totals = phase_totals(figures, resident)
    shape = tuple(mesh.shape[a] for a in mesh.axis_names)
    largest = None
    if search and hbm is not None:
        width = shape[0] * shape[1]  # rows of a micro-batch split over data x fsdp
        rows = shapes["micro_batch_size"] * shapes["num_micro"]

        def fits(b: int) -> bool:
            # The micro-batch changes the update and the log-prob pass, not decoding.
            trial = dict(shapes, micro_batch_size=b, num_micro=max(1, rows // b))
            trial_figures = plan_memory(
                model_cfg,
                mesh=mesh,
                dtypes=cfg.model.dtypes,
                **trial,
                **lora,
                functions=("update", "logprobs"),
            )
            trial_figures["decode"] = figures["decode"]
            return max(phase_totals(trial_figures, resident).values()) <= hbm

        largest = largest_fitting_micro_batch(fits, width, max(rows, width))
    return RunPlan(
        figures, totals, shape, hbm, shapes["micro_batch_size"], largest, cfg.rollout.mesh_shape
    )


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
        "logprobs": "lower optim.micro_batch_size or widen trainer.mesh",
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
