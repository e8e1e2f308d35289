"""FLOP and bandwidth utilisation of a Qwen2.5-0.5B-shaped policy: the GRPO update and decode.

A random model of Qwen2.5-0.5B's shapes (494M parameters, tied, vocab 151,936) runs, on this
machine, the trainer's update (the actor loss of `train.objectives`, micro-batched gradient
accumulation, AdamW: `train.state.make_update`) and the engine's decode steps
(`engine.core.EngineCore`), each timed after a warm-up. Each figure is printed against the
roofline measured in the same process (`benchmarks/roofline.py`):

  update   FLOPs = 6 x (layer weights + LM head) x tokens + 6 x causal attention
           (2 matmuls of T^2/2 x head_dim per head and layer), the floor being matmul-bound;
  decode   bytes = every weight once + the live KV cache per step, FLOPs = 2 x weights per token:
           bandwidth-bound at small batch, matmul-bound at large batch.

Run (CPU, ~5 minutes on 2 cores):  python benchmarks/bench_utilisation.py
GPU (benchmarks/gpu.sh):           python benchmarks/bench_utilisation.py --dtype bfloat16 \
                                      --seqs 16 --seq-len 2048 --decode-batches 1,64,256
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import Roofline  # noqa: E402
from shapes import CONFIG_JSON  # noqa: E402

from jaxrl_tools import host, models  # noqa: E402
from jaxrl_tools.config import AlgorithmSection  # noqa: E402
from jaxrl_tools.engine.core import EngineCore  # noqa: E402
from jaxrl_tools.engine.sampling import SamplingParams  # noqa: E402
from jaxrl_tools.train import objectives  # noqa: E402
from jaxrl_tools.train.state import create_train_state, make_optimizer, make_update  # noqa: E402

QWEN25_05B = models.ModelConfig.from_hf(CONFIG_JSON["qwen2.5-0.5b"])


def matmul_params(cfg: models.ModelConfig, params) -> int:
    """Weights that multiply activations: every layer weight and the LM head (not the lookup)."""
    layers = sum(x.size for x in jax.tree.leaves(params["layers"]))
    return layers + cfg.vocab_size * cfg.hidden_size


def time_update(cfg, params, dtypes, seqs: int, seq_len: int, micro: int, steps: int):
    pcfg = objectives.policy_loss_config(AlgorithmSection(kl_coef=0.0), seq_len)
    loss = functools.partial(objectives.actor_loss, cfg, pcfg, 1.0, False, 0.0)
    optimizer = make_optimizer(1e-6, total_steps=steps + 2)
    update = jax.jit(
        make_update(
            lambda p, mb, d: loss(dtypes.cast_for_compute(p), mb, d),
            optimizer,
            denoms_fn=functools.partial(objectives.actor_denominator, pcfg),
        ),
        donate_argnums=0,
    )
    M, b, T = seqs // micro, micro, seq_len
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (M, b, T)), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (M, b, T)),
        "attention": jnp.ones((M, b, T), jnp.int32),
        "loss_mask": jnp.ones((M, b, T), jnp.float32).at[:, :, : T // 4].set(0),
        "advantages": jnp.asarray(rng.normal(size=(M, b, T)), jnp.float32),
        "correct": jnp.zeros((M, b), jnp.float32),
        "old_logp": jnp.full((M, b, T), -5.0, jnp.float32),
    }
    state = create_train_state(jax.tree.map(jnp.copy, params), optimizer, 0)  # donated
    t0 = time.perf_counter()
    state, _ = update(state, batch)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = update(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def time_decode(cfg, params, dtypes, batch: int, new_tokens: int, prompt_len: int):
    engine = EngineCore(
        cfg,
        params,
        slots=batch,
        max_len=prompt_len + new_tokens + 16,
        max_prefill_length=max(16, 1 << (prompt_len - 1).bit_length()),
        dtype=dtypes.compute_dtype,
        cache_dtype=dtypes.cache_dtype,
        sampling=SamplingParams(temperature=0.0),
        eos_token_ids=[],
    )
    prompt = list(range(1, prompt_len + 1))

    def once():
        state = engine.init_decode_state()
        greedy = SamplingParams(temperature=0.0)
        reset = [(jax.random.PRNGKey(i), greedy) for i in range(batch)]
        state = engine.write_slots(
            params, state, list(range(batch)), [prompt] * batch, starts=[0] * batch, reset=reset
        )
        t0 = time.perf_counter()
        state, out = engine.generate_steps(params, state, new_tokens)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0

    once()  # compile
    return min(once() for _ in range(3)) / new_tokens  # seconds per decode step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", help="compute dtype (master weights fp32)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per update")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=24, help="fewer for a quick check of the script")
    args = ap.parse_args()

    dtype = jnp.dtype(args.dtype)
    if jax.default_backend() == "cpu":
        host.keep_freed_memory()  # as `jaxrl-tools` runs on CPU
    roof = Roofline.measure(dtype)
    print(roof.describe(), f"({args.dtype}); load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    cfg = dataclasses.replace(QWEN25_05B, num_hidden_layers=args.layers)
    params = models.init_params(cfg, jax.random.key(0))
    dtypes = models.DTypePolicy(param="float32", compute=args.dtype, cache=args.dtype)
    n_all = sum(x.size for x in jax.tree.leaves(params))
    n_mm = matmul_params(cfg, params)
    print(
        f"model: Qwen2.5-0.5B shapes, {n_all / 1e6:.0f}M parameters ({n_mm / 1e6:.0f}M in matmuls)"
    )

    T, S = args.seq_len, args.seqs
    attn = 6 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T * T / 2
    flops = 6 * n_mm * S * T + S * attn
    moved = 16 * n_all  # weights, gradients and Adam's two moments, read or written once
    step_s, compile_s = time_update(cfg, params, dtypes, S, T, args.micro, args.steps)
    util = roof.utilisation(step_s, flops, moved)
    print(
        f"update: {S} x {T} tokens, micro-batches of {args.micro}: {step_s:.2f} s/step "
        f"(compile {compile_s:.0f} s), {flops / 1e12:.2f} TFLOP -> "
        f"{flops / step_s / 1e9:,.0f} GFLOP/s = {util:.0%} of the matmul floor "
        f"({roof.floor_s(flops, moved):.2f} s)"
    )
    for batch in (int(b) for b in args.decode_batches.split(",")):
        live = 32 + args.new_tokens // 2  # mean live length over the timed steps
        kv = models.cache_bytes(cfg, batch, live, dtype)
        step = time_decode(cfg, params, dtypes, batch, args.new_tokens, 32)
        # The tied embedding is read once, as the LM head.
        f_dec, b_dec = roof.decode_work(n_mm, dtype.itemsize, batch, kv)
        floor = roof.floor_s(f_dec, b_dec)
        bound = "bandwidth" if b_dec / roof.bytes_per_s > f_dec / roof.flops_per_s else "matmul"
        print(
            f"decode batch {batch}: {step * 1e3:.1f} ms/step = {batch / step:,.0f} tokens/s, "
            f"{floor / step:.0%} of its {bound}-bound floor "
            f"({floor * 1e3:.1f} ms; reads {b_dec / step / 1e9:.1f} GB/s, "
            f"{math.floor(f_dec / step / 1e9):,} GFLOP/s)"
        )


if __name__ == "__main__":
    main()
