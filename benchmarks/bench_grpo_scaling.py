"""How the GRPO step's time grows with the group size and the response length, against its floor.

`bench_grpo_step.py`'s step (the peers' 12.6M Qwen2 and assets, 8 prompts, temperature 1, one
update per batch, no KL) with the group size G and the response length changed one at a time
from the standard 4 x 64. Each point is the median of `--steps` steps after `--warmup`
(compile) steps, printed with its split (generate / rest) and against its FLOP floor on the
roofline measured in the same process (`Roofline.grpo_step_floor_s`).

Run: .venv/bin/python benchmarks/bench_grpo_scaling.py --peer-dir /work/peerbench
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_grpo_step as bench  # noqa: E402
from roofline import Roofline  # noqa: E402

from jaxrl_tools import host  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-dir", required=True)
    ap.add_argument("--points", default="2x64,4x64,8x64,4x32,4x128", help="G x response tokens")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    import jax

    host.keep_freed_memory()
    roof = Roofline.measure()
    print(roof.describe(), f"load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    peer = bench.load_peer_workload(os.path.abspath(args.peer_dir))
    asset_dir, prompts = peer.ensure_assets()
    for point in args.points.split(","):
        # The step reads its shape from the module's constants when it is built and run.
        bench.G, bench.NEW_TOKENS = (int(x) for x in point.split("x"))
        micro = min(32, bench.P_PROMPTS * bench.G)  # the standard step's micro-batch, or all
        ours = bench.OurGRPO(asset_dir, prompts, chunk=64, micro=micro, seed=0)
        runs = [ours.step(i) for i in range(args.warmup + args.steps)][args.warmup :]
        step = statistics.median(r["step_s"] for r in runs)
        gen = statistics.median(r["generate_s"] for r in runs)
        weights = sum(x.size for x in jax.tree.leaves(ours.trainer.params))
        rows = bench.P_PROMPTS * bench.G
        floor = roof.grpo_step_floor_s(weights, rows, bench.PROMPT_TOKENS + bench.NEW_TOKENS)
        print(
            f"  G={bench.G:2d}, {bench.NEW_TOKENS:3d} new tokens ({rows} rows): {step:6.2f} s/step "
            f"(generate {gen:5.2f}, rest {step - gen:5.2f}); floor {floor:5.2f} s, "
            f"{step / floor:4.1f}x it",
            flush=True,
        )


if __name__ == "__main__":
    main()
