"""Do tool calls overlap with decoding? Rollout wall time with a 200 ms tool vs an instant tool.

A random Qwen2 (hidden 384, 6 layers, the peer workload's shape, with the local 512-token
Qwen-style tokenizer's vocabulary) is forced (logits_hook) to follow one of 8 scripts (sample
i follows script i mod 8): "thinking" filler of a script-dependent length, a Qwen <tool_call>,
more filler, a second call, an answer and <|im_end|>. 32 trajectories on 8 slots, 2 calls each
(C = 2). The same run is timed with a tool that sleeps 200 ms per call and with an instant one,
with trajectories keeping their slots while they wait (`max_parked=0`), parked while they wait
(the default: up to as many as the slots), and parked without limit. Goal: <= 1.3x. Without
overlap the 64 calls would add up to 64 x 0.2 s / (calls in flight).

Run: .venv/bin/python benchmarks/bench_rollout_overlap.py [--sleep 0.2]
"""

import argparse
import asyncio
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from shapes import PEER_QWEN2

    from jaxrl_tools import models
    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.sampling import GREEDY
    from jaxrl_tools.rollout import RolloutLimits, run_rollouts
    from jaxrl_tools.tasks.tokenizer import build_tokenizer
    from jaxrl_tools.tools import ToolExecutor, function_tool

    tmp = tempfile.mkdtemp()
    tok = build_tokenizer(f"{tmp}/tok", vocab_size=512)
    config = models.ModelConfig.from_hf(dict(PEER_QWEN2, vocab_size=len(tok)))
    params = models.init_params(config, jax.random.PRNGKey(0))
    enc = lambda s: tok.encode(s, add_special_tokens=False)

    # Scripts (rows of one array): script b thinks 6*b + 4 filler tokens first.
    filler = enc(" Let me think about it.")
    call = enc('<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>')
    answer = enc(" The answer is 42.<|im_end|>")
    scripts = []
    for b in range(args.slots):
        pre = (filler * 16)[: 6 * b + 4]
        mid = (filler * 16)[: 24 - 3 * b]
        scripts.append(pre + call + mid + call + filler * 2 + answer)
    K = max(map(len, scripts))
    script_BK = jnp.asarray([s + [s[-1]] * (K - len(s)) for s in scripts], jnp.int32)

    def hook(logits_BV, sampled_B, seq_B, script_BK):
        want = script_BK[seq_B % script_BK.shape[0], jnp.minimum(sampled_B, K - 1)]
        return jnp.where(jnp.arange(logits_BV.shape[-1])[None] == want[:, None], 0.0, -1e9)

    eng = EngineCore(
        config,
        params,
        slots=args.slots,
        max_len=512,
        max_prefill_length=64,
        tokenizer=tok,
        logits_hook=hook,
        hook_data=script_BK,
    )
    prompts = [enc(f"Question {i}: what is the answer?") for i in range(args.prompts)]

    def make_executor(sleep):
        @function_tool
        async def lookup(q: str) -> str:
            """Looks something up."""
            await asyncio.sleep(sleep)
            return "found 42"

        return ToolExecutor([lookup])

    def run(sleep, max_parked=None):
        stats = {}
        t0 = time.perf_counter()
        trajs = run_rollouts(
            eng,
            params,
            prompts,
            tokenizer=tok,
            protocol="qwen",
            executor=make_executor(sleep),
            sampling=GREEDY,
            stats=stats,
            limits=RolloutLimits(
                max_tool_calls=2,
                chunk_size=args.chunk,
                max_response_tokens=400,
                max_parked=max_parked,
            ),
        )
        wall = time.perf_counter() - t0
        assert all(t.num_tool_calls == 2 and t.finish_reason == "eos" for t in trajs), [
            (t.num_tool_calls, t.finish_reason) for t in trajs
        ]
        return wall, stats

    run(0.0)  # warm-up: compiles every bucket
    run(args.sleep)
    calls = 2 * args.prompts
    print(
        f"{args.prompts} trajectories, {args.slots} slots, {calls} tool calls, chunk {args.chunk}; "
        f"serial tool time would be {calls * args.sleep:.1f} s"
    )
    for label, max_parked in (
        ("keeping their slots", 0),
        ("parked while waiting (default: as many as the slots)", None),
        ("parked while waiting (no limit)", args.prompts),
    ):
        fasts, slows = [], []
        for _ in range(args.repeats):  # interleaved: the shared machine drifts between runs
            fasts.append(run(0.0, max_parked))
            slows.append(run(args.sleep, max_parked))
        fast, fs = sorted(fasts, key=lambda x: x[0])[len(fasts) // 2]
        slow, ss = sorted(slows, key=lambda x: x[0])[len(slows) // 2]
        print(f"-- trajectories {label} (max_parked={max_parked})")
        print(
            f"instant tool : {fast:.2f} s wall ({fs['generate_s']:.2f} s in generate, "
            f"{fs['chunks']} chunks, {fs['parks']} parks)"
        )
        print(
            f"{args.sleep * 1000:.0f} ms tool  : {slow:.2f} s wall ({ss['generate_s']:.2f} s in "
            f"generate, {ss['chunks']} chunks, {ss['parks']} parks, "
            f"{ss['max_in_flight']} trajectories in flight at most)"
        )
        print(
            f"runs (s): instant {[round(f, 2) for f, _ in fasts]}, "
            f"sleep {[round(x, 2) for x, _ in slows]}"
        )
        print(f"RESULT {label}: ratio sleep/instant = {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
