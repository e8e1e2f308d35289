"""The host side of `EngineCore.write_slots`: several rows' new tokens checked and padded into
the bucketed arrays of one `kernels.write_kernel` call (row count and token count rounded up to
powers of two, so that jit compiles a handful of shapes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.shapes import next_pow2


@dataclasses.dataclass(frozen=True)
class SlotWrites:
    """One `write_kernel` call's host arrays (M rows, a power of two; K tokens, a bucket).

    Attributes:
      rows: int32 [M] the slots written; padding rows hold `slots` (out of range: dropped).
      tokens: int32 [M, K] each row's tokens, zero-padded.
      starts, counts, sampled: int32 [M] first position, real tokens, model tokens kept.
      reset: None, or (keys uint32 [M, 2], temperature, top_k, top_p, seq [M]) of new sequences.
      modes: the sampling mode (`sampling.MODES`) of each slot a reset starts.
      end: the end of the longest write (its last position + 1).
    """

    rows: np.ndarray
    tokens: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    sampled: np.ndarray
    reset: tuple[np.ndarray, ...] | None
    modes: dict[int, str]
    end: int


def pack_writes(
    slots: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    *,
    starts: Sequence[int] | None,
    sampled: Sequence[int] | None,
    reset: Sequence[tuple[Any, SamplingParams]] | None,
    seq_ids: Sequence[int] | None,
    num_slots: int,
    max_len: int,
) -> SlotWrites | None:
    """The arrays of `EngineCore.write_slots`'s arguments (see there); None for no rows.

    Args:
      num_slots: the engine's slots (the padding rows' index).
      max_len: the engine's cache positions per slot (no row may end past it).
    """
    m = len(slots)
    if m == 0:
        return None
    if starts is None:
        raise ValueError("write_slots: `starts` (first position per row) is required")
    lens = [len(t) for t in token_lists]
    if min(lens) < 1:
        raise ValueError("write_slots: every token list must be non-empty")
    for s, st, n in zip(slots, starts, lens):
        if st + n > max_len:
            raise ValueError(
                f"write_slots: slot {s} would hold {st + n} tokens > max_len={max_len}"
            )
    M = next_pow2(m)
    K = min(next_pow2(max(lens), 16), max_len)
    rows = np.full((M,), num_slots, np.int32)
    rows[:m] = slots
    toks = np.zeros((M, K), np.int32)
    for i, t in enumerate(token_lists):
        toks[i, : len(t)] = t
    st_M = np.zeros((M,), np.int32)
    st_M[:m] = starts
    n_M = np.zeros((M,), np.int32)
    n_M[:m] = lens
    sm_M = np.zeros((M,), np.int32)
    if sampled is not None:
        sm_M[:m] = sampled
    rs, modes = None, {}
    if reset is not None:
        keys = np.zeros((M, 2), np.uint32)
        temp = np.ones((M,), np.float32)
        topk = np.zeros((M,), np.int32)
        topp = np.ones((M,), np.float32)
        seq = np.zeros((M,), np.int32)
        seq[:m] = slots if seq_ids is None else seq_ids
        for i, (key, sp) in enumerate(reset):
            keys[i] = np.asarray(key, np.uint32)
            temp[i], topk[i], topp[i] = sp.temperature, sp.top_k, sp.top_p
            modes[slots[i]] = sp.mode
        rs = (keys, temp, topk, topp, seq)
    end = int(np.max(st_M[:m] + n_M[:m]))
    return SlotWrites(rows, toks, st_M, n_M, sm_M, rs, modes, end)
