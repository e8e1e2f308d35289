"""One GRPO step of jaxrl-tools on the peers' standard workload, side by side with the peers.

The standard workload (shared/bench/peers/README.md): a random Qwen2 (vocab 8192, hidden 384,
6 layers, tied, float32) and a byte-level BPE tokenizer, 256 fixed prompts of exactly 32 tokens;
a GRPO step = 8 prompts x G=4 samples of exactly 64 new tokens (temperature 1.0), a trivial rule
reward (decoded length mod 2), one AdamW update (lr 1e-6) per rollout batch, no KL.

The assets are built by the peers' own `ensure_assets()`, imported at run time from a writable
copy of the peer folder (`--peer-dir`, e.g. `cp -r shared/bench/peers /work/peerbench`), so every
system sees byte-identical weights, tokenizer and prompts. This repo contains none of their code.

Our step: `run_rollouts` over `EngineCore`, `make_batch`, then `RLTrainer.step` (no tools,
token-id prompts, no EOS so every sample has exactly 64 tokens). "generate" is the wall time of
the rollout callable (prefill + decode + host loop), "rest" the remainder of the step (reward,
packing, log-prob forward, advantages, forward/backward, AdamW). Steps after `--warmup` are
timed (compile time is reported separately) and medians are printed, as the peers do.

Peers in the same command (rounds interleaved with ours; the machine is shared and noisy):
- HF transformers `generate` (peer hf_generate.py, batch 32, this Python) vs our decode at
  batch 32 (greedy and sampling, `run_rollouts` over 32 prompts: prefill + host loop included);
- with `--with-trl`, TRL's GRPOTrainer (peer trl_grpo.py, run with `<peer-dir>/venv-trl`);
- Tunix / EasyDeL: their published figures from the peer README, labelled "published".

Run:
  /work/venv/bin/python benchmarks/bench_grpo_step.py --peer-dir /work/peerbench --with-trl
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time

P_PROMPTS, G, NEW_TOKENS, PROMPT_TOKENS = 8, 4, 64, 32
REWARD_NAME = "bench_completion_parity"


def load_peer_workload(peer_dir: str):
    """Imports the peers' hf_generate.py (only for its asset-building block) from `peer_dir`."""
    os.environ["PEERBENCH_ROOT"] = peer_dir
    path = os.path.join(peer_dir, "hf_generate.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--peer-dir {peer_dir!r} has no hf_generate.py")
    spec = importlib.util.spec_from_file_location("peerbench_hf_generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parity_reward(response, ground_truth, info, **kwargs) -> float:
    """The peers' trivial rule reward: decoded completion length mod 2."""
    return float(len(response) % 2)


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def med(xs):
    return statistics.median(xs) if xs else float("nan")


class OurGRPO:
    """jaxrl-tools on the standard workload: engine + rollout + RLTrainer."""

    def __init__(
        self,
        asset_dir: str,
        prompts: list[str] | list[list[int]],
        *,
        chunk: int,
        micro: int,
        seed: int,
        prompts_per_step: int = P_PROMPTS,
        group: int = G,
        new_tokens: int = NEW_TOKENS,
        stop_at_eos: bool = False,
        lora_rank: int | None = None,
    ):
        """`prompts`: texts (the standard workload's, exactly PROMPT_TOKENS tokens each) or
        token ids. `stop_at_eos`: responses end at the tokenizer's EOS (else every one has
        `new_tokens`); `lora_rank`: LoRA adapters on every projection instead of full
        fine-tuning."""
        import transformers

        from jaxrl_tools import models, rewards, run
        from jaxrl_tools.config_loader import config_from_dict
        from jaxrl_tools.engine.core import EngineCore
        from jaxrl_tools.engine.sampling import SamplingParams
        from jaxrl_tools.rollout import RolloutLimits
        from jaxrl_tools.shapes import next_pow2

        if REWARD_NAME not in rewards.registered_rewards():
            rewards.register_reward(REWARD_NAME)(_parity_reward)
        self.tok = transformers.AutoTokenizer.from_pretrained(asset_dir)
        self.P, self.G, self.new_tokens = prompts_per_step, group, new_tokens
        self.eos = [self.tok.eos_token_id] if stop_at_eos else []
        if isinstance(prompts[0], str):
            self.prompt_ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
            bad = [i for i, ids in enumerate(self.prompt_ids) if len(ids) != PROMPT_TOKENS]
            if bad:
                raise ValueError(f"prompts {bad[:5]} do not encode to {PROMPT_TOKENS} tokens")
        else:
            self.prompt_ids = [list(p) for p in prompts]
        prompt_len = next_pow2(max(len(p) for p in self.prompt_ids), 16)  # the engine's bucket
        self.model_cfg, params = models.from_pretrained(asset_dir)
        n_slots = self.P * self.G
        self.engine = EngineCore(
            self.model_cfg,
            params,
            slots=n_slots,
            max_len=prompt_len + new_tokens,
            max_prefill_length=prompt_len,
            tokenizer=self.tok,
            eos_token_ids=self.eos,
            sampling=SamplingParams(temperature=1.0),
            seed=seed,
        )
        self.limits = RolloutLimits(max_response_tokens=new_tokens, chunk_size=chunk)
        self.sampling = SamplingParams(temperature=1.0)
        cfg = config_from_dict(
            {
                "model": {
                    "path": asset_dir,
                    "lora": {
                        "enabled": lora_rank is not None,
                        "rank": lora_rank or 8,
                        "alpha": 2.0 * (lora_rank or 8),
                    },
                },  # fmt: skip
                "data": {"batch_size": self.P},
                "rollout": {
                    "group_size": self.G,
                    "temperature": 1.0,
                    "max_prompt_len": prompt_len,
                    "max_response_len": new_tokens,
                    "chunk_size": chunk,
                    "slots": n_slots,
                },
                # TRL's loss_type="grpo": per-sequence token mean, clip 0.2, no dual clip, beta 0.
                "algorithm": {
                    "adv_estimator": "grpo",
                    "kl_coef": 0.0,
                    "dual_clip_c": None,
                    "loss_agg_mode": "seq-mean-token-mean",
                },
                "optim": {
                    "lr": 1e-6,
                    "schedule": "constant",
                    "weight_decay": 0.0,
                    "grad_clip": 1.0,
                    "micro_batch_size": micro,
                    "ppo_epochs": 1,
                    "num_mini_batches": 1,
                },
                "reward": [{"name": REWARD_NAME, "weight": 1.0}],
                "trainer": {"seed": seed, "steps": 1000},
            }
        )
        self.cfg = cfg
        self.reward = rewards.CompositeReward([(REWARD_NAME, 1.0, {})])
        self.trainer = run.make_trainer(cfg, self.model_cfg, params)
        self.calls = 0
        self.last = {}

    def _rollout(self, records, group_size, params):
        from jaxrl_tools.rollout import run_rollouts

        stats = {}
        t0 = time.perf_counter()
        trajs = run_rollouts(
            self.engine,
            params,
            [r["prompt_ids"] for r in records],
            tokenizer=self.tok,
            num_samples=group_size,
            limits=self.limits,
            sampling=self.sampling,
            rng=self.calls,
            eos_token_ids=self.eos,
            stats=stats,
        )
        self.calls += 1
        tokens = [len(t.response_ids) for t in trajs]
        self.last = dict(
            generate_s=time.perf_counter() - t0,
            device_chunks_s=stats["generate_s"],
            chunks=stats["chunks"],
            mean_tokens=sum(tokens) / len(tokens),
        )
        if not self.eos and set(tokens) != {self.new_tokens}:
            raise RuntimeError(f"responses must have exactly {self.new_tokens} tokens: {tokens}")
        return trajs

    def step(self, i: int) -> dict:
        """One GRPO step on prompts [Pi, Pi+P) (mod their count); returns its timings."""
        n, P = len(self.prompt_ids), self.P
        records = [{"prompt_ids": self.prompt_ids[(P * i + j) % n]} for j in range(P)]
        from jaxrl_tools.train.batch import make_batch

        t0 = time.perf_counter()
        trajs = self._rollout(records, self.G, self.trainer.params)
        batch = make_batch(
            records, trajs, self.reward, self.cfg.algorithm.filters,
            group_size=self.G, rows=self.trainer.rows, pad_id=self.tok.pad_token_id,
        )  # fmt: skip
        m = self.trainer.step(batch)
        step_s = time.perf_counter() - t0
        gen = self.last["generate_s"]
        return dict(
            step_s=step_s,
            generate_s=gen,
            rest_s=step_s - gen,
            device_chunks_s=self.last["device_chunks_s"],
            update_s=m["time/update_s"],
            chunks=self.last["chunks"],
            mean_tokens=self.last["mean_tokens"],
        )

    def decode(self, batch: int, greedy: bool, repeats: int) -> list[float]:
        """tokens/s of `run_rollouts` over `batch` prompts x `new_tokens` (after one warm-up)."""
        from jaxrl_tools.engine.sampling import GREEDY
        from jaxrl_tools.rollout import run_rollouts

        sp = GREEDY if greedy else self.sampling
        out = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            trajs = run_rollouts(
                self.engine,
                self.trainer.params,
                self.prompt_ids[:batch],
                num_samples=1,
                limits=self.limits,
                sampling=sp,
                rng=r,
                eos_token_ids=(),
            )
            dt = time.perf_counter() - t0
            assert all(len(t.response_ids) == self.new_tokens for t in trajs)
            if r > 0:
                out.append(batch * self.new_tokens / dt)
        return out


def run_peer(cmd: list[str], peer_dir: str, result_file: str, timeout: int) -> dict | None:
    """Runs a peer script in `peer_dir`; returns its results JSON (None on failure)."""
    env = dict(os.environ, PEERBENCH_ROOT=peer_dir)
    path = os.path.join(peer_dir, "results", result_file)
    if os.path.exists(path):
        os.remove(path)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            cmd, cwd=peer_dir, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        print(f"  {os.path.basename(cmd[1])}: timed out after {timeout}s", flush=True)
        return None
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    if p.returncode != 0 or not os.path.exists(path):
        tail = (p.stdout + p.stderr).strip().splitlines()[-5:]
        print(f"  {' '.join(cmd)} FAILED (rc {p.returncode}):\n    " + "\n    ".join(tail))
        return None
    print(
        f"  {lines[-1] if lines else os.path.basename(cmd[1])}  [{wall:.0f}s process wall]",
        flush=True,
    )
    with open(path) as f:
        return json.load(f)


def published_rows(peer_dir: str) -> list[tuple[str, float, float, float]]:
    """(system, s/step, generate, rest) rows of the peer README's published table."""
    rows = []
    try:
        text = open(os.path.join(peer_dir, "README.md")).read()
    except OSError:
        return rows
    num = r"\s*([0-9.]+)\s*"
    for m in re.finditer(rf"^\|\s*([^|]+?)\s*\|{num}\|{num}\|{num}\|\s*$", text, re.M):
        rows.append((m.group(1), float(m.group(2)), float(m.group(3)), float(m.group(4))))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--peer-dir",
        default="/work/peerbench",
        help="writable copy of shared/bench/peers (assets are built/read there)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed GRPO steps per round (ours)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds ours/peers")
    ap.add_argument("--chunk", type=int, default=64, help="decode steps per jitted chunk")
    ap.add_argument("--micro-batch", type=int, default=32, help="sequences per fwd/bwd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--with-trl", action="store_true", help="run TRL (needs <peer-dir>/venv-trl)")
    ap.add_argument("--trl-steps", type=int, default=None, help="TRL timed steps (default --steps)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate and our decode")
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--system-malloc", action="store_true", help="glibc's default malloc settings")
    args = ap.parse_args()
    peer_dir = os.path.abspath(args.peer_dir)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernel_floor
    from roofline import Roofline

    from jaxrl_tools import host

    if not args.system_malloc:
        host.keep_freed_memory()  # as `jaxrl-tools` runs on CPU
    roof = Roofline.measure()
    print(roof.describe(), flush=True)

    t_setup = time.perf_counter()
    peer = load_peer_workload(peer_dir)
    asset_dir, prompts = peer.ensure_assets()
    import jax

    print(
        f"assets: {asset_dir} sha={peer.weights_sha256()} prompts={len(prompts)}; "
        f"jax {jax.__version__} {jax.devices()[0].platform}; cpus {os.cpu_count()}; "
        f"load {loadavg()}",
        flush=True,
    )
    ours = OurGRPO(asset_dir, prompts, chunk=args.chunk, micro=args.micro_batch, seed=args.seed)
    print(
        f"ours: setup {time.perf_counter() - t_setup:.1f}s (chunk {args.chunk}, "
        f"micro-batch {args.micro_batch})",
        flush=True,
    )

    step_i = 0
    warm = []
    for _ in range(args.warmup):
        warm.append(ours.step(step_i))
        step_i += 1
        print(
            f"  ours warm-up step {step_i}: {warm[-1]['step_s']:.2f}s "
            f"(generate {warm[-1]['generate_s']:.2f}s)",
            flush=True,
        )

    timed, trl_runs, hf_runs, dec = [], [], [], {"greedy": [], "sampling": []}
    loads = []
    trl_py = os.path.join(peer_dir, "venv-trl", "bin", "python")
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}  load {loadavg()}", flush=True)
        loads.append(os.getloadavg()[0])
        for _ in range(args.steps):
            r = ours.step(step_i)
            step_i += 1
            timed.append(r)
            print(
                f"  ours step {step_i}: {r['step_s']:.3f}s = generate {r['generate_s']:.3f}s "
                f"(device chunks {r['device_chunks_s']:.3f}s) + rest {r['rest_s']:.3f}s "
                f"(update {r['update_s']:.3f}s)",
                flush=True,
            )
        if args.with_trl:
            if not os.path.exists(trl_py):
                print(f"  TRL skipped: no {trl_py} (run the peers' setup.sh for venv-trl)")
            else:
                loads.append(os.getloadavg()[0])
                res = run_peer(
                    [
                        trl_py,
                        "trl_grpo.py",
                        "--steps",
                        str(args.trl_steps or args.steps),
                        "--warmup",
                        "1",
                    ],
                    peer_dir,
                    "trl_grpo.json",
                    timeout=900,
                )
                if res:
                    trl_runs.append(res)
        if not args.no_hf:
            loads.append(os.getloadavg()[0])
            res = run_peer(
                [
                    sys.executable,
                    "hf_generate.py",
                    "--batches",
                    "32",
                    "--repeats",
                    str(args.decode_repeats),
                ],
                peer_dir,
                "hf_generate.json",
                timeout=600,
            )
            if res:
                hf_runs.append(res)
            for mode in ("greedy", "sampling"):
                tps = ours.decode(32, mode == "greedy", args.decode_repeats)
                dec[mode] += tps
                print(
                    f"  ours decode {mode} b32: {med(tps):.0f} tok/s "
                    f"({', '.join(f'{x:.0f}' for x in tps)})",
                    flush=True,
                )

    # ------------------------------------------------------------------ table
    o_step = med([r["step_s"] for r in timed])
    o_gen = med([r["generate_s"] for r in timed])
    o_rest = med([r["rest_s"] for r in timed])
    o_min = min(r["step_s"] for r in timed)
    rows = [("jaxrl-tools (ours)", o_step, o_gen, o_rest, f"n={len(timed)}, min step {o_min:.2f}")]
    if trl_runs:
        sw = [x for r in trl_runs for x in r["measured_step_s"]]
        g = [x for r in trl_runs for x in r["measured_generate_s"]]
        rest = [
            a - b for r in trl_runs for a, b in zip(r["measured_step_s"], r["measured_generate_s"])
        ]
        v = trl_runs[0]["versions"]
        rows.append(
            (
                f"TRL {v.get('trl')} (torch {v.get('torch')})",
                med(sw),
                med(g),
                med(rest),
                f"n={len(sw)}, min step {min(sw):.2f}, measured now",
            )
        )
    for name, s, g, rest in published_rows(peer_dir):
        rows.append((f"{name} [published]", s, g, rest, "README, quiet machine"))
    print()
    print(
        f"GRPO step, {P_PROMPTS} prompts x G={G}, {PROMPT_TOKENS}+{NEW_TOKENS} tokens, fp32; "
        f"medians; 'x ours' = system time / our time (>1: ours faster); "
        f"load avg during run {', '.join(f'{x:.1f}' for x in loads)}"
    )
    print(
        f"{'system':38s} {'s/step':>7s} {'generate':>9s} {'rest':>7s} "
        f"{'step x ours':>11s} {'gen x ours':>10s} {'rest x ours':>11s}  note"
    )
    for name, s, g, rest, note in rows:
        print(
            f"{name:38s} {s:7.3f} {g:9.3f} {rest:7.3f} {s / o_step:11.2f} {g / o_gen:10.2f} "
            f"{rest / o_rest:11.2f}  {note}"
        )
    # The tied embedding counts once, as the LM head.
    n_mm = sum(x.size for x in jax.tree.leaves(ours.trainer.params))
    floor = roof.grpo_step_floor_s(n_mm, P_PROMPTS * G, PROMPT_TOKENS + NEW_TOKENS)
    print(
        f"ours against the floor: {floor:.2f} s at the matmul rate; "
        f"median step {o_step / floor:.2f}x the floor, best {o_min / floor:.2f}x"
    )
    # The kernel floor (kernel_floor.py): the step's own matmuls timed alone, here.
    cfg, n_seqs = ours.model_cfg, P_PROMPTS * G  # `rows` is the table's, written to --json
    gen_kernels = kernel_floor.forward_s(cfg, n_seqs * PROMPT_TOKENS) + NEW_TOKENS * (
        kernel_floor.forward_s(cfg, n_seqs)
    )
    upd_kernels = kernel_floor.update_s(cfg, n_seqs * (PROMPT_TOKENS + NEW_TOKENS))
    o_upd = med([r["update_s"] for r in timed])
    print(
        f"ours against the kernel floor: generate {gen_kernels:.2f} s, median "
        f"{o_gen / gen_kernels:.2f}x; update {upd_kernels:.2f} s, median "
        f"{o_upd / upd_kernels:.2f}x (best {min(r['update_s'] for r in timed) / upd_kernels:.2f}x)"
    )
    comp = [r["step_s"] for r in warm[:1]]
    print(
        f"ours compile/first step: {comp[0] if comp else float('nan'):.2f}s "
        "(warm-up steps: " + ", ".join(f"{r['step_s']:.2f}" for r in warm) + ")"
    )
    if trl_runs:
        print(f"TRL first step: {trl_runs[0]['all_step_wall_s'][0]:.2f}s")

    hf_tps = {}
    if hf_runs:
        print()
        print(
            "decode at batch 32, 32-token prompts, 64 new tokens (incl. prefill), tokens/s "
            "(ratio = ours / HF)"
        )
        for mode in ("greedy", "sampling"):
            xs = [
                x
                for r in hf_runs
                for res in r["results"]
                if res["mode"] == mode and res["batch"] == 32
                for x in res["tok_s_all"]
            ]
            hf_tps[mode] = med(xs)
            print(
                f"  {mode:8s}  ours {med(dec[mode]):7.0f}   HF generate {hf_tps[mode]:7.0f}   "
                f"ratio {med(dec[mode]) / hf_tps[mode]:.2f}"
            )
        print(f"  ours GRPO rollout (32 seqs x 64): {32 * NEW_TOKENS / o_gen:.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    ours_timed=timed,
                    ours_warmup=warm,
                    rows=rows,
                    decode_ours=dec,
                    decode_hf=hf_tps,
                    loads=loads,
                    args=vars(args),
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
