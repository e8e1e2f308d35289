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
are laid out as that prompt once, in a prompt slot, then each sample's own tokens in a sample
slot of fixed width, each attending to the prompt and to itself: the update computes the
prompt once per group instead of once per sample, and the attention only what is seen.
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


def slot_width(n: int, per_doubling: int = 16) -> int:
    """n rounded up to one of `per_doubling` (a power of two) widths per doubling: by default a
    multiple of 2^(floor(log2 n) - 4), at most 6% more (so few compiled shapes); 4 per doubling
    is at most 25% more."""
    n = max(int(n), 1)
    step = 1 << max(n.bit_length() - per_doubling.bit_length(), 0)
    return -(-n // step) * step


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
      prompt_keys_PNS: with shared prompts (`plan_shared_packing`), bool [P, N, S]: the
        rows are a prompt slot of S tokens then N sample slots, and sample slot j sees the
        prompt-slot tokens marked in [p, j]; else None.
    """

    rows: int
    packed_rows: int
    width: int
    padded_width: int
    src_PT: np.ndarray
    dst_RT: np.ndarray
    segments_PT: np.ndarray
    prompt_keys_PNS: np.ndarray | None = None

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
    def slots(self) -> tuple[int, int, int] | None:
        """(S, N, L): the prompt slot's width, the sample slots and their width; None unless the
        rows share prompts."""
        if self.prompt_keys_PNS is None:
            return None
        _, N, S = self.prompt_keys_PNS.shape
        return S, N, (self.width - S) // N

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
    return _layout(np.asarray(lengths_R, np.int64), padded_width or width, width, multiple)


def plan_shared_packing(
    tokens_RT,
    lengths_R,
    loss_mask_RT,
    *,
    width: int | None = None,
    multiple: int = 1,
    least: tuple[int, int] = (0, 0),
) -> Packing:
    """The rows whose context is the same laid out as that context once, then each row's own
    tokens (the samples of one prompt: G x (P + R) tokens become P + G x R), in rows of slots:
    a prompt slot of S tokens, then N sample slots of L tokens each (`Packing.slots`).

    A row's context is its tokens before its first loss token. Rows with the same context of
    s >= 2 tokens share its first s - 1: the prompt slot of a packed row holds them once, and
    each row lies in a sample slot from its context's last token on, so the shift by one that
    turns hidden states into next-token log-probs, and values, stays within the row's own
    segment. Sample slot j's queries see the prompt-slot keys marked in `prompt_keys_PNS[p, j]`
    and the earlier tokens of their own slot (`models.attention`): with fixed slots no score is
    computed that a sample hides from another. A set of more than N rows is split, each part
    with its own copy of the context. Rows that share their context with none fill free sample
    slots whole where they fit (seeing no prompt), else take a packed row of their own.

    S and L are the longest shared context and sample, at least `least` (an earlier batch's
    slots: its compiled shapes serve again), rounded up (`slot_width`); N is the largest set, at
    most what `width` (default the padded rows') holds. When no context is shared, or the slots
    would not hold fewer tokens than `plan_packing` into rows of `width`, that plain packing is
    returned (`slots` None).
    """
    tokens, mask = np.asarray(tokens_RT), np.asarray(loss_mask_RT)
    lengths = np.asarray(lengths_R, np.int64)
    R, T = tokens.shape
    width = width or T
    plain = plan_packing(lengths, width, multiple=multiple, padded_width=T)
    sets: dict[tuple, list[int]] = {}
    head = np.zeros(R, np.int64)  # the tokens of each row's context it can share
    for r in np.flatnonzero(lengths > 0):
        trained = np.flatnonzero(mask[r, : lengths[r]] > 0)
        s = int(trained[0]) if len(trained) else int(lengths[r])
        shareable = 2 <= s < lengths[r]
        head[r] = s - 1 if shareable else 0
        key = ("context", s, tokens[r, :s].tobytes()) if shareable else ("row", int(r))
        sets.setdefault(key, []).append(int(r))
    shared = [rows for rows in sets.values() if len(rows) > 1]
    if not shared:
        return plain
    least_S, least_L = least
    L = slot_width(max(least_L, *(lengths[r] - head[r] for rows in shared for r in rows)))
    singles = [rows[0] for rows in sets.values() if len(rows) == 1]
    fillers = [r for r in singles if lengths[r] <= L]
    units = shared + [[r] for r in singles if lengths[r] > L]  # these keep a prompt slot
    S = slot_width(max(least_S, *(head[rows[0]] for rows in units)))
    L = slot_width(max(least_L, *(lengths[r] - head[r] for rows in units for r in rows)))
    N = min(max(len(rows) for rows in units), (width - S) // L)
    if N < 2:  # a row holds no prompt slot and two samples
        return plain
    # Each packed row: the rows sharing its prompt slot, then the whole rows filling its slots.
    slotted = [(rows[i : i + N], []) for rows in units for i in range(0, len(rows), N)]
    for r in fillers:
        row = next((x for x in slotted if len(x[0]) + len(x[1]) < N), None)
        if row is None:
            slotted.append(row := ([], []))
        row[1].append(r)
    P = max(multiple, -(-len(slotted) // multiple) * multiple)
    W = S + N * L
    if P * W >= plain.packed_rows * plain.width:
        return plain
    src = np.full((P, W), R * T, np.int32)
    dst = np.full((R, T), P * W, np.int32)
    segments = np.zeros((P, W), np.int32)
    prompt_keys = np.zeros((P, N, S), bool)
    for p, (sharing, whole) in enumerate(slotted):
        h = int(head[sharing[0]]) if sharing else 0
        if h:  # the context once; every row of the set maps its tokens to it
            src[p, :h], segments[p, :h] = sharing[0] * T + np.arange(h), 1
            prompt_keys[p, : len(sharing), :h] = True
        for j, r in enumerate(sharing + whole):
            skip = h if j < len(sharing) else 0
            n, at = int(lengths[r]) - skip, p * W + S + j * L
            dst[r, :skip] = p * W + np.arange(skip)
            src.flat[at : at + n] = r * T + skip + np.arange(n)
            dst[r, skip : skip + n] = at + np.arange(n)
            segments.flat[at : at + n] = j + 2
    return Packing(R, P, W, T, src, dst, segments, prompt_keys)


def _layout(lengths, T: int, width: int, multiple: int) -> Packing:
    """The sequences placed first-fit decreasing (longest first, each into the first packed row
    with room), segments numbered 1, 2, ... per packed row in order of offset."""
    if multiple < 1:
        raise ValueError(f"plan_packing: multiple must be >= 1, got {multiple}")
    if (lengths > width).any():
        r = int(np.argmax(lengths > width))
        raise ValueError(f"plan_packing: row {r} has {lengths[r]} tokens, more than width {width}")
    R = len(lengths)
    order = sorted(np.flatnonzero(lengths > 0), key=lambda r: (-lengths[r], r))
    used = np.zeros(max(1, R), np.int64)  # tokens placed in each packed row so far
    n_used = 0
    row_of, offset = np.zeros(R, np.int64), np.zeros(R, np.int64)
    for r in order:
        room = np.flatnonzero(used[:n_used] + lengths[r] <= width)
        p = room[0] if len(room) else n_used
        n_used = max(n_used, p + 1)
        row_of[r], offset[r] = p, used[p]
        used[p] += lengths[r]
    P = max(multiple, -(-n_used // multiple) * multiple)
    src = np.full((P, width), R * T, np.int32)
    dst = np.full((R, T), P * width, np.int32)
    segments = np.zeros((P, width), np.int32)
    seg_count = np.zeros(P, np.int32)
    for r in sorted(order, key=lambda r: (row_of[r], offset[r])):
        p, n = row_of[r], int(lengths[r])
        at = p * width + offset[r]
        seg_count[p] += 1
        src.flat[at : at + n] = r * T + np.arange(n)
        dst[r, :n] = at + np.arange(n)
        segments.flat[at : at + n] = seg_count[p]
    return Packing(R, P, width, T, src, dst, segments)
