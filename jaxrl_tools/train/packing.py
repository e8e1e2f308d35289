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

With shared prompts (`plan_shared_packing`, `optim.share_prefix`), the samples of one prompt
are laid out as that prompt once, then each sample's own tokens, each attending to the prompt
and to itself: the update computes the prompt once per group instead of once per sample.
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
    """Where every token of a [rows, padded_width] padded batch lies in the [packed_rows, width]
    one.

    Attributes:
      rows, packed_rows, width: R, P and the packed rows' width W.
      padded_width: T, the padded rows' width (W unless the packed rows are wider).
      src_PT: per packed token, its flat index in the padded batch (R * T on padding).
      dst_RT: per padded token, its flat index in the packed batch (P * W on padding).
      segments_PT: int32 segment ids: 1, 2, ... per packed row, 0 on padding.
      prefix_PT: with shared prompts (`plan_shared_packing`), the segment of the prefix each
        token also attends to (0: none); else None.
    """

    rows: int
    packed_rows: int
    width: int
    padded_width: int
    src_PT: np.ndarray
    dst_RT: np.ndarray
    segments_PT: np.ndarray
    prefix_PT: np.ndarray | None = None

    def pack(self, x_RT, fill=0):
        """A per-token [R, T] array in the packed layout, [P, T] (`fill` on padding)."""
        return take_tokens(x_RT, self.src_PT, fill)

    def unpack(self, x_PT, fill=0):
        """A per-token [P, T] array back in the padded layout, [R, T] (`fill` on padding)."""
        return take_tokens(x_PT, self.dst_RT, fill)

    def pack_rows(self, x_R, fill=0):
        """A per-row [R] value, repeated over each of its tokens, in the packed layout [P, T]."""
        x_R = np.asarray(x_R)
        return self.pack(np.repeat(x_R[:, None], self.padded_width, axis=1), fill)

    @property
    def fill_fraction(self) -> float:
        """Real tokens / packed slots (the padded batch's is real tokens / (R * T))."""
        return float(np.count_nonzero(self.segments_PT)) / max(1, self.segments_PT.size)


def plan_packing(
    lengths_R, width: int, *, multiple: int = 1, padded_width: int | None = None
) -> Packing:
    """Packs sequences of `lengths_R` tokens (row r's first lengths_R[r]) of rows
    `padded_width` wide (default `width`) into rows of `width`.

    First-fit decreasing: longest first, each into the first row with room. Rows of length 0 are
    left out. The packed row count is rounded up to `multiple` (micro-batches and devices split
    it) with all-padding rows.
    """
    lengths = np.asarray(lengths_R, np.int64)
    units = [_Unit((r,), 0) for r in np.flatnonzero(lengths > 0)]
    return _layout(units, lengths, padded_width or width, width, multiple)


def plan_shared_packing(
    tokens_RT, lengths_R, loss_mask_RT, *, width: int | None = None, multiple: int = 1
) -> Packing:
    """`plan_packing`, with the rows whose context is the same laid out as that context once,
    then each row's own tokens (the samples of one prompt: G x (P + R) tokens become P + G x R).

    A row's context is its tokens before its first loss token. Rows with the same context of
    s >= 2 tokens share its first s - 1 (the prefix segment, `Packing.prefix_PT` on the tokens
    that also attend to it); each keeps its context's last token, so the shift by one that turns
    hidden states into next-token log-probs, and values, stays within the row's own segment.
    A set of rows too long for one packed row is split, each part with its own copy of the
    prefix. Every packed token still comes from one padded token (`src_PT`); every padded
    token of a shared prefix maps to the one copy (`dst_RT`), and none is trained on.

    `width`: the packed rows' (default the padded rows'). A group shares its prompt whole only
    in a row that holds it: G samples of prompt P and responses R need P + G x R tokens.
    """
    tokens, mask = np.asarray(tokens_RT), np.asarray(loss_mask_RT)
    lengths = np.asarray(lengths_R, np.int64)
    R, padded_width = tokens.shape
    width = width or padded_width
    sets: dict[tuple, list[int]] = {}
    contexts = {}
    for r in np.flatnonzero(lengths > 0):
        trained = np.flatnonzero(mask[r, : lengths[r]] > 0)
        s = int(trained[0]) if len(trained) else int(lengths[r])
        contexts[r] = s
        key = ("context", s, tokens[r, :s].tobytes()) if 2 <= s < lengths[r] else ("row", r)
        sets.setdefault(key, []).append(int(r))
    units = []
    for rows in sets.values():
        s = contexts[rows[0]] if len(rows) > 1 else 0
        head = max(s - 1, 0)
        part, size = [], head
        for r in rows:  # in row order, a new copy of the prefix when the packed row is full
            if part and size + lengths[r] - head > width:
                units.append(_Unit(tuple(part), s))
                part, size = [], head
            part.append(r)
            size += lengths[r] - head
        units.append(_Unit(tuple(part), s))
    return _layout(units, lengths, padded_width, width, multiple)


@dataclasses.dataclass(frozen=True)
class _Unit:
    """Rows placed together: with `shared` = s > 0, their common first s - 1 tokens once (from
    the first row) and then each row from token s - 1; with 0, one row as it is."""

    rows: tuple[int, ...]
    shared: int

    def size(self, lengths) -> int:
        head = max(self.shared - 1, 0)
        return head + sum(int(lengths[r]) - head for r in self.rows)


def _layout(units: list[_Unit], lengths, T: int, width: int, multiple: int) -> Packing:
    """The units placed first-fit decreasing (largest first, each into the first packed row
    with room), segments numbered 1, 2, ... per packed row in order of offset."""
    if multiple < 1:
        raise ValueError(f"plan_packing: multiple must be >= 1, got {multiple}")
    if (lengths > width).any():
        r = int(np.argmax(lengths > width))
        raise ValueError(f"plan_packing: row {r} has {lengths[r]} tokens, more than width {width}")
    R = len(lengths)
    sizes = [u.size(lengths) for u in units]
    order = sorted(range(len(units)), key=lambda i: (-sizes[i], units[i].rows[0]))
    used = np.zeros(max(1, len(units)), np.int64)  # tokens placed in each packed row so far
    n_used = 0
    row_of, offset = np.zeros(len(units), np.int64), np.zeros(len(units), np.int64)
    for i in order:
        room = np.flatnonzero(used[:n_used] + sizes[i] <= width)
        p = room[0] if len(room) else n_used
        n_used = max(n_used, p + 1)
        row_of[i], offset[i] = p, used[p]
        used[p] += sizes[i]
    P = max(multiple, -(-n_used // multiple) * multiple)
    src = np.full((P, width), R * T, np.int32)
    dst = np.full((R, T), P * width, np.int32)
    segments = np.zeros((P, width), np.int32)
    prefix = np.zeros((P, width), np.int32)
    seg_count = np.zeros(P, np.int32)
    for i in sorted(order, key=lambda i: (row_of[i], offset[i])):
        unit, p = units[i], row_of[i]
        at = p * width + offset[i]  # the next free packed token, flat
        head = max(unit.shared - 1, 0)
        if head:  # the shared prefix: the first row's tokens, every row's map to them
            seg_count[p] += 1
            src.flat[at : at + head] = unit.rows[0] * T + np.arange(head)
            segments.flat[at : at + head] = seg_count[p]
            for r in unit.rows:
                dst[r, :head] = at + np.arange(head)
            at += head
        for j, r in enumerate(unit.rows):
            n = int(lengths[r]) - head
            seg_count[p] += 1
            src.flat[at : at + n] = r * T + head + np.arange(n)
            dst[r, head : head + n] = at + np.arange(n)
            segments.flat[at : at + n] = seg_count[p]
            if head:  # the prefix's segment, j + 1 segments back
                prefix.flat[at : at + n] = seg_count[p] - j - 1
            at += n
    shared = any(u.shared for u in units)
    return Packing(R, P, width, T, src, dst, segments, prefix if shared else None)
