"""Wall time per RL step of the tool-math recipe, on-policy vs one-step asynchronous rollouts.

The demo's recipe (`configs/grpo_tool_math.yaml`: tiny Qwen2, the sandboxed Python tool, GRPO,
8 prompts x 8 samples): a short SFT warm-up (so the policy calls the tool), then the same RL run
twice from the same weights in this process: with `trainer.max_staleness` 0 and 1 (both with
`algorithm.tis_cap: 2`). With async rollouts, step k+1's batch is sampled while step k's update
runs. Prints the median step time of each after the first (compile) steps, its parts, the
ratio, and the asynchronous run's importance-weight statistics.

Run: .venv/bin/python benchmarks/bench_async_rollouts.py [--steps 12] [--sft-traces 1500]
"""

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out (compiles)")
    ap.add_argument("--sft-traces", type=int, default=1500)
    ap.add_argument("--sft-epochs", type=int, default=3)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxrl_tools import run
    from jaxrl_tools.config_loader import load_config

    tmp = Path(tempfile.mkdtemp())
    root = Path(__file__).resolve().parents[1]

    def config(name, **trainer):
        return load_config(
            os.fspath(root / "configs" / "grpo_tool_math.yaml"),
            [
                f"tokenizer.path={tmp}/tokenizer",
                f"trainer.log_dir={tmp}/{name}/logs",
                f"trainer.checkpoint_dir={tmp}/{name}/ckpt",
                f"trainer.steps={args.steps}",
                "trainer.checkpoint_every=0",
                f"sft.num_traces={args.sft_traces}",
                f"sft.epochs={args.sft_epochs}",
                "algorithm.tis_cap=2.0",
                *[f"trainer.{k}={v}" for k, v in trainer.items()],
            ],
        )

    cfg = config("sft")
    tokenizer = run.setup_tokenizer(cfg)
    model_cfg, params = run.setup_model(cfg, tokenizer)
    sft_params = run.run_sft(cfg, model_cfg, params, tokenizer)

    results = {}
    for name, on in (("on-policy", "false"), ("async", "true")):
        start = jax.tree.map(jnp.copy, sft_params)  # the update donates its input
        run.train(config(name, max_staleness=int(on)), init_params=start)
        lines = (tmp / name / "logs" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines][args.skip :]
        keys = ["time/step_s", "time/rollout_s", "time/update_s", "tools/calls_per_response"]
        if on == "true":
            keys += ["async/trainer_wait_s", "actor/is_weight_mean", "actor/is_truncated_frac"]
        results[name] = {k: statistics.median(r[k] for r in records) for k in keys}
        results[name]["reward_mean_last"] = records[-1]["reward/mean"]

    load = os.getloadavg()[0]
    print(f"tool-math recipe, steps {args.skip + 1}..{args.steps}, load {load:.2f}")
    for name, r in results.items():
        print(f"  {name:10s}", "  ".join(f"{k}={v:.3f}" for k, v in r.items()))
    ratio = results["on-policy"]["time/step_s"] / results["async"]["time/step_s"]
    print(f"  on-policy step / async step = {ratio:.2f}x")


if __name__ == "__main__":
    main()
