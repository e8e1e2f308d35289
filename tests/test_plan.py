"""jaxrl_tools.plan: compiled memory figures account for the state, the batch and the KV cache."""

import math

import jax
import jax.numpy as jnp
from fakes import tiny_model_config

from jaxrl_tools import models, plan, sharding


def test_plan_memory_accounts_for_master_weights_adam_and_bf16_cache():
    cfg = tiny_model_config()
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(cfg)))
    M, b, T, slots, cache_len = 2, 4, 32, 4, 64
    figures = plan.plan_memory(
        cfg,
        mesh=sharding.make_mesh((1, -1, 1)),
        dtypes=models.DTypePolicy(compute="bfloat16"),
        micro_batch_size=b,
        num_micro=M,
        seq_len=T,
        slots=slots,
        cache_len=cache_len,
    )
    # Update arguments: fp32 weights + Adam mu and nu (12 bytes a parameter), the batch (six
    # [M, b, T] 4-byte arrays; jit drops the unused [M, b] "correct" without an NLL term), and
    # a few counters (step, RNG key, Adam's count).
    batch = 4 * 6 * M * b * T
    extra = figures["update"].arguments - 12 * n - batch
    assert 0 <= extra <= 64, extra
    assert figures["update"].aliased >= 12 * n  # the state is donated
    # Decode arguments: the bf16 serving copy and the bf16 KV cache (plus small per-slot state).
    cache = models.cache_bytes(cfg, slots, cache_len, jnp.bfloat16)
    small = slots * (4 * cfg.vocab_size + 64)
    extra = figures["decode"].arguments - 2 * n - cache
    assert 0 <= extra <= small, extra
    assert all(m.peak >= m.arguments for m in figures.values())
    lines = plan.describe(figures, plan.ACCELERATORS["v5e"])
    assert len(lines) == 3 and all("fits in 16.00 GiB" in line for line in lines)
