"""Sequence packing: the sequences of a right-padded batch back to back in fewer rows.

A padded batch gives each sequence a row of the batch's width T, so a batch of short and long
responses computes mostly on padding. Packing places the sequences (first-fit decreasing by
length) into rows of the same width, each numbered 1, 2, ... within its row by its segment id (0
on padding). The model attends within a segment only and the positions restart per sequence
(`models.hidden_states(packed=True)`), so every token's log-prob is the padded batch's; per-row
reductions of the losses become per-segment ones (`algorithms.aggregate(segment_ids_BT=...)`).

`Packing` records where each token went; `pack` and `unpack` move per-token arrays between the
two layouts, on the host (NumPy) or inside a jitted function (jax arrays, with the index arrays
passed in: `take_tokens`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


def take_tokens(x, index, fill=0):
    """out[...] = x.flat[index[...]], and `fill` where index == x.size (NumPy or jax arrays)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    flat = xp.concatenate([xp.reshape(x, -1), xp.full((1,), fill, x.dtype)])
    return flat[index]


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where every token of a [rows, width] padded batch lies in the [packed_rows, width] one.

    Attributes:
      rows, packed_rows, width: R, P and T.
      src_PT: per packed token, its flat index in the padded batch (R * T on padding).
      dst_RT: per padded token, its flat index in the packed batch (P * T on padding).
      segments_PT: int32 segment ids: 1, 2, ... per packed row, 0 on padding.
    """

    rows: int
    packed_rows: int
    width: int
    src_PT: np.ndarray
    dst_RT: np.ndarray
    segments_PT: np.ndarray

    def pack(self, x_RT, fill=0):
        """A per-token [R, T] array in the packed layout, [P, T] (`fill` on padding)."""
        return take_tokens(x_RT, self.src_PT, fill)

    def unpack(self, x_PT, fill=0):
        """A per-token [P, T] array back in the padded layout, [R, T] (`fill` on padding)."""
        return take_tokens(x_PT, self.dst_RT, fill)

    def pack_rows(self, x_R, fill=0):
        """A per-row [R] value, repeated over each of its tokens, in the packed layout [P, T]."""
        x_R = np.asarray(x_R)
        return self.pack(np.repeat(x_R[:, None], self.width, axis=1), fill)

    @property
    def fill_fraction(self) -> float:
        """Real tokens / packed slots (the padded batch's is real tokens / (R * T))."""
        return float(np.count_nonzero(self.segments_PT)) / max(1, self.segments_PT.size)


def plan_packing(lengths_R, width: int, *, multiple: int = 1) -> Packing:
    """Packs sequences of `lengths_R` tokens (row r's first lengths_R[r]) into rows of `width`.

    First-fit decreasing: longest first, each into the first row with room. Rows of length 0 are
    left out. The packed row count is rounded up to `multiple` (micro-batches and devices split
    it) with all-padding rows.
    """
    lengths = np.asarray(lengths_R, np.int64)
    R = len(lengths)
    if multiple < 1:
        raise ValueError(f"plan_packing: multiple must be >= 1, got {multiple}")
    if (lengths > width).any():
        r = int(np.argmax(lengths > width))
        raise ValueError(f"plan_packing: row {r} has {lengths[r]} tokens, more than width {width}")
    order = sorted(np.flatnonzero(lengths > 0), key=lambda r: (-lengths[r], r))
    used = np.zeros(max(1, R), np.int64)  # tokens placed in each packed row so far
    n_used = 0
    row_of = np.full(R, -1, np.int64)
    offset = np.zeros(R, np.int64)
    for r in order:
        n = lengths[r]
        room = np.flatnonzero(used[:n_used] + n <= width)
        p = room[0] if len(room) else n_used
        n_used = max(n_used, p + 1)
        row_of[r], offset[r] = p, used[p]
        used[p] += n
    P = max(multiple, -(-n_used // multiple) * multiple)
    src = np.full((P, width), R * width, np.int32)
    dst = np.full((R, width), P * width, np.int32)
    segments = np.zeros((P, width), np.int32)
    seg_count = np.zeros(P, np.int32)
    for r in sorted(order, key=lambda r: (row_of[r], offset[r])):
        p, o, n = row_of[r], offset[r], int(lengths[r])
        seg_count[p] += 1
        src[p, o : o + n] = r * width + np.arange(n)
        dst[r, :n] = p * width + o + np.arange(n)
        segments[p, o : o + n] = seg_count[p]
    return Packing(R, P, width, src, dst, segments)
