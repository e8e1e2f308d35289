"""Every paper-scale recipe planned by its target's own compiler, without the device: XLA:GPU for
the H100s the recipe names, and the TPU compiler for the smallest TPU v5p slice it fits.

Each recipe names a Hugging Face model folder that is not on this machine; its architecture is
written here from the model's published `config.json` fields (`shapes.py`: shapes only, no
weights). Per recipe, as `jaxrl-tools plan --accelerator` plans it (`plan.plan_target`):
  GPU   the recipe's own `trainer.mesh` (and `rollout.mesh`) over that many H100 80GB devices;
  TPU   the smallest v5p slice (4 to 128 chips) whose plan fits a chip's 95 GiB: the recipe's
        tensor width, fsdp over the other chips, micro-batches widened with fsdp (each chip holds
        the rows a GPU did), decoding on the trainer mesh;
  CPU   with --cpu, the CPU compiler's estimate on simulated devices of the GPU mesh (what `plan`
        gives without the aot extras).
Per device: each phase's peak with what stays resident (the train state, the engine's bf16 copy),
and each phase's roofline floor on the target (`plan.floors`).

Needs the aot extras: pip install -e '.[aot-gpu,aot-tpu]'
Run: python benchmarks/plan_recipes.py [--recipes retool,search_r1] [--no-tpu] [--cpu] [--search]
       [rollout.slots=64 ...]
"""

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

DEVICES = 32  # simulated CPU devices (--cpu): the largest GPU mesh
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # targets.prepare("cuda")

from shapes import CONFIG_JSON  # noqa: E402 - after XLA_FLAGS

# The recipes' model folders -> architecture (Instruct, Math and Coder variants share shapes).
RECIPES = {
    "retool": "qwen2.5-32b",
    "retool_paper": "qwen2.5-32b",
    "dapo": "qwen2.5-32b",
    "vapo": "qwen2.5-32b",
    "drgrpo": "qwen2.5-7b",
    "zerotir": "qwen2.5-7b",
    "artist": "qwen2.5-7b",
    "artist_functions": "qwen2.5-7b",
    "mixed_tools": "qwen2.5-7b",
    "toolrl_grpo": "qwen2.5-7b",
    "tool_n1": "qwen2.5-7b",
    "search_r1": "qwen2.5-3b",
    "deepresearcher": "qwen2.5-7b",
    "deepretrieval_search": "qwen2.5-3b",
    "deepretrieval_sql": "qwen2.5-3b",
    "torl": "qwen2.5-1.5b",
    "refine_kevin": "qwen2.5-7b",
    "sokoban_gigpo": "qwen2.5-1.5b",
    "sokoban_starpo": "qwen2.5-0.5b",
    "frozenlake_grpo": "qwen2.5-0.5b",
}


V5P_CHIPS = (4, 8, 16, 32, 64, 128)
ROOT = Path(__file__).resolve().parents[1]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def show(title: str, p, took: float) -> None:
    print(f"  {title} ({took:.0f} s):")
    for line in p.lines():
        print("    " + line)


def cells(p) -> list[str]:
    """[GiB update / decode, floor update / decode] of a plan ("-" for none)."""
    from jaxrl_tools import plan

    if p is None:
        return ["-", "-"]
    fl = p.floors or {}
    return [
        f"{gib(p.totals['update'])} / {gib(p.totals['decode'])}",
        " / ".join(plan.report.format_seconds(fl[f].seconds) for f in plan.FUNCTIONS if f in fl),
    ]


def attempt(title: str, fn):
    """fn()'s plan, shown; None (and why, shown) when the compiler or the config refuses it."""
    from jaxrl_tools import targets
    from jaxrl_tools.config import ConfigError

    t0 = time.perf_counter()
    try:
        p = fn()
    except (ConfigError, ValueError, targets.TargetUnavailable) as e:
        print(f"  {title}: {e}")
        return None
    show(title, p, time.perf_counter() - t0)
    return p


def smallest_v5p(load, cfg):
    """(chips, plan) of the smallest v5p slice whose plan fits, or None."""
    from jaxrl_tools import plan, targets

    d, f, t = cfg.trainer.mesh_shape
    per_device = max(cfg.optim.micro_batch_size // (d * f), 1)
    rows_per_mini = cfg.update_rows // cfg.optim.num_mini_batches
    tried = {}

    def on(k: int):
        chips = V5P_CHIPS[k]
        if chips not in tried:
            tt = math.gcd(t, chips)
            per = per_device  # rows per chip of a micro-batch, as many as a mini-batch has
            while per > 1 and rows_per_mini % (per * (chips // tt)):
                per //= 2
            over = [
                f"trainer.mesh=1x{chips // tt}x{tt}",
                f"optim.micro_batch_size={per * (chips // tt)}",
                "rollout.mesh=null",
            ]
            v5p = targets.ACCELERATORS["v5p"]
            tried[chips] = attempt(
                f"{v5p.compiler}, {' '.join(over)}", lambda: plan.plan_target(load(*over), "v5p")
            )
        return tried[chips]

    def fits(k: int) -> bool:
        p = on(k)
        return p is not None and p.fits

    n = d * f * t
    k = next((i for i, c in enumerate(V5P_CHIPS) if c >= max(4, n // 2)), len(V5P_CHIPS) - 1)
    if fits(k):
        while k > 0 and fits(k - 1):
            k -= 1
        return V5P_CHIPS[k], on(k)
    larger = (j for j in range(k + 1, len(V5P_CHIPS)) if fits(j))
    j = next(larger, None)
    return None if j is None else (V5P_CHIPS[j], on(j))


def recipe_row(name: str, args, folder: Path) -> list[str]:
    import jax

    from jaxrl_tools import plan, sharding, targets
    from jaxrl_tools.config_loader import load_config

    def load(*over):
        path = ROOT / "configs" / f"{name}.yaml"
        return load_config(path, [f"model.path={folder}", *args.overrides, *over])

    cfg = load()
    n = math.prod(cfg.trainer.mesh_shape)
    r = cfg.rollout
    print(f"\n{name} ({r.slots} slots x {r.max_prompt_len}+{r.max_response_len} tokens)")
    h100 = targets.ACCELERATORS["h100-80g"]
    row = [f"`{name}`", RECIPES[name], f"{n} ({cfg.trainer.mesh})"]
    row += cells(
        attempt(h100.compiler, lambda: plan.plan_target(cfg, h100.name, search=args.search))
    )
    if args.cpu:
        mesh = sharding.make_mesh(cfg.trainer.mesh_shape, jax.devices("cpu")[:n])
        cpu = attempt(
            "CPU compiler (an estimate)",
            lambda: plan.plan_run(cfg, mesh, h100.hbm_bytes, accelerator=h100),
        )
        row += cells(cpu)[:1]
    if not args.no_tpu:
        found = smallest_v5p(load, cfg)
        if found is None:
            row += ["none of 4-128 chips", "-", "-"]
        else:
            chips, p = found
            row += [f"{chips} ({'x'.join(map(str, p.mesh))})", *cells(p)]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--no-tpu", action="store_true", help="skip the TPU column")
    ap.add_argument("--cpu", action="store_true", help="add the CPU compiler's estimate")
    ap.add_argument("--search", action="store_true", help="the largest fitting micro-batch (GPU)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every recipe (a.b=c)")
    args = ap.parse_args()

    import jax

    print(f"jax {jax.__version__}")
    tmp = Path(tempfile.mkdtemp())
    table = []
    for name in args.recipes.split(","):
        folder = tmp / RECIPES[name]
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(CONFIG_JSON[RECIPES[name]]))
        table.append(recipe_row(name, args, folder))

    head = ["recipe", "model", "H100s (mesh)", "XLA:GPU GiB update / decode", "floor"]
    head += ["CPU estimate GiB"] * args.cpu
    head += ["smallest v5p slice (mesh)", "TPU compiler GiB", "floor"] * (not args.no_tpu)
    print("\n| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in table:
        print("| " + " | ".join(row) + " |")
    print("GiB per device, each phase with what stays resident; floors per RL step / decode step")


if __name__ == "__main__":
    main()
