"""Where a decoded chunk ends: the pure stop scan of the agent loop (token-in-token-out).

A segment is cut after the first token at which (a) the token is an EOS id, or (b) the decoded
text of the segment so far contains a stop string. With byte-level BPE a stop string may end
inside a token (e.g. "</code>" merged with "\\n"): that whole token is kept (it was sampled),
the tokens after it are dropped, and the parser sees the text only up to the end of the stop
string. EOS wins a tie with a stop string on the same token. Running out of response room or
context cuts the chunk there ("length" / "budget") unless a stop came first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

Stop = str | re.Pattern


class Cut(NamedTuple):
    """Keep `tokens[:keep]`; `reason` None (go on), "eos", "tool", "stop", "length" or
    "budget"; `stop_end` is where the stop string ends in the segment's text (else None)."""

    keep: int
    reason: str | None
    stop_end: int | None


def first_stop(text: str, stops: Sequence[Stop]) -> tuple[int, Stop] | None:
    """(end index, stop) of the stop occurrence that ends first in `text`, or None. A stop is a
    string or a compiled regex (its first match: ZeroTIR's closing fence of an open block)."""
    best = None
    for s in stops:
        if isinstance(s, str):
            i = text.find(s)
            end = i + len(s) if i >= 0 else None
        else:
            m = s.search(text)
            end = m.end() if m else None
        if end is not None and (best is None or end < best[0]):
            best = (end, s)
    return best


def scan_chunk(
    tokens: Sequence[int],
    *,
    segment: Sequence[int],
    decode: Callable[[Sequence[int]], str] | None,
    eos_ids: Collection[int],
    tool_stops: Sequence[Stop] = (),
    final_stops: Sequence[Stop] = (),
    room: int,
    context: int,
) -> Cut:
    """Scans a chunk of new `tokens` that continues `segment` (the current model segment).

    Args:
      tokens: the chunk's sampled tokens.
      segment: the segment's tokens before this chunk (stop strings may straddle the boundary).
      decode: token ids -> text (needed when there are stop strings).
      eos_ids: tokens that end the response.
      tool_stops: stop strings that end a tool call ("tool"); final_stops end the response
        ("stop").
      room: response tokens left before "length"; context: cache positions left ("budget").
    """
    stops = tuple(tool_stops) + tuple(final_stops)
    tokens = list(tokens)
    keep, reason, stop_end = len(tokens), None, None
    for i, t in enumerate(tokens):
        if t in eos_ids:
            keep, reason = i + 1, "eos"
            break
    if stops:
        seg = list(segment)
        if first_stop(decode(seg + tokens[:keep]), stops) is not None:
            # the smallest prefix whose text holds a stop (monotone in its length)
            lo, hi = 1, keep
            while lo < hi:
                mid = (lo + hi) // 2
                if first_stop(decode(seg + tokens[:mid]), stops) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < keep or reason is None:
                end, which = first_stop(decode(seg + tokens[:lo]), stops)
                keep, stop_end = lo, end
                reason = "tool" if which in tool_stops else "stop"
    if keep >= room and (reason is None or keep > room):
        keep, reason, stop_end = room, "length", None
    if keep >= context and (reason is None or keep > context):
        keep, reason, stop_end = context, "budget", None
    return Cut(keep, reason, stop_end)
