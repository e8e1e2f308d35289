"""Does `plan` tell the truth? Its update figure against the memory a real CPU step takes.

A Qwen2.5-0.5B-shaped policy (fp32 master weights and AdamW state; `--compute bfloat16` for a
bf16 compute copy) and one GRPO RL step: `plan.plan_memory` compiles it on abstract shapes and
gives the step's per-device peak (arguments + outputs - donated + temporaries). Then the same
step is compiled for real arrays (before any is allocated, so that compilation's
own memory is not counted), the state and batch are allocated, and one step runs while a thread
samples the process's resident memory (VmRSS) every 5 ms. The figure compared with the plan is
the peak RSS during allocation and the step minus the RSS just before allocation.

With `--config RECIPE` the step is the recipe's own (`step_config.run_step`: its model from
`model.path`'s config.json, random weights of that shape; its optimizer, micro-batches, packing
and shared prompts) at the shapes `plan --config` compiles (`run_shapes`).

Run: python benchmarks/plan_vs_rss.py [--seq-len 512 --seqs 4 --micro 2]
     python benchmarks/plan_vs_rss.py --config smollm2_when_to_call
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
from bench_utilisation import QWEN25_05B

from jaxrl_tools import configs, models, plan, sharding
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.step_config import run_shapes, run_step
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
    ap.add_argument("--config", help="a recipe: its own step at the shapes plan compiles")
    args = ap.parse_args()

    mesh = sharding.make_mesh((1, 1, 1))
    if args.config:
        run_cfg = load_config(configs.resolve(args.config))
        step = run_step(run_cfg, mesh)
        settings, cfg = step.settings, step.settings.model
        shapes = run_shapes(run_cfg)
        rows, T = shapes["rows"], shapes["seq_len"]
    else:
        cfg = QWEN25_05B
        dtypes = models.DTypePolicy(param="float32", compute=args.compute)
        settings = plan.grpo_settings(cfg, dtypes=dtypes, micro_batch_size=args.micro)
        shapes = dict(rows=args.seqs, seq_len=args.seq_len, slots=1, cache_len=16)
        rows, T = args.seqs, args.seq_len
        # The same step (one object: make_rl_step) as the plan compiles.
        step = make_rl_step(settings, mesh)
    figures = plan.plan_memory(settings, mesh=mesh, **shapes, functions=("update",))
    planned = figures["update"]
    print(f"plan: RL step peak {planned.peak / 2**30:.2f} GiB ({planned})")

    # Compiled for real arrays before any exists.
    compiled = step.lower_shapes(rows, T).compile()
    host_batch, _ = step_inputs(full_batch(rows, T, group_size=settings.group_size), settings)
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
