"""Padded sizes: lengths and widths round up to powers of two, so a run compiles a few programs
instead of one per length."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()
