"""Decode step time at low cache occupancy: live-length attention vs whole-row attention.

A random Qwen2-shaped model (vocab 4096, hidden 256, 4 layers, 8 heads, 2 KV heads, head dim 32,
float32, seed 0) in an engine of 8 slots x max_len positions. Every slot is loaded with a prompt of
`--occupancy` x max_len tokens, then decodes greedily; each timed call is `--steps` decode steps of
all slots (one jitted scan), after one warm-up call (compile excluded). The same engine class runs
with `live_attention=True` (the default: each step reads the cache up to a power-of-two bucket
above the longest live row) and `live_attention=False` (each step reads all max_len positions, the
engine before this change). Both must produce the same tokens; the script checks it and prints the
median step time of each and their ratio, from one run.

Run: .venv/bin/python benchmarks/bench_decode_live.py [--max-len 8192] [--occupancy 0.1]
"""

import argparse
import os
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--occupancy", type=float, default=0.1)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax

    from jaxrl_tools import models
    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.sampling import GREEDY

    cfg = models.ModelConfig(
        model_type="qwen2",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=args.max_len,
    )
    params = models.init_params(cfg, jax.random.key(0))
    prompt_len = int(args.occupancy * args.max_len)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, prompt_len)) for _ in range(args.slots)]
    key = np.asarray(jax.random.key_data(jax.random.key(0)))

    results = {}
    for live in (True, False):
        eng = EngineCore(
            cfg,
            params,
            slots=args.slots,
            max_len=args.max_len,
            max_prefill_length=16,
            sampling=GREEDY,
            live_attention=live,
        )
        state = eng.init_decode_state()
        for slot, prompt in enumerate(prompts):  # one row per call: bounded prefill memory
            state = eng.write_slots(
                params, state, [slot], [prompt], starts=[0], reset=[(key, GREEDY)]
            )
        tokens, times = [], []
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            state, out = eng.generate_steps(params, state, args.steps)
            toks = np.asarray(out.tokens)
            if r:  # the first call compiles
                times.append((time.perf_counter() - t0) / args.steps)
            tokens.append(toks)
        results[live] = (statistics.median(times), np.concatenate(tokens, axis=1))

    (t_live, tok_live), (t_full, tok_full) = results[True], results[False]
    same = np.array_equal(tok_live, tok_full)
    live_len = prompt_len + (args.repeats + 1) * args.steps
    print(
        f"load {os.getloadavg()[0]:.2f}; {args.slots} slots x max_len {args.max_len}, live length "
        f"{prompt_len}..{live_len} ({100 * live_len / args.max_len:.0f}% at most)"
    )
    print(f"whole-row attention: {1e3 * t_full:8.2f} ms / decode step")
    print(f"live-length:         {1e3 * t_live:8.2f} ms / decode step")
    print(f"ratio whole / live:  {t_full / t_live:8.2f}x; same tokens: {same}")
    if not same:
        raise SystemExit("live-length decode differs from whole-row decode")


if __name__ == "__main__":
    main()
