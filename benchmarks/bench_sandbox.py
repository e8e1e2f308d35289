"""Sandbox pool latency/throughput vs a fresh `python -c` process (and vs an earlier version).

Usage: python benchmarks/bench_sandbox.py [--calls 200] [--fresh-calls 20] [--workers N]
                                          [--against GIT_REF]

Reports, for print(1+1) and a small numpy snippet: median and p99 wall latency per call through
the pool (sequential calls; for print(1+1) this is all overhead) and the overhead beyond the
the time measured inside the sandbox (fork, rlimits, Landlock, seccomp, run, reap), next to a fresh
unsandboxed `python -c` subprocess of the same code; then throughput with every worker busy.
Goal: median pool overhead <= 15 ms.

`--against REF` also loads the sandbox (tools/sandbox.py, pool.py, _sandbox_worker.py) as it was
at git REF and times print(1+1) through both pools in alternating rounds, so a change to the
sandbox is measured against its predecessor under the same machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxrl_tools.tools import SandboxConfig, SandboxPool

SNIPPETS = {
    "print(1+1)": "print(1+1)",
    "numpy": "import numpy as np\na = np.arange(10000.0).reshape(100, 100)\n"
    "print(float((a @ a.T).trace()))",
}


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def bench_pool(pool: SandboxPool, code: str, n: int) -> dict:
    lat, over = [], []

    async def go():
        for _ in range(n):
            r = await pool.run(code)
            assert r.ok, r
            lat.append(r.latency_s)
            over.append(r.latency_s - r.execution_time)

    asyncio.run(go())
    return {
        "median_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "host_side_median_ms": pct(over, 50),
        "host_side_p99_ms": pct(over, 99),
    }


def bench_fresh(code: str, n: int) -> dict:
    lat = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        lat.append(time.monotonic() - t0)
    return {"median_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}


def bench_throughput(pool: SandboxPool, code: str, n: int) -> float:
    async def go():
        t0 = time.monotonic()
        res = await asyncio.gather(*(pool.run(code) for _ in range(n)))
        assert all(r.ok for r in res)
        return n / (time.monotonic() - t0)

    return asyncio.run(go())


def sandbox_at(ref: str):
    """(SandboxPool, SandboxConfig) of the sandbox as it was at git `ref`, from a temp copy."""
    repo = Path(__file__).resolve().parents[1]
    pkg = Path(tempfile.mkdtemp()) / "sandbox_at_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("sandbox.py", "pool.py", "_sandbox_worker.py"):
        src = subprocess.run(
            ["git", "show", f"{ref}:tools/{name}"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (pkg / name).write_text(src.replace("jaxrl_tools.tools.sandbox", "sandbox_at_ref.sandbox"))
    sys.path.insert(0, str(pkg.parent))
    old = importlib.import_module("sandbox_at_ref.pool")
    return old.SandboxPool, importlib.import_module("sandbox_at_ref.sandbox").SandboxConfig


def compare(ref: str, calls: int, workers: int, rounds: int = 8) -> None:
    """print(1+1) latency here vs at `ref`, alternating rounds of calls/rounds each."""
    old_pool_cls, old_cfg_cls = sandbox_at(ref)
    pools = {
        "this tree": SandboxPool(workers, SandboxConfig(timeout_s=10.0)),
        ref: old_pool_cls(workers, old_cfg_cls(timeout_s=10.0)),
    }
    lat = {name: [] for name in pools}
    try:
        for p in pools.values():
            p.run_sync("print(1+1)")
        for _ in range(rounds):
            for name, p in pools.items():
                r = bench_pool(p, "print(1+1)", calls // rounds)
                lat[name].append(r["median_ms"])
    finally:
        for p in pools.values():
            p.close()
    here, there = (float(np.median(v)) for v in lat.values())
    print(
        f"print(1+1), alternating rounds: this tree median {here:.1f} ms, {ref} {there:.1f} ms "
        f"(ratio {here / there:.2f}; per round: {[round(x, 1) for x in lat['this tree']]} vs "
        f"{[round(x, 1) for x in lat[ref]]})"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--fresh-calls", type=int, default=20)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--against", metavar="GIT_REF", help="also time the sandbox as of this ref")
    args = ap.parse_args()
    if args.against:
        compare(args.against, args.calls, args.workers)
    t0 = time.monotonic()
    pool = SandboxPool(args.workers, SandboxConfig(timeout_s=10.0))
    report = {
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "pool_start_s": time.monotonic() - t0,
    }
    try:
        for name, code in SNIPPETS.items():
            pool.run_sync(code)  # warm-up
            report[name] = {
                "pool": bench_pool(pool, code, args.calls),
                "fresh_python_c": bench_fresh(code, args.fresh_calls),
                "throughput_per_s": bench_throughput(pool, code, args.calls),
            }
        report["pool_metrics"] = pool.metrics()
    finally:
        pool.close()
    print(json.dumps(report, indent=2))
    for name in SNIPPETS:
        r = report[name]
        pl, fr = r["pool"], r["fresh_python_c"]
        print(
            f"{name:>11}: pool median {pl['median_ms']:.1f} ms (p99 {pl['p99_ms']:.1f}), of "
            f"which host-side (IPC, threads) {pl['host_side_median_ms']:.1f} ms; fresh python "
            f"-c median {fr['median_ms']:.1f} ms (p99 {fr['p99_ms']:.1f}); throughput "
            f"{r['throughput_per_s']:.0f}/s on {args.workers} workers"
        )


if __name__ == "__main__":
    main()
