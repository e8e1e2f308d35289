"""The RL step and the decode step on a GPU, against what `plan` says of them without one.

A random model of Qwen2.5-0.5B's shapes (`--model`: another of `shapes.py`), bf16 compute over
fp32 master weights and AdamW, GRPO (G = 4) on R rows of T tokens (right-padded to random
lengths) in micro-batches of M; the engine's decode step over S slots of L cache positions (one
token per slot, whole rows read).
On the first GPU of this machine:

1. memory: per device, each step's arguments / temporaries / peak as XLA:GPU plans them
   deviceless for an H200 (`targets`: what `jaxrl-tools plan --accelerator h200` gives on a
   host without a GPU) and compiled on this GPU; and the peak the device measured while the
   steps ran (`memory_stats()["peak_bytes_in_use"]`).
2. speed: each step's time against its floor on this GPU (`plan.floors` of the program that
   ran: matmul FLOPs at 989 TFLOP/s, HBM bytes at 4.8 TB/s).
3. kernels: attention "auto" is cuDNN flash attention here; the step's log-probs with it against
   the dense path, same weights and rows, and the first update's loss and gradient norm.

`--deviceless` computes part 1's deviceless figures only (a CPU host with the aot-gpu extra).

Run: python benchmarks/gpu_step.py [--rows 16 --seq-len 2048 --micro 4 --slots 64
       --cache-len 4096] [--json out.json] [--deviceless]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # bytes in use mean something

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import CONFIG_JSON  # noqa: E402

from jaxrl_tools import models, plan, sharding, targets  # noqa: E402
from jaxrl_tools.train.step import make_rl_step  # noqa: E402
from jaxrl_tools.train.step_inputs import full_batch, step_inputs  # noqa: E402
from jaxrl_tools.train.step_state import create_rl_state  # noqa: E402

GIB = 2**30
H200 = targets.ACCELERATORS["h200"]


def settings_for(cfg, a, attention: str = "auto"):
    dtypes = models.DTypePolicy(param="float32", compute="bfloat16", cache="bfloat16")
    s = plan.grpo_settings(
        cfg, dtypes=dtypes, micro_batch_size=a.micro, attention=attention, remat=a.remat
    )
    return dataclasses.replace(s, group_size=4)


def memory(m: plan.Memory) -> dict:
    return {
        "arguments": m.arguments / GIB,
        "temporaries": m.temporaries / GIB,
        "peak": m.peak / GIB,
    }


def compiled_steps(settings, mesh, a) -> dict:
    """{"update", "decode"}: Compiled for `mesh`'s devices."""
    return plan.compile_functions(
        settings, mesh=mesh, rows=a.rows, seq_len=a.seq_len, slots=a.slots, cache_len=a.cache_len
    )


def the_batch(a, seed: int = 0):
    """Random tokens, rows right-padded to lengths in [T/2, T], responses after T/4, random
    scores (group-relative advantages that are not zero)."""
    rng = np.random.default_rng(seed)
    b = full_batch(a.rows, a.seq_len)
    lengths = rng.integers(a.seq_len // 2, a.seq_len + 1, a.rows)
    lengths[0] = a.seq_len
    pos = np.arange(a.seq_len)[None]
    valid = pos < lengths[:, None]
    return dataclasses.replace(
        b,
        tokens_RT=np.where(valid, rng.integers(0, 150_000, b.tokens_RT.shape), 0).astype(np.int32),
        attention_RT=valid.astype(np.int32),
        loss_mask_RT=(valid & (pos >= a.seq_len // 4)).astype(np.float32),
        scores_R=rng.normal(size=a.rows).astype(np.float32),
    )


def peak_gib(device) -> float | None:
    stats = device.memory_stats()  # None on a CPU
    return None if stats is None else stats["peak_bytes_in_use"] / GIB


def timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def deviceless(cfg, a) -> dict:
    targets.prepare("cuda")
    mesh = sharding.make_mesh((1, 1, 1), targets.target_devices("h200", "1x1x1"))
    compiled = compiled_steps(settings_for(cfg, a), mesh, a)
    fl = plan.floors(compiled, H200)
    return {
        name: dict(memory(plan.Memory.of(c)), floor_s=fl[name].seconds)
        for name, c in compiled.items()
    }


def on_device(cfg, a, report: dict) -> None:
    device = jax.devices()[0]
    mesh = sharding.make_mesh((1, 1, 1), [device])
    settings = settings_for(cfg, a)
    t0 = time.perf_counter()
    compiled = compiled_steps(settings, mesh, a)
    report["compile_s"] = time.perf_counter() - t0
    fl = plan.floors(compiled, H200)
    report["cudnn_in_update"] = "__cudnn$fmha" in compiled["update"].as_text()
    for name, c in compiled.items():
        report[name] = dict(memory(plan.Memory.of(c)), floor_s=fl[name].seconds)
        report[name]["flops"], report[name]["bytes"] = fl[name].cost.flops, fl[name].cost.bytes
    print(json.dumps(report, indent=1), flush=True)

    # The update, run: the state and rows placed as the step takes them.
    step = make_rl_step(settings, mesh)
    params = models.init_params(cfg, jax.random.key(0))
    state = create_rl_state(settings, params, shardings=step.state_shardings, mesh=mesh)
    del params
    inputs, _ = step_inputs(the_batch(a), settings)
    held = {"trained": state.replace(frozen=None)}
    held["inputs"] = jax.device_put(inputs, step.batch_sharding)

    def run_update():
        held["trained"], metrics = compiled["update"](held["trained"], state.frozen, held["inputs"])
        return metrics

    first = jax.device_get(run_update())
    report["update"]["first_metrics"] = {
        k: float(first[k]) for k in ("actor/loss", "actor/grad_norm") if k in first
    }
    report["update"]["seconds"] = timed(run_update, a.steps)
    report["update"]["floor_fraction"] = report["update"]["floor_s"] / report["update"]["seconds"]
    report["peak_after_update_gib"] = peak_gib(device)
    print("update:", json.dumps(report["update"]), flush=True)

    # The decode step, run on the engine's own state (an empty cache reads as much as a full one).
    held["serving"] = settings.dtypes.cast_for_compute(held.pop("trained").actor.params)
    del held["inputs"]
    engine = plan.decode_engine(
        cfg, settings.dtypes, slots=a.slots, cache_len=a.cache_len, mesh=mesh
    )
    held["state"] = engine.init_decode_state()

    def run_decode():
        held["state"], out = compiled["decode"](held["serving"], held["state"], engine.hook_data)
        return out

    jax.block_until_ready(run_decode())
    report["decode"]["seconds"] = timed(run_decode, 20)
    report["decode"]["floor_fraction"] = report["decode"]["floor_s"] / report["decode"]["seconds"]
    report["peak_after_decode_gib"] = peak_gib(device)
    print("decode:", json.dumps(report["decode"]), flush=True)
    held.clear()

    # cuDNN flash attention inside the step's forward against the dense path.
    params = models.init_params(cfg, jax.random.key(1))
    seqs = {k: v[: a.micro] for k, v in step_inputs(the_batch(a, 1), settings)[0]["rows"].items()}
    logp = {}
    for impl in ("auto", "dense"):
        s = settings_for(cfg, a, impl)
        lp, _ = make_rl_step(s, mesh).logprobs(params, seqs)
        logp[impl] = np.asarray(lp, np.float32)
    mask = np.asarray(seqs["loss_mask"]) > 0
    diff = np.abs(logp["auto"] - logp["dense"])[mask]
    report["attention"] = {
        "max_abs_logp_diff": float(diff.max()),
        "mean_abs_logp_diff": float(diff.mean()),
        "mean_abs_logp": float(np.abs(logp["dense"][mask]).mean()),
    }
    print("attention:", json.dumps(report["attention"]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a shape of shapes.py")
    ap.add_argument("--remat", action="store_true", help="remat each layer (model.remat)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--cache-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, help="fewer layers: a quick check of the script")
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--deviceless", action="store_true", help="the deviceless figures only")
    a = ap.parse_args()
    cfg = models.ModelConfig.from_hf(CONFIG_JSON[a.model])
    if a.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers)
    report = {"jax": jax.__version__, "shapes": vars(a).copy()}
    try:
        report["deviceless_h200"] = deviceless(cfg, a)
    except Exception as e:  # noqa: BLE001 - reported, and the device part still runs
        report["deviceless_h200"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    print("deviceless:", json.dumps(report["deviceless_h200"]), flush=True)
    if not a.deviceless:
        report["device"] = jax.devices()[0].device_kind
        try:
            on_device(cfg, a, report)
        finally:
            if a.json:
                json.dump(report, open(a.json, "w"), indent=1)
    elif a.json:
        json.dump(report, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
