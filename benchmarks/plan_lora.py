"""The largest Qwen2.5 that fits one 80 GB GPU: LoRA against full fine-tuning, by `plan`.

For each Qwen2.5 size (shapes only: no weights), `plan.plan_memory` compiles the GRPO RL step
(forwards and update) and a decode step for one device, and `plan.phase_totals` adds what stays
allocated meanwhile (train state, LoRA's frozen base, the engine's serving copy). Full
fine-tuning: float32 master weights and AdamW moments, bfloat16 compute and KV cache. LoRA
(rank 16 on every projection): float32 adapters and moments over a bfloat16 base, decoded with
the adapters merged into a bfloat16 copy (`model.lora.decode: merged`) or applied to the base
(`adapters`: no copy). Both with per-layer remat. The workload: micro-batches
of one 4,096-token sequence (1,024 prompt + 3,072 response), 32 decode slots of 4,096 tokens.

Figures are the CPU compiler's buffer assignment (an estimate of a GPU's, see
docs/guide/precision.md, "Memory planning"). Run: python benchmarks/plan_lora.py [--hbm-gb 80]
"""

from __future__ import annotations

import argparse
import time

from jaxrl_tools import models, plan, sharding

QWEN25 = {  # (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied)
    "0.5B": (896, 24, 14, 2, 64, 4864, 151936, True),
    "1.5B": (1536, 28, 12, 2, 128, 8960, 151936, True),
    "3B": (2048, 36, 16, 2, 128, 11008, 151936, True),
    "7B": (3584, 28, 28, 4, 128, 18944, 152064, False),
    "14B": (5120, 48, 40, 8, 128, 13824, 152064, False),
    "32B": (5120, 64, 40, 8, 128, 27648, 152064, False),
}


def config(name: str) -> models.ModelConfig:
    h, L, H, K, Dh, inter, V, tied = QWEN25[name]
    return models.ModelConfig(
        model_type="qwen2",
        vocab_size=V,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=K,
        head_dim=Dh,
        rope_theta=1e6,
        tie_word_embeddings=tied,
        attention_bias=True,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hbm-gb", type=float, default=80.0)
    ap.add_argument("--sizes", default=",".join(QWEN25))
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    hbm = int(args.hbm_gb * 1e9)
    mesh = sharding.make_mesh((1, 1, 1))
    dtypes = models.DTypePolicy(param="float32", compute="bfloat16")
    shapes = dict(rows=1, seq_len=4096, slots=32, cache_len=4096)
    lora = models.LoraConfig(rank=args.rank, alpha=32.0)
    # mode -> (LoRA config, decode mode): merged keeps a bf16 merged copy for the engine,
    # adapters decodes the base with the adapters applied (no copy).
    modes = {
        "full": (None, "merged"),
        f"LoRA r{args.rank}, merged decode": (lora, "merged"),
        f"LoRA r{args.rank}, adapters decode": (lora, "adapters"),
    }
    print(f"one device of {args.hbm_gb:g} GB; phase totals in GB (RL step / decode)")
    print("| model | mode | RL step | decode | fits |")
    print("| --- | --- | --- | --- | --- |")
    for mode, (lora, decode) in modes.items():
        for name in args.sizes.split(","):
            cfg = config(name)
            t0 = time.perf_counter()
            settings = plan.grpo_settings(cfg, dtypes=dtypes, lora=lora, remat="layer")
            figures = plan.plan_memory(settings, mesh=mesh, **shapes)
            resident = plan.resident_bytes(settings, mesh=mesh, lora_decode=decode)
            totals = plan.phase_totals(figures, resident)
            fits = max(totals.values()) <= hbm
            row = " | ".join(f"{totals[k] / 1e9:.1f}" for k in ("update", "decode"))
            print(
                f"| Qwen2.5-{name} | {mode} | {row} | {'yes' if fits else 'no'} | "
                f"<!-- {time.perf_counter() - t0:.0f} s -->",
                flush=True,
            )
            if not fits:
                break  # the larger sizes do not fit either


if __name__ == "__main__":
    main()
