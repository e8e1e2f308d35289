"""Decode throughput of the JAX engine vs transformers `generate` (PyTorch CPU), same model.

The standard peer workload's model (shared/bench/peers/README.md): a random Qwen2 with vocab
8192, hidden 384, intermediate 1024, 6 layers, 6 heads, 2 KV heads, tied embeddings, float32,
seed 0, saved with save_pretrained and loaded by both sides. Batch 16 prompts of 32 random tokens,
64 new tokens each, greedy or (--sample) at temperature 1 without top-k/top-p (no EOS: every
row decodes all 64). Timed after one warm-up run (JAX compile excluded), HF and JAX runs
interleaved; both sides include the prompt prefill. Prints tokens/s, the ratio, and the
engine's time against its floor on this machine's roofline measured in the same process
(`roofline.py`): the prefill's FLOPs and one read of the weights, plus every decode step's
(`Roofline.decode_floor_s`, the live KV cache included), and against its kernel floor measured
in the same run (`kernel_floor.py`: the prefill's and each decode step's projection, MLP and LM
head matmuls at their shapes, timed alone); then a decode step alone (the chunks' wall time
after the prompts' slot writes have finished, per step) against one step's kernel floor, the
figure of issue 40's target (<= 1.15x). Like `jaxrl-tools` on CPU, the process keeps freed
memory in malloc's heap (`jaxrl_tools.host`); `--system-malloc` leaves glibc's default.

Run: .venv/bin/python benchmarks/bench_decode.py [--batch 16] [--new 64] [--sample]
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def build_model(path):
    import torch
    import transformers
    from shapes import PEER_QWEN2

    cfg = transformers.Qwen2Config(
        **{k: v for k, v in PEER_QWEN2.items() if k != "model_type"},
        max_position_embeddings=2048,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(path)
    return hf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample", action="store_true", help="temperature 1 instead of greedy")
    ap.add_argument("--system-malloc", action="store_true", help="glibc's default malloc settings")
    args = ap.parse_args()

    import jax
    import kernel_floor
    import torch
    from roofline import Roofline

    from jaxrl_tools import host, models

    if not args.system_malloc:
        host.keep_freed_memory()
    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.sampling import GREEDY, SamplingParams

    B, P, N = args.batch, args.prompt, args.new
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 8192, size=(B, P)).tolist()
    with tempfile.TemporaryDirectory() as d:
        hf = build_model(d)
        config, params = models.from_pretrained(d)
    n_params = sum(p.numel() for p in hf.parameters())
    roof = Roofline.measure()
    n_mm = n_params  # tied: the embedding is read once per step, as the LM head
    floor = roof.floor_s(2 * n_mm * B * P, 4 * n_mm) + sum(
        roof.decode_floor_s(n_mm, 4, B, models.cache_bytes(config, B, P + i)) for i in range(N)
    )
    print(roof.describe())
    step_kernels = kernel_floor.forward_s(config, B)
    kernels = kernel_floor.forward_s(config, B * P) + N * step_kernels
    print(
        f"model: {n_params / 1e6:.1f}M params, batch {B}, prompt {P}, new {N}, "
        f"torch threads {torch.get_num_threads()}, jax {jax.devices()[0].platform}"
    )

    sampling = SamplingParams(temperature=1.0) if args.sample else GREEDY

    def hf_run():
        ids = torch.tensor(prompts)
        with torch.no_grad():
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=N,
                min_new_tokens=N,
                do_sample=args.sample,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                pad_token_id=0,
            )

    # JAX engine: load prompts into slots (one bucketed call), then N steps in chunks.
    eng = EngineCore(
        config,
        params,
        slots=B,
        max_len=1 << (P + N - 1).bit_length(),
        max_prefill_length=max(16, 1 << (P - 1).bit_length()),
        sampling=sampling,
        eos_token_ids=[],
    )
    key = jax.random.PRNGKey(0)

    step_times = []  # each run's decode steps alone (prefill excluded), seconds a step

    def jax_run():
        state = eng.init_decode_state()
        state = eng.write_slots(
            params, state, list(range(B)), prompts, starts=[0] * B, reset=[(key, sampling)] * B
        )
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        toks = []
        for _ in range(N // args.chunk):
            state, out = eng.generate_steps(params, state, args.chunk)
            toks.append(np.asarray(out.tokens))
        step_times.append((time.perf_counter() - t0) / (N // args.chunk * args.chunk))
        return np.concatenate(toks, axis=1)

    def timed(fn):
        time.sleep(0.5)  # PyTorch's OpenMP threads spin for a while after a run: let them idle
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    hf_out, jax_out = hf_run(), jax_run()  # warm-up (JAX compiles here)
    step_times.clear()
    # Interleaved, so that load from other jobs on the machine hits both sides alike.
    hf_times, jax_times = [], []
    for _ in range(args.repeats):
        hf_times.append(timed(hf_run)[0])
        jax_times.append(timed(jax_run)[0])
    hf_tps = B * N / statistics.median(hf_times)
    jax_tps = B * N / statistics.median(jax_times)
    paired = statistics.median(h / j for h, j in zip(hf_times, jax_times))
    mode = "sampling at temperature 1" if args.sample else "greedy"
    print(f"{mode}, load average {os.getloadavg()[0]:.2f}")
    print(
        f"transformers generate: {hf_tps:8.1f} tokens/s  (median of {args.repeats}: "
        f"{statistics.median(hf_times):.3f} s)"
    )
    print(
        f"jaxrl_tools engine   : {jax_tps:8.1f} tokens/s  (median of {args.repeats}: "
        f"{statistics.median(jax_times):.3f} s, chunk {args.chunk}); {floor / min(jax_times):.0%} "
        f"of its floor ({floor * 1e3:.0f} ms) at its best run, "
        f"{floor / statistics.median(jax_times):.0%} at the median"
    )
    print(
        f"kernel floor: {kernels * 1e3:.0f} ms ({step_kernels * 1e3:.2f} ms a decode step); "
        f"the engine's median run {statistics.median(jax_times) / kernels:.2f}x it, best "
        f"{min(jax_times) / kernels:.2f}x"
    )
    step = statistics.median(step_times)
    print(
        f"decode step alone: engine {step * 1e3:.2f} ms/step, kernel floor "
        f"{step_kernels * 1e3:.2f} ms/step, {step / step_kernels:.2f}x it (best "
        f"{min(step_times) / step_kernels:.2f}x; target 1.15x)"
    )
    if not args.sample:
        same = float((jax_out == hf_out[:, P:].numpy()).mean())
        print(f"greedy tokens equal to HF: {same:.1%}")
    print(f"RESULT ratio engine/hf = {jax_tps / hf_tps:.2f}x (median of paired runs {paired:.2f}x)")


if __name__ == "__main__":
    main()
