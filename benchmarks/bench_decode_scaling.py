"""How a decode step's cost grows with the batch and with the live length, against its floor.

The peers' model shape (a random Qwen2: vocab 8192, hidden 384, intermediate 1024, 6 layers, 6
heads / 2 KV heads, tied, float32), greedy decoding on `EngineCore`, as `jaxrl-tools` runs on CPU
(freed memory kept: `jaxrl_tools.host`). Each point is the best of 3 timed calls of `--steps`
decode steps after a compile call, prefill excluded:

  batch   1..64 slots, each with a 32-token prompt (live length 32 + steps);
  live    batch 8, prompts of 128..4096 tokens minus the steps (the rows' live length at the end).

Every point is printed against its floor on the roofline measured in the same process
(`Roofline.decode_floor_s`: 2 x matmul weights FLOPs per token, every weight and the live KV
cache read once per step), and with `--plot FILE` drawn as tokens/s with the floor.

Run: .venv/bin/python benchmarks/bench_decode_scaling.py [--plot benchmarks/decode_scaling.png]
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import Roofline  # noqa: E402
from shapes import PEER_QWEN2  # noqa: E402

from jaxrl_tools import host, models  # noqa: E402
from jaxrl_tools.engine.core import EngineCore  # noqa: E402
from jaxrl_tools.engine.sampling import GREEDY  # noqa: E402
from jaxrl_tools.shapes import next_pow2  # noqa: E402

CONFIG = models.ModelConfig.from_hf(PEER_QWEN2)


def step_seconds(params, batch: int, prompt_len: int, steps: int) -> float:
    """Best of 3 calls of `steps` greedy decode steps over `batch` slots, per step."""
    engine = EngineCore(
        CONFIG,
        params,
        slots=batch,
        max_len=next_pow2(prompt_len + steps),
        max_prefill_length=next_pow2(min(prompt_len, 512), 16),
        sampling=GREEDY,
        eos_token_ids=[],
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, CONFIG.vocab_size, size=(batch, prompt_len)).tolist()
    reset = [(jax.random.PRNGKey(i), GREEDY) for i in range(batch)]

    def once() -> float:
        state = engine.init_decode_state()
        for start in range(0, prompt_len, 512):  # in chunks: a 4k prefill's scores would be GBs
            chunk = [p[start : start + 512] for p in prompts]
            state = engine.write_slots(
                params, state, list(range(batch)), chunk, starts=[start] * batch, reset=reset
            )
        jax.block_until_ready(state.logits)
        t0 = time.perf_counter()
        state, out = engine.generate_steps(params, state, steps)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0

    once()  # compile
    return min(once() for _ in range(3)) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--live", default="128,256,512,1024,2048,4096")
    ap.add_argument("--live-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--plot", default=None, help="write the two curves to this PNG")
    args = ap.parse_args()

    host.keep_freed_memory()
    roof = Roofline.measure()
    print(roof.describe(), f"load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    params = models.init_params(CONFIG, jax.random.key(0))
    n_mm = sum(x.size for x in jax.tree.leaves(params))  # tied: the embedding is the LM head

    def point(batch, prompt_len):
        s = step_seconds(params, batch, prompt_len, args.steps)
        live = prompt_len + args.steps // 2  # the mean live length over the timed steps
        floor = roof.decode_floor_s(n_mm, 4, batch, models.cache_bytes(CONFIG, batch, live))
        print(
            f"  batch {batch:3d}, live {prompt_len + args.steps:5d}: {s * 1e3:7.2f} ms/step, "
            f"{batch / s:8,.0f} tokens/s, floor {floor * 1e3:6.2f} ms = {floor / s:4.0%}",
            flush=True,
        )
        return batch / s, batch / floor

    print(f"decode vs batch (32-token prompts, {args.steps} steps):")
    batches = [int(b) for b in args.batches.split(",")]
    by_batch = [point(b, 32) for b in batches]
    print(f"decode vs live length (batch {args.live_batch}):")
    lives = [int(n) for n in args.live.split(",")]
    by_live = [point(args.live_batch, n - args.steps) for n in lives]

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, xs, pts, label in (
            (axes[0], batches, by_batch, "batch (slots)"),
            (axes[1], lives, by_live, f"live length (batch {args.live_batch})"),
        ):
            ax.plot(xs, [p[0] for p in pts], "o-", label="engine")
            ax.plot(xs, [p[1] for p in pts], "--", label="floor (roofline)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("decode tokens/s")
            ax.legend()
        fig.suptitle(roof.describe())
        fig.tight_layout()
        fig.savefig(args.plot, dpi=80)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
