"""The GRPO update with each group's prompt laid out once (`optim.share_prefix`) against the padded
update, same batch, same process: time, FLOPs and peak memory.

A random Qwen2-shaped policy (`--hidden`, `--layers`, vocab 8,192; or, compiled on shapes only,
Qwen2.5-7B's: `--qwen-7b --flops-only`) and batches of `--groups` prompts x G samples, every
prompt P tokens and every response R tokens, for each `--shapes` entry P:R:G. The padded update
computes G x (P + R) tokens a group; the shared one a prompt slot of P - 1 and G sample slots of
R + 1, each rounded up (`train.packing.slot_width`), in packed rows of that width
(`optim.pack_width`: a group a row). The FLOPs are the compiled step's matmul FLOPs
(`targets.cost.hlo_cost`, loops counted per iteration), peak memory XLA's `memory_analysis()`;
times are the median and the fastest of `--steps` after a warm-up step (this machine's memory
stalls some steps by up to ~0.5 s). The predicted ratio is the token ratio,
(P - 1 + G (R + 1)) / (G (P + R)), before rounding. As `jaxrl-tools` on CPU, the process keeps
freed memory in malloc's heap (`jaxrl_tools.host`; `--system-malloc`: glibc's default).

Run: .venv/bin/python benchmarks/bench_share_prefix.py [--shapes 256:256:8,512:128:8]
     [--hidden 256] [--layers 4] [--steps 3] [--attention auto] [--flops-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from shapes import CONFIG_JSON, bench_qwen2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256:256:8,512:128:8,256:256:16")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention", default="auto", choices=["auto", "dense", "chunked"])
    ap.add_argument("--flops-only", action="store_true", help="compile on shapes, do not run")
    ap.add_argument("--qwen-7b", action="store_true", help="Qwen2.5-7B's shape (--flops-only)")
    ap.add_argument("--system-malloc", action="store_true", help="glibc's default malloc settings")
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxrl_tools import host, models, run
    from jaxrl_tools.config_loader import config_from_dict
    from jaxrl_tools.plan.memory import Memory
    from jaxrl_tools.targets.cost import hlo_cost
    from jaxrl_tools.train.batch import make_batch
    from jaxrl_tools.train.packing import slot_width
    from jaxrl_tools.train.step import StepSettings, make_rl_step
    from jaxrl_tools.train.step_inputs import step_inputs
    from jaxrl_tools.types import Span, Trajectory

    if not args.system_malloc:
        host.keep_freed_memory()
    vocab = 8192
    model_cfg = models.ModelConfig(**bench_qwen2(args.hidden, args.layers))
    if args.qwen_7b:
        if not args.flops_only:
            raise SystemExit("--qwen-7b: with --flops-only (its weights do not fit this machine)")
        model_cfg = models.ModelConfig.from_hf(CONFIG_JSON["qwen2.5-7b"])
    params = None if args.flops_only else models.init_params(model_cfg, jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(models.param_shapes(model_cfg)))
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"model: {n_params / 1e6:.1f}M parameters, attention {args.attention}; load {load}")

    def batch_and_trainer(P, R, G, shared):
        rng = np.random.default_rng(0)
        trajs, records = [], []
        for g in range(args.groups):
            prompt = rng.integers(3, vocab, P).tolist()
            records.append({"prompt": "p", "ground_truth": "7"})
            for j in range(G):
                text = "\\boxed{7}" if (g + j) % 2 else "\\boxed{8}"
                resp, spans = rng.integers(3, vocab, R).tolist(), [Span("model", 0, R)]
                trajs.append(
                    Trajectory(g, j, prompt, resp, [1] * R, [0.0] * R, spans, response_text=text)
                )
        optim = {"lr": 1e-5, "micro_batch_size": 1 if shared else G}
        if shared:  # a group a row
            optim |= {"share_prefix": True, "pack_width": slot_width(P - 1) + G * slot_width(R + 1)}
        cfg = config_from_dict(
            {
                "tokenizer": {"path": "unused"},
                "model": {"attention": args.attention},
                "data": {"batch_size": args.groups},
                "rollout": {"group_size": G, "max_prompt_len": P, "max_response_len": R},
                "algorithm": {"kl_coef": 0.0, "loss_agg_mode": "seq-mean-token-mean"},
                "reward": [{"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}}],
                "optim": optim,
                "trainer": {"steps": args.steps + 1},
            }
        )
        reward = run.make_reward(cfg)
        batch = make_batch(
            records, trajs, reward, cfg.algorithm.filters, group_size=G, rows=len(trajs), pad_id=0
        )
        if params is None:
            return cfg, None, batch
        # (the update donates its state: each trainer gets its own copy of the weights)
        return cfg, run.make_trainer(cfg, model_cfg, jax.tree.map(np.array, params)), batch

    for shape in args.shapes.split(","):
        P, R, G = map(int, shape.split(":"))
        predicted = (P - 1 + G * (R + 1)) / (G * (P + R))
        out, best = {}, {}
        for name, shared in (("padded", False), ("shared", True)):
            cfg, rl, batch = batch_and_trainer(P, R, G, shared)
            settings = StepSettings(
                model_cfg, cfg.algorithm, cfg.optim, cfg.critic, group_size=G, max_response_len=R
            )
            step = make_rl_step(settings)
            inputs, _ = step_inputs(batch, settings)
            compiled = step.lower(step.state_shapes, inputs).compile()
            flops, peak = hlo_cost(compiled.as_text()).flops, Memory.of(compiled).peak
            times = []
            if not args.flops_only:
                t0 = time.perf_counter()
                rl.step(batch)
                first = time.perf_counter() - t0
                times = [rl.step(batch)["time/update_s"] for _ in range(args.steps)]
            out[name] = (flops, peak, statistics.median(times) if times else None)
            best[name] = min(times, default=None)
            rows = inputs["rows"]["tokens"].shape
            timing = (
                f", update {out[name][2]:.2f} s, fastest {best[name]:.2f} (first {first:.1f} s)"
                if times
                else ""
            )
            print(
                f"  P={P} R={R} G={G} {name}: rows {rows[0]} x {rows[1]}, "
                f"{flops / 1e9:.1f} GFLOP, peak {peak / 2**20:.0f} MiB{timing}"
            )
        (f_pad, m_pad, t_pad), (f_sh, m_sh, t_sh) = out["padded"], out["shared"]
        line = (
            f"P={P} R={R} G={G}: predicted (tokens) {predicted:.3f}; shared / padded FLOPs "
            f"{f_sh / f_pad:.3f}, peak memory {m_sh / m_pad:.2f}"
        )
        if t_pad:
            line += (
                f", time {t_sh / t_pad:.3f} (speed-up {t_pad / t_sh:.2f}x; fastest steps "
                f"{best['padded'] / best['shared']:.2f}x; FLOPs predict {f_pad / f_sh:.2f}x)"
            )
        print(line, flush=True)
    print("load after: " + "/".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
