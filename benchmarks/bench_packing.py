"""The GRPO update on padded rows vs packed rows (`optim.pack`), same batch, same process.

A random Qwen2-shaped policy (default 4 layers x 256 wide, vocab 8,192: ~5M parameters) and one
batch of 8 prompts x G=8 responses whose lengths are spread as an RL batch's are: prompts of
64-128 tokens, responses drawn from a long-tailed distribution up to `--max-response` (most
short, a few hitting the limit). The padded update computes on 64 rows of the longest sequence's
width; the packed one on as few rows of that width as hold the same tokens. Both trainers
start from the same weights; prints the median update time over `--steps` after one warm-up
(compile) step, the ratio, each layout's fill (real tokens / computed slots) and the largest
parameter difference after the steps (packing changes the layout, not the update).

Run: .venv/bin/python benchmarks/bench_packing.py [--steps 3] [--max-response 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from shapes import bench_qwen2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxrl_tools import models, run
    from jaxrl_tools.config_loader import config_from_dict
    from jaxrl_tools.train.batch import make_batch
    from jaxrl_tools.types import Span, Trajectory

    vocab, prompts, G = 8192, 8, 8
    model_cfg = models.ModelConfig(**bench_qwen2(args.hidden, args.layers))
    params = models.init_params(model_cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    trajs, records = [], []
    for g in range(prompts):
        prompt = rng.integers(3, vocab, int(rng.integers(64, 129))).tolist()
        records.append({"prompt": "p", "ground_truth": "7"})
        for j in range(G):
            n = int(min(args.max_response, 16 + rng.exponential(args.max_response / 5)))
            text = "\\boxed{7}" if rng.random() < 0.5 else "\\boxed{8}"
            resp = rng.integers(3, vocab, n).tolist()
            spans = [Span("model", 0, n)]
            trajs.append(
                Trajectory(g, j, prompt, resp, [1] * n, [0.0] * n, spans, response_text=text)
            )

    def trainer(pack):
        cfg = config_from_dict(
            {
                "tokenizer": {"path": "unused"},
                "data": {"batch_size": prompts},
                "rollout": {"group_size": G, "max_response_len": args.max_response},
                "algorithm": {"kl_coef": 0.0, "loss_agg_mode": "seq-mean-token-mean"},
                "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
                "optim": {"lr": 1e-5, "micro_batch_size": args.micro, "pack": pack},
                "trainer": {"steps": args.steps + 1},
            }
        )
        # (the update donates its state: each trainer gets its own copy of the weights)
        rl = run.make_trainer(cfg, model_cfg, jax.tree.map(np.array, params))
        batch = make_batch(
            records,
            trajs,
            run.make_reward(cfg),
            cfg.algorithm.filters,
            group_size=G,
            rows=rl.rows,
            pad_id=0,
        )
        return rl, batch

    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.1f}M parameters; load {load}")
    results = {}
    for name, pack in (("padded", False), ("packed", True)):
        rl, batch = trainer(pack)
        t0 = time.perf_counter()
        m = rl.step(batch)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            m = rl.step(batch)
            times.append(m["time/update_s"])
        tokens = int(batch.attention_RT.sum())
        rows = int(m.get("packing/rows", batch.tokens_RT.shape[0]))
        fill = tokens / (rows * batch.tokens_RT.shape[1])
        results[name] = (statistics.median(times), jax.tree.map(np.asarray, rl.params))
        print(
            f"{name}: {rows} rows x {batch.tokens_RT.shape[1]} tokens, fill {fill:.2f}; "
            f"update {statistics.median(times):.2f} s (first step {compile_s:.1f} s), "
            f"{tokens / statistics.median(times):,.0f} tokens/s"
        )
    diff = jax.tree.reduce(
        max,
        jax.tree.map(
            lambda a, b: float(np.max(np.abs(a - b))),
            results["padded"][1],
            results["packed"][1],
        ),
    )
    print(
        f"packed / padded speed: {results['padded'][0] / results['packed'][0]:.2f}x; "
        f"largest parameter difference after {args.steps + 1} steps: {diff:.1e}"
    )
    print("load after: " + "/".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
