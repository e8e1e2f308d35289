"""Does `plan` tell the truth? Its update figure against the memory a real CPU step takes.

A Qwen2.5-0.5B-shaped policy (fp32 master weights and AdamW state; `--compute bfloat16` for a
bf16 compute copy) and one micro-batched GRPO update: `plan.plan_memory` compiles it on abstract
shapes and gives the update's per-device peak (arguments + outputs - donated + temporaries).
Then the same update is compiled for real arrays (before any is allocated, so that compilation's
own memory is not counted), the state and batch are allocated, and one step runs while a thread
samples the process's resident memory (VmRSS) every 5 ms. The figure compared with the plan is
the peak RSS during allocation and the step minus the RSS just before allocation.

Run: python benchmarks/plan_vs_rss.py [--seq-len 512 --seqs 4 --micro 2]
"""

from __future__ import annotations

import argparse
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_utilisation import QWEN25_05B

from jaxrl_tools import models, plan, sharding
from jaxrl_tools.config import AlgorithmSection
from jaxrl_tools.train import objectives
from jaxrl_tools.train.state import create_train_state, make_optimizer, make_update


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRSS:
    """Samples VmRSS in a thread while the `with` block runs."""

    def __enter__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compute", default="float32")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro", type=int, default=2)
    args = ap.parse_args()

    cfg = QWEN25_05B
    dtypes = models.DTypePolicy(param="float32", compute=args.compute)
    M, b, T = args.seqs // args.micro, args.micro, args.seq_len
    mesh = sharding.make_mesh((1, 1, 1))
    figures = plan.plan_memory(
        cfg,
        mesh=mesh,
        dtypes=dtypes,
        micro_batch_size=b,
        num_micro=M,
        seq_len=T,
        slots=1,
        cache_len=16,
    )
    planned = figures["update"]
    print(f"plan: update peak {planned.peak / 2**30:.2f} GiB ({planned})")

    pcfg = objectives.policy_loss_config(AlgorithmSection(kl_coef=0.0), T)
    loss = functools.partial(objectives.actor_loss, cfg, pcfg, 1.0, False, 0.0)
    optimizer = make_optimizer(1e-6, total_steps=1)
    update = make_update(
        lambda p, mb, d: loss(dtypes.cast_for_compute(p), mb, d),
        optimizer,
        denoms_fn=functools.partial(objectives.actor_denominator, pcfg),
    )
    shapes = models.param_shapes(cfg, jnp.float32)
    state_shapes = jax.eval_shape(lambda p: create_train_state(p, optimizer, 0), shapes)
    rng = np.random.default_rng(0)
    host_batch = {
        "tokens": rng.integers(0, cfg.vocab_size, (M, b, T)).astype(np.int32),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (M, b, T)).copy(),
        "attention": np.ones((M, b, T), np.int32),
        "loss_mask": np.ones((M, b, T), np.float32),
        "advantages": rng.normal(size=(M, b, T)).astype(np.float32),
        "correct": np.zeros((M, b), np.float32),
        "old_logp": np.full((M, b, T), -5.0, np.float32),
    }
    batch_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_batch)
    compiled = jax.jit(update, donate_argnums=0).lower(state_shapes, batch_shapes).compile()
    key = jax.random.key(0)
    init = (
        jax.jit(lambda k: create_train_state(models.init_params(cfg, k), optimizer, 0))
        .lower(key)
        .compile()
    )

    before = rss()
    with PeakRSS() as peak:
        state = init(key)
        batch = jax.device_put(host_batch)
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    used = peak.peak - before
    print(
        f"measured: peak RSS {used / 2**30:.2f} GiB above the {before / 2**30:.2f} GiB before "
        f"allocation; plan / measured = {planned.peak / used:.2f}"
    )


if __name__ == "__main__":
    main()
