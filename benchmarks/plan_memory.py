"""Per-device memory of paper-scale train steps, compiled for a simulated 8-device CPU mesh.

Qwen2.5-7B- and Llama-3.1-8B-shaped configs (no weights: abstract shapes), fp32 master weights
and AdamW state, bf16 compute and KV cache, on meshes 1x8x1 (fsdp 8) and 1x4x2 (fsdp 4 x tensor
2). `jaxrl_tools.plan.plan_memory` lowers and compiles the trainer's RL step (forwards,
advantages, the micro-batched update) and a decode step; XLA's `memory_analysis()` gives each
one's per-device arguments, temporaries and peak. These are the CPU compiler's figures (an
estimate of a GPU/TPU's).

With `--rollout-mesh DxFxT` the decode step is compiled on that mesh instead (`rollout.mesh`:
the engine's own mesh over the same devices, e.g. tensor-parallel decode beside an fsdp update).

Run: .venv/bin/python benchmarks/plan_memory.py [--seq 8192] [--micro 8] [--slots 64]
       [--rollout-mesh 1x1x8]
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shapes import CONFIG_JSON  # noqa: E402 - after XLA_FLAGS

MODELS = ("qwen2.5-7b", "llama-3.1-8b")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default="1x8x1,1x4x2")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch (all devices)")
    ap.add_argument("--num-micro", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--cache-len", type=int, default=16384)
    ap.add_argument("--remat", default="layer")
    ap.add_argument("--rollout-mesh", default=None, help="compile the decode step on this mesh")
    args = ap.parse_args()

    from jaxrl_tools import models, plan, sharding, targets

    dtypes = models.DTypePolicy(param="float32", compute="bfloat16")
    print(
        f"seq {args.seq}, micro-batch {args.micro} x {args.num_micro}, KV cache {args.slots} x "
        f"{args.cache_len} bf16, remat {args.remat}; fp32 master + AdamW, bf16 compute"
    )
    for name in args.models.split(","):
        cfg = models.ModelConfig.from_hf(CONFIG_JSON[name])
        for shape in args.meshes.split(","):
            mesh = sharding.make_mesh(tuple(int(x) for x in shape.split("x")))
            decode_mesh = None
            if args.rollout_mesh:
                decode_mesh = sharding.make_mesh(sharding.parse_mesh_shape(args.rollout_mesh))
            t0 = time.perf_counter()
            settings = plan.grpo_settings(
                cfg, dtypes=dtypes, micro_batch_size=args.micro, remat=args.remat
            )
            figures = plan.plan_memory(
                settings,
                mesh=mesh,
                rows=args.micro * args.num_micro,
                seq_len=args.seq,
                slots=args.slots,
                cache_len=args.cache_len,
                decode_mesh=decode_mesh,
            )
            took = time.perf_counter() - t0
            on = f", decode on {args.rollout_mesh}" if args.rollout_mesh else ""
            print(f"\n{name} on mesh {shape}{on} (compiled in {took:.0f} s):")
            for line in plan.describe(figures, targets.ACCELERATORS["h100-80g"].hbm_bytes):
                print("  " + line)


if __name__ == "__main__":
    main()
