"""The real model's GRPO step and decode, ours against TRL's GRPOTrainer and HF `generate`, side
by side in one command.

Model: a converted SmolLM2-135M-Instruct folder (`jaxrl-tools prepare smollm2-135m-instruct
--output DIR`), float32. Workload (as the peers' README ran TRL on it): 4 prompts x G = 4 a
step, up to 128 new tokens (EOS ends a response), temperature 1, AdamW at lr 1e-6, no KL, no
warm-up, one update per batch (TRL's loss_type "grpo": per-sequence token mean, clip 0.2); full
fine-tuning, and LoRA rank 16 (alpha 32) on every projection. Rewards are a trivial rule
(decoded length mod 2), so the step's cost is the framework's. The prompts are short arithmetic
questions in the model's chat template, the same tokens for every system.

Decode: `--decode-batches` prompts x exactly 128 new tokens (no EOS), greedy and sampling at
temperature 1 (top-k and top-p off), ours (the engine, prefill and host loop included) against
HF `generate` on the same prompts (left-padded), tokens/s after one warm-up call.

TRL and HF run in subprocesses of this script (`--worker trl|hf`, torch's threads apart from
JAX's), one after the other with ours; medians of the timed steps after `--warmup` ones. The
machine is shared and noisy: compare the ratios of one run.

Run: python benchmarks/bench_real_model.py --model pretrained/smollm2-135m-instruct
       [--steps 3 --warmup 1 --decode-batches 1,16,32 --skip-trl --skip-lora --skip-decode]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS_PER_STEP, G, NEW_TOKENS, LORA_RANK, LR = 4, 4, 128, 16, 1e-6
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def questions(n: int = 64) -> list[str]:
    """`n` fixed arithmetic questions (the same for every system)."""
    return [f"What is {17 + 7 * i % 83} + {5 + 11 * i % 67}? Answer briefly." for i in range(n)]


def chat_ids(tok, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def parity_reward(completions, **kwargs) -> list[float]:
    """TRL's side of the trivial rule reward (the decoded completion's length mod 2)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 2) for t in texts]


# --------------------------------------------------------------------------- workers


def trl_worker(args) -> dict:
    """TRL's GRPOTrainer on the workload; seconds per step (generation + update) after warm-up."""
    import tempfile

    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    steps = args.steps + args.warmup
    qs = questions()
    prompts = [qs[i % len(qs)] for i in range(steps * PROMPTS_PER_STEP)]
    data = datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q in prompts]}
    )
    times, lengths = [], []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(LORA_TARGETS),
            lora_dropout=0.0, task_type="CAUSAL_LM",
        )  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=PROMPTS_PER_STEP * G, num_generations=G,
            max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            beta=0.0, num_iterations=1, loss_type="grpo", epsilon=0.2, max_steps=steps,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
            seed=args.seed, shuffle_dataset=False, gradient_accumulation_steps=1,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model, reward_funcs=parity_reward, args=config, train_dataset=data,
            processing_class=tok, peft_config=peft_config, callbacks=[Timer()],
        )  # fmt: skip
        trainer.train()
    timed = times[args.warmup :]
    return {"step_s": statistics.median(timed), "steps": timed, "mean_tokens": lengths}


def hf_worker(args) -> dict:
    """HF `generate` tokens/s per (batch, mode), exactly NEW_TOKENS new tokens each."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    ids = [chat_ids(tok, q) for q in questions()]
    out = {}
    for b in args.batches:
        width = max(len(x) for x in ids[:b])
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids[:b]])
        mask = torch.arange(width)[None] >= torch.tensor([width - len(x) for x in ids[:b]])[:, None]
        for mode in ("greedy", "sampling"):
            kw = dict(do_sample=mode == "sampling", temperature=1.0, top_k=0, top_p=1.0)
            rates = []
            for r in range(args.repeats + 1):
                t0 = time.perf_counter()
                with torch.no_grad():
                    gen = model.generate(
                        input_ids, attention_mask=mask.long(), max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS, pad_token_id=pad, **kw,
                    )  # fmt: skip
                dt = time.perf_counter() - t0
                assert gen.shape[1] == width + NEW_TOKENS
                if r > 0:
                    rates.append(b * NEW_TOKENS / dt)
            out[f"{b}/{mode}"] = statistics.median(rates)
    return out


def run_worker(args, worker: str, *extra: str) -> dict | None:
    """This script as `--worker`, in a subprocess; its JSON result (None on failure)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--model", args.model]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    cmd += ["--decode-batches", args.decode_batches, "--repeats", str(args.repeats), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        print(f"  {worker} {' '.join(extra)} FAILED (rc {p.returncode}):")
        print("    " + "\n    ".join((p.stdout + p.stderr).strip().splitlines()[-8:]))
        return None
    return json.loads(lines[-1][len("RESULT ") :])


# --------------------------------------------------------------------------- ours


def our_steps(args, lora: bool) -> dict:
    """Our GRPO step (bench_grpo_step.OurGRPO: engine, rollout, make_batch, RLTrainer.step)."""
    import transformers
    from bench_grpo_step import OurGRPO

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = [chat_ids(tok, q) for q in questions()]
    ours = OurGRPO(
        args.model, ids, chunk=args.chunk, micro=PROMPTS_PER_STEP * G, seed=args.seed,
        prompts_per_step=PROMPTS_PER_STEP, group=G, new_tokens=NEW_TOKENS, stop_at_eos=True,
        lora_rank=LORA_RANK if lora else None,
    )  # fmt: skip
    runs = [ours.step(i) for i in range(args.warmup + args.steps)][args.warmup :]
    med = {k: statistics.median(r[k] for r in runs) for k in ("step_s", "generate_s", "update_s")}
    return med | {"mean_tokens": [r["mean_tokens"] for r in runs]}


def our_decode(args) -> dict:
    """Our engine's tokens/s per (batch, mode): exactly NEW_TOKENS new tokens each."""
    import transformers

    from jaxrl_tools import models
    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.sampling import GREEDY, SamplingParams
    from jaxrl_tools.rollout import RolloutLimits, run_rollouts
    from jaxrl_tools.shapes import next_pow2

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = [chat_ids(tok, q) for q in questions()]
    model_cfg, params = models.from_pretrained(args.model)
    out = {}
    for b in args.batches:
        width = next_pow2(max(len(x) for x in ids[:b]), 16)  # the engine's prompt bucket
        engine = EngineCore(
            model_cfg, params, slots=b, max_len=width + NEW_TOKENS, max_prefill_length=width,
            tokenizer=tok, eos_token_ids=(),
        )  # fmt: skip
        limits = RolloutLimits(max_response_tokens=NEW_TOKENS, chunk_size=args.chunk)
        for mode, sampling in (("greedy", GREEDY), ("sampling", SamplingParams(temperature=1.0))):
            rates = []
            for r in range(args.repeats + 1):
                t0 = time.perf_counter()
                trajs = run_rollouts(
                    engine, params, ids[:b], limits=limits, sampling=sampling, rng=r,
                    eos_token_ids=(),
                )  # fmt: skip
                dt = time.perf_counter() - t0
                assert all(len(t.response_ids) == NEW_TOKENS for t in trajs)
                if r > 0:
                    rates.append(b * NEW_TOKENS / dt)
            out[f"{b}/{mode}"] = statistics.median(rates)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the converted SmolLM2 folder")
    ap.add_argument("--steps", type=int, default=3, help="timed GRPO steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile)")
    ap.add_argument("--chunk", type=int, default=32, help="decode steps per jitted chunk")
    ap.add_argument("--decode-batches", default="1,16,32")
    ap.add_argument("--repeats", type=int, default=2, help="timed decode calls per setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-lora", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--worker", choices=("trl", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model!r} has no config.json: run `jaxrl-tools prepare "
                         "smollm2-135m-instruct --output DIR` first")  # fmt: skip
    args.batches = [int(b) for b in args.decode_batches.split(",")]
    if args.worker:
        result = trl_worker(args) if args.worker == "trl" else hf_worker(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    step, decode = {}, {}
    for lora in (False,) if args.skip_lora else (False, True):
        name = "LoRA" if lora else "full"
        step[name, "ours"] = our_steps(args, lora)
        print(f"GRPO step, {name}: ours {step[name, 'ours']}", flush=True)
        if not args.skip_trl:
            step[name, "TRL"] = run_worker(args, "trl", *(["--lora"] if lora else []))
            print(f"GRPO step, {name}: TRL {step[name, 'TRL']}", flush=True)
    if not args.skip_decode:
        decode["ours"], decode["HF"] = our_decode(args), run_worker(args, "hf")
        for key, ours in decode["ours"].items():
            hf = (decode["HF"] or {}).get(key, float("nan"))
            print(f"decode {key}: ours {ours:.1f} tok/s, HF {hf:.1f} tok/s ({ours / hf:.2f}x)")

    def versus(name: str) -> str:
        ours, trl = step.get((name, "ours")), step.get((name, "TRL"))
        if ours is None or not trl:
            return f"{name} not run"
        s, t = ours["step_s"], trl["step_s"]
        return f"ours {s:.2f} s vs TRL {t:.2f} s ({t / s:.2f}x)"

    b16 = "16/sampling"
    ours16 = decode.get("ours", {}).get(b16)
    hf16 = (decode.get("HF") or {}).get(b16)
    dec = (f"decode b16 ours {ours16:.1f} tok/s vs HF {hf16:.1f} tok/s ({ours16 / hf16:.2f}x)"
           if ours16 and hf16 else "decode b16 not run")  # fmt: skip
    print(f"real-model: GRPO step {versus('full')}; LoRA {versus('LoRA')}; {dec}")


if __name__ == "__main__":
    main()
