"""Is the LoRA update faster than full fine-tuning's? A recipe's own RL step (`run_step`: its
model's shape from `model.path`'s config.json, random weights; its optimizer, micro-batches,
packing and shared prompts), full and with LoRA adapters on every projection, on one batch:
the demo's (`--fill real`: each group's prompt and 8 responses of the lengths its steps saw)
or `plan`'s (`--fill full`: every token of the padded rows). The two steps alternate in one
process, so a busy machine slows both alike; medians after a warm-up step.

Run: python benchmarks/bench_lora_update.py --config smollm2_when_to_call [--rank 16 --steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from jaxrl_tools import configs, models
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.step_config import run_shapes, run_step
from jaxrl_tools.train.step_inputs import full_batch, step_inputs
from jaxrl_tools.train.step_state import create_rl_state


def demo_batch(rows: int, seq_len: int, group_size: int, prompt: int, lengths: list[int]):
    """A full batch cut to the demo's shape: a `prompt`-token prompt per group (the same in
    each of its rows), then responses of `lengths` (cycled), the rest padding."""
    batch = full_batch(rows, seq_len, group_size=group_size)
    attention, mask = batch.attention_RT.copy(), batch.loss_mask_RT.copy()
    mask[:] = 0.0
    for r in range(rows):
        n = lengths[r % len(lengths)]
        attention[r, prompt + n :] = 0
        mask[r, prompt : prompt + n] = 1.0
    return dataclasses.replace(batch, attention_RT=attention, loss_mask_RT=mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="smollm2_when_to_call")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fill", choices=("real", "full"), default="real")
    args = ap.parse_args()

    cfg = load_config(configs.resolve(args.config))
    lora_cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model,
            lora=dataclasses.replace(
                cfg.model.lora, enabled=True, rank=args.rank, alpha=2.0 * args.rank
            ),
        ),
    )
    shapes = run_shapes(cfg)
    rows, T, G = shapes["rows"], shapes["seq_len"], cfg.rollout.group_size
    if args.fill == "full":
        batch = full_batch(rows, T, group_size=G)
    else:  # the demo's: a 70-token prompt, answers of 12 tokens and tool responses of 50
        batch = demo_batch(rows, T, G, prompt=70, lengths=[12, 50, 12, 12, 50, 12, 30, 12])
    model_cfg = None
    runs = {}
    for name, c in (("full", cfg), (f"LoRA r{args.rank}", lora_cfg)):
        step = run_step(c)
        model_cfg = step.settings.model
        params = models.init_params(model_cfg, jax.random.key(0))
        state = create_rl_state(step.settings, params)
        inputs, metrics = step_inputs(batch, step.settings)
        runs[name] = [step, state, inputs, []]
    rows_desc = metrics.get("packing/rows", rows)
    print(
        f"{args.config}: {model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}, "
        f"vocab {model_cfg.vocab_size}; batch {rows} sequences <= {T} tokens ({args.fill}), "
        f"{rows_desc:g} update rows"
    )
    for i in range(args.steps + 1):  # the first is the compile
        for name, run in runs.items():
            step, state, inputs, times = run
            t0 = time.perf_counter()
            state, m = step(state, inputs)
            jax.block_until_ready(m)
            run[1] = state
            if i:
                times.append(time.perf_counter() - t0)
            else:
                print(f"  {name}: first step (compile) {time.perf_counter() - t0:.1f} s")
    med = {name: statistics.median(run[3]) for name, run in runs.items()}
    (full_name, full_s), (lora_name, lora_s) = med.items()
    trainable = {
        name: sum(np.size(x) for x in jax.tree.leaves(run[1].actor.params))
        for name, run in runs.items()
    }
    for name, s in med.items():
        print(f"  {name}: update {s:.2f} s (median of {args.steps}), {trainable[name]:,} trained")
    ratio = lora_s / full_s
    print(f"lora-update: {lora_name} {lora_s:.2f} s vs full {full_s:.2f} s ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
