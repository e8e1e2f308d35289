"""The kernel floor: a step's own matmuls, timed alone through XLA on this machine.

The roofline floor (`roofline.py`) prices a step's FLOPs at a square matmul's rate. XLA:CPU runs
the step's skinny products (a decode step's 1-32 rows by a layer's matrix, the update's
weight-gradient products) well below that rate, and no scheduling of the step can beat the
kernels it calls. So next to the roofline floor the benchmarks print this one: every projection
and MLP matmul of each layer, and the LM head, at the step's shapes and dtype and in its order,
each with weights of its own (they stream from memory as in the step), run as one jitted
function and timed alone. What a step takes beyond it is the engine's or the trainer's own
overhead: attention, norms, sampling, the loss, copies. Attention's own products are left out.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of every matmul of one forward, in order: each layer's q, k, v, o, gate, up and
    down projections, then the LM head."""
    D, F, Dh = config.hidden_size, config.intermediate_size, config.head_dim
    H, K = config.num_attention_heads, config.num_key_value_heads
    layer = [(D, H * Dh), (D, K * Dh), (D, K * Dh), (H * Dh, D), (D, F), (D, F), (F, D)]
    return layer * config.num_hidden_layers + [(D, config.vocab_size)]


def _time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_s(config, rows: int, dtype=jnp.float32, repeats: int = 7) -> float:
    """Seconds (median) of one forward's matmuls over `rows` tokens: a decode step's at its
    batch size."""
    shapes = layer_shapes(config)
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]
    xs = [jnp.asarray(rng.normal(size=(rows, s[0])), dtype) for s in shapes]
    run = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws, strict=True)])
    return _time(run, (xs, ws), repeats)


def update_s(config, rows: int, dtype=jnp.float32, repeats: int = 5) -> float:
    """Seconds (median) of an update's matmuls over `rows` tokens: each forward product
    (x @ w), then in reverse order its input gradient (dy @ w.T) and weight gradient
    (x.T @ dy)."""
    shapes = layer_shapes(config)
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]
    xs = [jnp.asarray(rng.normal(size=(rows, s[0])), dtype) for s in shapes]
    dys = [jnp.asarray(rng.normal(size=(rows, s[1])), dtype) for s in shapes]

    def run(xs, ws, dys):
        ys = [x @ w for x, w in zip(xs, ws, strict=True)]
        grads = [
            (dy @ w.T, x.T @ dy) for x, w, dy in zip(xs[::-1], ws[::-1], dys[::-1], strict=True)
        ]
        return ys, grads

    return _time(jax.jit(run), (xs, ws, dys), repeats)
