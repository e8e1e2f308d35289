"""`jaxrl-tools plan` of a paper-scale recipe by the CPU compiler and by the target's own compiler.

For each target (an accelerator, or a TPU slice `v5p:4x4x4`), the recipe (its model's published
config.json shapes, no weights: `shapes.py`) is planned twice on the same mesh: on simulated CPU
devices (the CPU compiler's estimate, what `plan` gives without the [aot-*] extras) and on the
target's compile-only devices (`plan.plan_target`: libtpu's TPU compiler, XLA:GPU given the GPU's
description). Per phase: per-device memory with what stays resident, and the roofline floor of
one run on the target (matmul FLOPs at its bf16 peak, HBM bytes at its bandwidth) from each
compiler's program.

A target whose slice has more devices than the recipe's `trainer.mesh` gets the fsdp axis
widened to fill it, and the micro-batch widened with it (the same rows per device).

Run (needs the aot-gpu / aot-tpu extras; the CPU side runs anywhere):
  python benchmarks/plan_targets.py [--recipe retool] [--targets h100-80g,v5p:4x4x4]
       [--no-cpu] [overrides ...]
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from plan_recipes import RECIPES  # (sets 32 simulated devices: overridden below)
from shapes import CONFIG_JSON

DEVICES = 64  # simulated CPU devices: the largest mesh compared (the last flag wins)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)
# XLA:GPU compiles without a GPU: the CUDA plugin's start-up check of the CUDA libraries (which
# needs a driver) is skipped, as `jaxrl-tools plan` does (targets.prepare).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="retool")
    ap.add_argument("--targets", default="h100-80g,v5p:4x4x4")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU compiler's estimate")
    ap.add_argument("overrides", nargs="*", help="config overrides (a.b=c)")
    args = ap.parse_args()

    import jax

    from jaxrl_tools import plan, sharding, targets
    from jaxrl_tools.config import ConfigError
    from jaxrl_tools.config_loader import load_config

    root = Path(__file__).resolve().parents[1]
    arch = RECIPES[args.recipe]
    folder = Path(tempfile.mkdtemp()) / arch
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG_JSON[arch]))
    print(f"jax {jax.__version__}; {args.recipe} ({arch})")

    rows = []
    for spec in args.targets.split(","):
        name, _, shape = spec.partition(":")
        topology = spec if shape else None
        a = targets.ACCELERATORS[name]
        cfg = load_config(
            root / "configs" / f"{args.recipe}.yaml", [f"model.path={folder}", *args.overrides]
        )
        d, f, t = cfg.trainer.mesh_shape
        n = targets.topology_devices(topology) if topology else d * f * t
        over = []
        if n != d * f * t:  # widen fsdp (and the micro-batch) to the slice
            scale = n // (d * f * t)
            over = [
                f"trainer.mesh={d}x{f * scale}x{t}",
                f"optim.micro_batch_size={cfg.optim.micro_batch_size * scale}",
            ]
            cfg = load_config(
                root / "configs" / f"{args.recipe}.yaml",
                [f"model.path={folder}", *args.overrides, *over],
            )
        topology = targets.resolve_topology(a, topology, None, n)
        r = cfg.rollout
        print(
            f"\n== {a.label}, {topology}: {args.recipe} on mesh {cfg.trainer.mesh}"
            f"{' (' + ', '.join(over) + ')' if over else ''}; {r.slots} slots x "
            f"{r.max_prompt_len}+{r.max_response_len} tokens"
        )
        plans = {}
        t0 = time.perf_counter()
        try:
            plans["target"] = plan.plan_target(cfg, name, topology=topology)
            print(f"  {a.compiler}: {time.perf_counter() - t0:.0f} s")
            for line in plans["target"].lines():
                print("    " + line)
        except (ConfigError, targets.TargetUnavailable) as e:
            print(f"  {a.compiler}: {e} ({time.perf_counter() - t0:.0f} s)")
        if not args.no_cpu:
            t0 = time.perf_counter()
            mesh = sharding.make_mesh(cfg.trainer.mesh_shape, jax.devices("cpu")[:n])
            plans["cpu"] = plan.plan_run(
                cfg, mesh, a.hbm_bytes, accelerator=a, compiler="CPU compiler (an estimate)"
            )
            print(f"  CPU compiler, {n} simulated devices: {time.perf_counter() - t0:.0f} s")
            for line in plans["cpu"].lines():
                print("    " + line)
        for phase in plan.FUNCTIONS:
            cells = []
            for key in ("cpu", "target"):
                p = plans.get(key)
                if p is None:
                    cells += ["-", "-"]
                    continue
                fl = p.floors[phase]
                floor = plan.report.format_seconds(fl.seconds)
                cells += [gib(p.totals[phase]), f"{floor} ({fl.bound[0]})"]
            rows.append((f"{a.label} {topology}", cfg.model.attention, phase, *cells))

    print("\n| target | attention | phase | CPU estimate GiB | CPU-program floor | "
          "target compiler GiB | target-program floor |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("GiB: per device, with what stays resident; floor per run (c: compute-, m: memory-bound)")


if __name__ == "__main__":
    main()
