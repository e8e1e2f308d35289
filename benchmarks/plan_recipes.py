"""`jaxrl-tools plan` for every paper-scale recipe on its own mesh, with simulated CPU devices.

Each recipe names a Hugging Face model folder that is not on this machine; its architecture is
written here from the model's published `config.json` fields (shapes only: no weights are read
or made). The recipe is then planned as `jaxrl-tools plan` plans it: the micro-batched update,
the log-prob pass and a decode step over the recipe's KV cache, compiled for the recipe's
`trainer.mesh` (and `rollout.mesh`) on simulated devices; per-device memory of each phase with
what stays resident, against an H100's 80 GB, and the largest micro-batch that fits.

Run: .venv/bin/python benchmarks/plan_recipes.py [--recipes retool,search_r1] [--hbm h100-80g]
       [--no-search] [rollout.slots=64 ...]
"""

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

DEVICES = 32
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shapes import CONFIG_JSON  # noqa: E402 - after XLA_FLAGS

# The recipes' model folders -> architecture (Instruct, Math and Coder variants share shapes).
RECIPES = {
    "retool": "qwen2.5-32b",
    "dapo": "qwen2.5-32b",
    "zerotir": "qwen2.5-7b",
    "artist": "qwen2.5-7b",
    "toolrl_grpo": "qwen2.5-7b",
    "tool_n1": "qwen2.5-7b",
    "search_r1": "qwen2.5-3b",
    "deepretrieval_search": "qwen2.5-3b",
    "deepretrieval_sql": "qwen2.5-3b",
    "torl": "qwen2.5-1.5b",
    "refine_kevin": "qwen2.5-7b",
    "sokoban_gigpo": "qwen2.5-1.5b",
    "sokoban_starpo": "qwen2.5-0.5b",
    "frozenlake_grpo": "qwen2.5-0.5b",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--hbm", default="h100-80g")
    ap.add_argument("--no-search", action="store_true", help="skip the largest micro-batch")
    ap.add_argument("overrides", nargs="*", help="config overrides for every recipe (a.b=c)")
    args = ap.parse_args()

    import jax

    from jaxrl_tools import plan, sharding, targets
    from jaxrl_tools.config_loader import load_config

    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp())
    hbm = targets.ACCELERATORS[args.hbm].hbm_bytes
    for name in args.recipes.split(","):
        arch = RECIPES[name]
        folder = tmp / arch
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(CONFIG_JSON[arch]))
        cfg = load_config(
            root / "configs" / f"{name}.yaml", [f"model.path={folder}", *args.overrides]
        )
        shape = cfg.trainer.mesh_shape
        n = math.prod(shape)
        if n > DEVICES:
            print(f"\n{name}: mesh {cfg.trainer.mesh} needs {n} devices, {DEVICES} simulated")
            continue
        mesh = sharding.make_mesh(shape, jax.devices()[:n])
        t0 = time.perf_counter()
        try:
            result = plan.plan_run(cfg, mesh, hbm, search=not args.no_search)
        except (
            ValueError
        ) as e:  # a mesh that does not divide the model, a batch that does not split
            print(f"\n{name} ({arch}, mesh {cfg.trainer.mesh}): {e}")
            continue
        r = cfg.rollout
        print(
            f"\n{name} ({arch}; {r.slots} slots x {r.max_prompt_len}+{r.max_response_len} tokens; "
            f"planned in {time.perf_counter() - t0:.0f} s):"
        )
        for line in result.lines():
            print("  " + line)


if __name__ == "__main__":
    main()
