"""The pure stop scan (`rollout.stops.scan_chunk`) against the scan the agent loop used to
inline, on random token streams over a tiny vocabulary where stop strings straddle tokens."""

import random

from jaxrl_tools.rollout.stops import first_stop, scan_chunk

VOCAB = ["<", "/", "code", ">", ">\n", "</", "co", "de>", "x", " ", "<|im_end|>", "ans", "wer"]
EOS = {VOCAB.index("<|im_end|>")}
TOOL_STOPS = ("</code>",)
FINAL_STOPS = ("answer",)


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def old_scan(toks, seg, room, ctx):
    """The loop's scan before it moved to stops.py (transcribed as it was)."""
    all_stops = TOOL_STOPS + FINAL_STOPS
    cut, reason, stop_end = len(toks), None, None
    for i, t in enumerate(toks):
        if t in EOS:
            cut, reason = i + 1, "eos"
            break
    if all_stops:
        hit = first_stop(decode(seg + toks[:cut]), all_stops)
        if hit is not None:
            lo, hi = 1, cut
            while lo < hi:
                mid = (lo + hi) // 2
                if first_stop(decode(seg + toks[:mid]), all_stops) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < cut or reason is None:
                end, which = first_stop(decode(seg + toks[:lo]), all_stops)
                cut, stop_end = lo, end
                reason = "tool" if which in TOOL_STOPS else "stop"
    if cut >= room and (reason is None or cut > room):
        cut, reason, stop_end = room, "length", None
    if cut >= ctx and (reason is None or cut > ctx):
        cut, reason, stop_end = ctx, "budget", None
    return cut, reason, stop_end


def test_scan_chunk_agrees_with_the_old_inline_scan():
    rng = random.Random(0)
    reasons = set()
    for _ in range(6000):
        seg = [rng.randrange(len(VOCAB) - 1) for _ in range(rng.randrange(0, 4))]
        if first_stop(decode(seg), TOOL_STOPS + FINAL_STOPS):
            continue  # a segment never already holds a stop (the loop cut it there)
        toks = [rng.randrange(len(VOCAB)) for _ in range(rng.randrange(1, 12))]
        room, ctx = rng.randrange(1, 14), rng.randrange(1, 14)
        new = scan_chunk(
            toks,
            segment=seg,
            decode=decode,
            eos_ids=EOS,
            tool_stops=TOOL_STOPS,
            final_stops=FINAL_STOPS,
            room=room,
            context=ctx,
        )
        assert tuple(new) == old_scan(toks, seg, room, ctx)
        reasons.add(new.reason)
    assert reasons == {"eos", "tool", "stop", "length", "budget", None}


def test_stop_string_ending_inside_a_token_keeps_that_token():
    toks = [VOCAB.index(t) for t in ("x", "</", "co", "de>", "x")]
    cut = scan_chunk(
        toks, segment=[], decode=decode, eos_ids=EOS, tool_stops=TOOL_STOPS, room=99, context=99
    )
    assert cut == (4, "tool", len("x</code>"))
    # "</code>" ends inside ">\n": the whole token is kept, the text stops at the tag's end
    toks = [VOCAB.index(t) for t in ("</", "code", ">\n", "x")]
    assert scan_chunk(
        toks, segment=[], decode=decode, eos_ids=EOS, tool_stops=TOOL_STOPS, room=99, context=99
    ) == (3, "tool", len("</code>"))
