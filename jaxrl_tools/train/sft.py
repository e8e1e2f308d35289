"""Supervised fine-tuning (the cold start of ReTool / RAGEN) on segment-tokenised traces.

A trace is a list of (text, trainable) segments. Each segment is tokenised on its own and the
ids are concatenated, exactly as the rollout builds a trajectory (prompt, sampled model tokens,
inserted observation tokens), so SFT and RL see the same token boundaries. Only trainable
segments (the assistant's own tokens) carry loss; prompts and tool output never do.
"""

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_tools import algorithms, models, sharding
from jaxrl_tools.config import ConfigError
from jaxrl_tools.sharding.distributed import to_host
from jaxrl_tools.train import policy
from jaxrl_tools.train.packing import plan_packing
from jaxrl_tools.train.state import (
    create_train_state,
    make_optimizer,
    make_update,
    train_state_shardings,
)

log = logging.getLogger(__name__)


def encode_segments(
    tokenizer, segments: Sequence[Sequence[Any]], max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss_mask) of one trace; raises if it is longer than `max_len` tokens."""
    ids: list[int] = []
    mask: list[float] = []
    for text, trainable in segments:
        seg = tokenizer.encode(text, add_special_tokens=False)
        ids += seg
        mask += [float(bool(trainable))] * len(seg)
    if len(ids) > max_len:
        raise ConfigError(
            f"sft.max_len={max_len}: an SFT trace has {len(ids)} tokens; raise sft.max_len (the "
            "recipe's prompts, tool declarations included, are part of every trace)"
        )
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)


def pad_examples(
    examples: Sequence[tuple[np.ndarray, np.ndarray]], *, pad_id: int, length: int
) -> dict[str, np.ndarray]:
    """Right-padded [N, length] arrays (tokens, positions, attention, loss_mask)."""
    n = len(examples)
    out = {
        "tokens": np.full((n, length), pad_id, np.int32),
        "positions": np.zeros((n, length), np.int32),
        "attention": np.zeros((n, length), np.int32),
        "loss_mask": np.zeros((n, length), np.float32),
    }
    for i, (ids, mask) in enumerate(examples):
        k = len(ids)
        out["tokens"][i, :k] = ids
        out["positions"][i, :k] = np.arange(k)
        out["attention"][i, :k] = 1
        out["loss_mask"][i, :k] = mask
    return out


def make_sft_update(
    model_cfg: models.ModelConfig,
    optimizer,
    *,
    state_shardings=None,
    micro_sharding=None,
    mesh=None,
    rules=None,
    dtypes: models.DTypePolicy | None = None,
    attention: str = "auto",
    packed: bool = False,
):
    """The jitted SFT update: token-mean NLL over the loss mask, exact over micro-batches.

    With `dtypes`, the state holds master weights and the passes run on their compute-dtype cast
    (as in the RL trainer). `packed`: rows hold several traces (`train.packing`).

    With a mesh, the state keeps `state_shardings`, micro-batches come as `micro_sharding`, and
    the update is traced inside `use_mesh` so activation constraints apply.
    """

    def loss_fn(params, mb, denom):
        if dtypes is not None:
            params = dtypes.cast_for_compute(params)
        logp, _ = policy.token_logprobs(
            model_cfg,
            params,
            mb["tokens"],
            mb["positions"],
            mb["attention"],
            mb["loss_mask"],
            attention=attention,
            packed=packed,
        )
        total, _ = algorithms.aggregate(-logp, mb["loss_mask"], "token-mean", denominator=denom)
        return total / jnp.maximum(denom, 1.0), {}

    def denoms(batch_M):
        return jnp.sum(batch_M["loss_mask"])

    update = make_update(loss_fn, optimizer, denoms_fn=denoms)
    if mesh is None:
        return jax.jit(update, donate_argnums=0)
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(
        update,
        in_shardings=(state_shardings, micro_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )

    def call(state, batch):
        with sharding.use_mesh(mesh, rules):
            return jitted(state, batch)

    return call


class NonFiniteSFT(ConfigError):
    """A diverged SFT step: SFT stopped before anything was written (one line, the fix)."""

    def __init__(self, step: int, what: str):
        super().__init__(
            f"sft step {step}: the update is not finite ({what}); SFT stopped and wrote nothing: "
            "lower sft.lr (or set optim.grad_clip) and run it again"
        )


def train_sft(
    model_cfg: models.ModelConfig,
    params: Any,
    tokenizer,
    traces: Sequence[Sequence[Sequence[Any]]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    max_len: int,
    warmup_steps: int = 0,
    micro_batch_size: int | None = None,
    seed: int = 0,
    on_step=None,
    mesh=None,
    rules=None,
    dtypes: models.DTypePolicy | None = None,
    attention: str = "auto",
    pack: bool = False,
) -> Any:
    """Trains `params` on segment traces for `epochs`; returns the new params.

    Raises:
      NonFiniteSFT: a step's loss or gradient norm is NaN or infinite (nothing is returned).

    Args:
      traces: each a list of (text, trainable) segments.
      on_step: optional callback(step, metrics) (logging, progress).
      mesh, rules: train sharded on this mesh (params by their logical axes, batches over
        the "batch" axis); None: one device.
      dtypes, attention: mixed precision and the attention implementation (`make_sft_update`).
      pack: each step's `batch_size` traces go back to back into as few rows as hold them
        (rounded up to micro-batches; `train.packing`): the same loss, less padding.
    """
    examples = [encode_segments(tokenizer, t, max_len) for t in traces]
    if not examples:
        raise ValueError("SFT needs at least one trace")
    length = -(-max(len(ids) for ids, _ in examples) // 16) * 16
    data = pad_examples(examples, pad_id=tokenizer.pad_token_id or 0, length=length)
    n = len(examples) - len(examples) % batch_size
    if n == 0:
        raise ValueError(f"sft.batch_size={batch_size} is larger than the {len(examples)} traces")
    steps = epochs * (n // batch_size)
    micro = micro_batch_size or batch_size
    if batch_size % micro:
        raise ValueError(f"sft.batch_size {batch_size} is not a multiple of micro batch {micro}")
    optimizer = make_optimizer(
        lr, total_steps=steps, warmup_steps=warmup_steps, schedule="cosine", min_lr_ratio=0.1
    )
    if mesh is None:
        update = make_sft_update(
            model_cfg, optimizer, dtypes=dtypes, attention=attention, packed=pack
        )
        state = create_train_state(params, optimizer, seed)
        place = jnp.asarray
    else:
        param_sh = sharding.tree_shardings(
            models.logical_axes(model_cfg), mesh, rules, shapes=params
        )
        state = create_train_state(params, optimizer, seed, param_shardings=param_sh)
        batch_axes = sharding.logical_to_spec(("batch",), rules)[0]
        micro_sh = NamedSharding(mesh, PartitionSpec(None, batch_axes))
        update = make_sft_update(
            model_cfg,
            optimizer,
            state_shardings=train_state_shardings(state, param_sh, mesh),
            micro_sharding=micro_sh,
            mesh=mesh,
            rules=rules,
            dtypes=dtypes,
            attention=attention,
            packed=pack,
        )
        place = lambda x: jax.device_put(x, micro_sh)
    rng = np.random.default_rng(seed)
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(examples))[:n]
        for k in range(0, n, batch_size):
            rows = {key: v[order[k : k + batch_size]] for key, v in data.items()}
            if pack:
                layout = plan_packing(rows["attention"].sum(1), length, multiple=micro)
                rows = {key: layout.pack(v) for key, v in rows.items()}
                rows["attention"] = layout.segments_PT
            mb = {key: place(v.reshape(-1, micro, length)) for key, v in rows.items()}
            state, metrics = update(state, mb)
            step += 1
            # every process reads them (a collective when the metrics span processes)
            values = {k: float(to_host(metrics[k])) for k in ("loss", "grad_norm")}
            bad = [f"{k} {v}" for k, v in values.items() if not math.isfinite(v)]
            if bad:
                raise NonFiniteSFT(step, ", ".join(bad))
            if on_step is not None:
                on_step(step, {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"]})
    return state.params
