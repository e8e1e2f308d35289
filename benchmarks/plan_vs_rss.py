"""Does `plan` tell the truth? Its update figure against the memory a real CPU step takes.

A Qwen2.5-0.5B-shaped policy (fp32 master weights and AdamW state; `--compute bfloat16` for a
bf16 compute copy) and one GRPO RL step: `plan.plan_memory` compiles it on abstract shapes and
gives the step's per-device peak (arguments + outputs - donated + temporaries). Then the same
step is compiled for real arrays (before any is allocated, so that compilation's
own memory is not counted), the state and batch are allocated, and one step runs while a thread
samples the process's resident memory (VmRSS) every 5 ms. The figure compared with the plan is
the peak RSS during allocation and the step minus the RSS just before allocation.

Run: python benchmarks/plan_vs_rss.py [--seq-len 512 --seqs 4 --micro 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
from bench_utilisation import QWEN25_05B

from jaxrl_tools import models, plan, sharding
from jaxrl_tools.train.step import make_rl_step
from jaxrl_tools.train.step_inputs import full_batch, step_inputs
from jaxrl_tools.train.step_state import create_rl_state


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
    settings = plan.grpo_settings(cfg, dtypes=dtypes, micro_batch_size=b)
    figures = plan.plan_memory(
        settings, mesh=mesh, rows=M * b, seq_len=T, slots=1, cache_len=16, functions=("update",)
    )
    planned = figures["update"]
    print(f"plan: RL step peak {planned.peak / 2**30:.2f} GiB ({planned})")

    # The same step (one object: make_rl_step), compiled for real arrays before any exists.
    step = make_rl_step(settings, mesh)
    compiled = step.lower_shapes(M * b, T).compile()
    host_batch, _ = step_inputs(full_batch(M * b, T), settings)
    key = jax.random.key(0)
    shardings = step.state_shardings
    init = (
        jax.jit(
            lambda k: create_rl_state(settings, models.init_params(cfg, k)),
            out_shardings=shardings,
        )
        .lower(key)
        .compile()
    )

    before = rss()
    with PeakRSS() as peak:
        state = init(key)
        batch = jax.device_put(host_batch, step.batch_sharding)
        _, metrics = compiled(state.replace(frozen=None), state.frozen, batch)
        jax.block_until_ready(metrics)
    used = peak.peak - before
    print(
        f"measured: peak RSS {used / 2**30:.2f} GiB above the {before / 2**30:.2f} GiB before "
        f"allocation; plan / measured = {planned.peak / used:.2f}"
    )


if __name__ == "__main__":
    main()
