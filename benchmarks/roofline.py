"""This machine's roofline, measured in the process that runs a benchmark.

Two rates bound every step: how fast the device multiplies matrices (`matmul_flops`, a jitted
square matmul in the benchmark's dtype) and how fast it reads memory (`read_bandwidth`, a jitted
sum over an array much larger than the caches). A workload that must do F FLOPs and move M bytes
cannot take less than its floor, max(F / matmul rate, M / bandwidth); benchmarks print their time
as a fraction of that floor (`utilisation`), which, unlike a peer's figure, does not move with
the machine's load between runs.

Run alone it prints the two rates: python benchmarks/roofline.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp


def _best_time(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(n: int | None = None, dtype=jnp.float32, reps: int = 5) -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul (2 n^3 FLOPs), best of `reps`."""
    n = n or (8192 if jax.devices()[0].platform != "cpu" else 2048)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    t = _best_time(jax.jit(jnp.matmul), a, b, reps=reps)
    return 2 * n**3 / t


def read_bandwidth(megabytes: int | None = None, reps: int = 5) -> float:
    """Bytes/s read by a jitted float32 sum of a `megabytes` array, best of `reps`."""
    megabytes = megabytes or (4096 if jax.devices()[0].platform != "cpu" else 512)
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    t = _best_time(jax.jit(jnp.sum), x, reps=reps)
    return x.nbytes / t


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The measured rates and the floor of a workload under them."""

    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def measure(cls, dtype=jnp.float32) -> Roofline:
        return cls(matmul_flops(dtype=dtype), read_bandwidth())

    def floor_s(self, flops: float, bytes_moved: float) -> float:
        return max(flops / self.flops_per_s, bytes_moved / self.bytes_per_s)

    def utilisation(self, seconds: float, flops: float, bytes_moved: float) -> float:
        """floor / measured time: 1.0 is the roofline."""
        return self.floor_s(flops, bytes_moved) / seconds

    @staticmethod
    def decode_work(matmul_weights: int, itemsize: int, batch: int, kv_bytes: int):
        """(FLOPs, bytes) of one decode step of `batch` tokens: 2 x matmul weights FLOPs per
        token, and every weight (`itemsize` bytes each) plus the live KV cache read once."""
        return 2 * matmul_weights * batch, matmul_weights * itemsize + kv_bytes

    def decode_floor_s(self, matmul_weights: int, itemsize: int, batch: int, kv_bytes: int):
        """The floor of one decode step (`decode_work`)."""
        return self.floor_s(*self.decode_work(matmul_weights, itemsize, batch, kv_bytes))

    def grpo_step_floor_s(self, weights: int, rows: int, tokens: int) -> float:
        """The FLOP floor of a GRPO step (one update per batch) over `rows` sequences of `tokens`
        (prompt + response): 2 x weights per token to generate (prefill included), 6 x weights
        per token for the update's forward and backward; 16 bytes per weight (weights,
        gradients, Adam's moments) is the bandwidth side."""
        return self.floor_s(8 * weights * rows * tokens, 16 * weights)

    def describe(self) -> str:
        return (
            f"roofline: matmul {self.flops_per_s / 1e9:,.0f} GFLOP/s, read "
            f"{self.bytes_per_s / 1e9:,.1f} GB/s on {jax.devices()[0].device_kind}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(Roofline.measure(jnp.dtype(args.dtype)).describe())


if __name__ == "__main__":
    main()
