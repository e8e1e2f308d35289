"""Steps per second and device-idle fraction of the tool-math recipe with rollouts k = 0, 1, 2
and 4 policy versions ahead of the update (`trainer.max_staleness`), with a slow tool and
long-tailed response lengths.

The demo's recipe (`configs/grpo_tool_math.yaml`: tiny Qwen2, the sandboxed Python tool, GRPO,
8 prompts x 8 samples) after an SFT warm-up on traces that all call the tool (`--tool-mix`; the
demo's 0.4 leaves RL to teach the call), made agentic:
- every tool call takes 200 ms more (`--tool-ms`: a sandbox on another host, or an API), the
  sleep before the sandboxed run, up to `rollout.tool_concurrency` at once;
- response lengths are long-tailed: a logits hook forbids EOS until each sample's target
  length, drawn once per sample index from a Pareto distribution (most responses end as the
  policy wants, a few run to `--max-response`).
Each k runs the same steps from the same SFT weights in this process (`algorithm.tis_cap: 2`),
after an unmeasured run that compiles the shapes they meet.
Device busy: the union of the intervals in which a decode chunk or an update runs (a chunk from
its dispatch to its tokens on the host; an update from its dispatch to its metrics on the host);
idle fraction = 1 - busy / wall, both over steps skip+1 .. steps (from the end of update `skip`
to the end of update `steps`; each run goes on for max(ks) + 1 more steps, so the batches
sampled ahead at the window's start are matched by as many at its end). Prints steps per
second and its ratio to k = 0, the idle fraction, and the means of the step's parts.

Run: .venv/bin/python benchmarks/bench_async_rollouts.py [--steps 34] [--ks 0,1,2,4]
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from jaxrl_tools.tools.python_tool import PythonTool


class SlowPython(PythonTool):
    """The sandboxed Python tool, `delay_s` slower per call."""

    def __init__(self, *, delay_s: float, **kwargs):
        super().__init__(**kwargs)
        self.delay_s = delay_s

    async def _call(self, arguments, session_id):
        await asyncio.sleep(self.delay_s)
        return await super()._call(arguments, session_id)


def hold_eos(logits_BV, sampled_B, seq_B, data):
    """Forbids EOS until each sample has `data["target"][seq % n]` model tokens."""
    import jax.numpy as jnp  # noqa: PLC0415

    target = data["target"]
    hold_B = sampled_B < target[seq_B % target.shape[0]]
    eos_V = jnp.zeros((logits_BV.shape[-1],), bool).at[data["eos"]].set(True)
    return jnp.where(hold_B[:, None] & eos_V[None, :], -1e9, logits_BV)


def union_s(intervals, lo, hi) -> float:
    """Seconds of [lo, hi] covered by the union of `intervals`."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=34)
    ap.add_argument("--skip", type=int, default=4, help="first steps left out (compiles)")
    ap.add_argument("--ks", default="0,1,2,4")
    ap.add_argument("--tool-ms", type=float, default=200.0)
    ap.add_argument("--max-response", type=int, default=256)
    ap.add_argument("--pareto", type=float, default=1.2, help="tail index of target lengths")
    ap.add_argument("--sft-traces", type=int, default=1500)
    ap.add_argument("--sft-epochs", type=int, default=3)
    ap.add_argument("--tool-mix", type=float, default=1.0, help="SFT traces that call the tool")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxrl_tools import run
    from jaxrl_tools.config_loader import config_from_dict
    from jaxrl_tools.rollout import loop, sampler
    from jaxrl_tools.train.rl import RLTrainer

    tmp = Path(tempfile.mkdtemp())
    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "configs" / "grpo_tool_math.yaml").read_text())
    raw["tokenizer"]["path"] = f"{tmp}/tokenizer"
    raw["rollout"]["max_response_len"] = args.max_response
    raw["tools"][0]["class"] = f"{__name__}.SlowPython"
    raw["tools"][0]["config"]["delay_s"] = args.tool_ms / 1000
    raw["algorithm"]["tis_cap"] = 2.0
    raw["sft"].update(num_traces=args.sft_traces, epochs=args.sft_epochs, tool_mix=args.tool_mix)
    # Every run goes max(ks) + 1 steps past the measured ones, so that at both ends of the
    # window the worker may be as far ahead as it likes (no head start counted as speed).
    ks = [int(x) for x in args.ks.split(",")]
    raw["trainer"].update(steps=args.steps + max(ks) + 1, checkpoint_every=0)

    def config(name, k):
        cfg = json.loads(json.dumps(raw))
        cfg["trainer"].update(
            max_staleness=k, log_dir=f"{tmp}/{name}/logs", checkpoint_dir=f"{tmp}/{name}/ckpt"
        )
        return config_from_dict(cfg)

    # Long-tailed lengths: target model tokens per sample index (the batch's 64 samples).
    rng = np.random.default_rng(0)
    targets = np.minimum(16 * (1 + rng.pareto(args.pareto, 64)), args.max_response)
    core = sampler.ENGINES["core"]()

    def long_tailed_engine(*a, **kw):
        engine = core(*a, logits_hook=hold_eos, **kw)
        eos = np.asarray(engine.eos_token_ids, np.int32)
        engine.hook_data = {"target": jnp.asarray(targets, jnp.int32), "eos": jnp.asarray(eos)}
        return engine

    sampler.ENGINES["core"] = lambda: long_tailed_engine

    # Device-busy intervals: decode chunks and updates.
    busy, update_end = [], []
    decode = loop.Driver._decode

    async def timed_decode(self, active):
        t0 = time.perf_counter()
        out = await decode(self, active)
        busy.append((t0, time.perf_counter()))
        return out

    loop.Driver._decode = timed_decode
    dispatch, finish = RLTrainer.dispatch, RLTrainer.finish

    def timed_dispatch(self, batch):
        return (time.perf_counter(), dispatch(self, batch))

    def timed_finish(self, timed):
        t0, dispatched = timed
        out = finish(self, dispatched)
        busy.append((t0, time.perf_counter()))
        update_end.append(time.perf_counter())
        return out

    RLTrainer.dispatch, RLTrainer.finish = timed_dispatch, timed_finish

    cfg = config("sft", 0)
    tokenizer = run.setup_tokenizer(cfg)
    model_cfg, params = run.setup_model(cfg, tokenizer)
    sft_params = run.run_sft(cfg, model_cfg, params, tokenizer)

    results = {}
    # A first, unmeasured run compiles every shape the runs meet (long-tailed lengths give the
    # update and the engine's buckets many); the measured runs then share the compiled programs.
    run.train(config("warmup", ks[0]), init_params=jax.tree.map(jnp.copy, sft_params))
    for k in ks:
        busy.clear()
        update_end.clear()
        start = jax.tree.map(jnp.copy, sft_params)  # the update donates its input
        run.train(config(f"k{k}", k), init_params=start)
        lo, hi = update_end[args.skip - 1], update_end[args.steps - 1]
        lines = (tmp / f"k{k}" / "logs" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines][args.skip : args.steps]
        r = {
            "steps_per_s": (args.steps - args.skip) / (hi - lo),
            "idle_frac": 1 - union_s(busy, lo, hi) / (hi - lo),
        }
        keys = ["time/rollout_s", "time/update_s", "rollout/tokens"]
        keys += ["tools/calls_per_response", "async/trainer_wait_s", "async/staleness_mean"]
        for key in keys:
            if key in records[0]:
                r[key] = statistics.mean(rec[key] for rec in records)
        r["reward_mean"] = statistics.mean(rec["reward/mean"] for rec in records)
        results[k] = r

    load = os.getloadavg()[0]
    print(
        f"tool-math, {args.tool_ms:.0f} ms tool, Pareto({args.pareto}) lengths up to "
        f"{args.max_response} (mean target {targets.mean():.0f}, max {targets.max():.0f}), "
        f"steps {args.skip + 1}..{args.steps}, load {load:.2f}"
    )
    base = results[min(results)]["steps_per_s"]
    for k, r in results.items():
        parts = "  ".join(f"{key}={v:.3f}" for key, v in r.items())
        print(f"  k={k}: {r['steps_per_s'] / base:.2f}x  {parts}")


if __name__ == "__main__":
    main()
