"""ARTIST's rewards (arXiv 2505.01441): answer, format and tool execution, summed by the recipe.

A rollout reads `<think>..</think>`, then any number of `<think>` blocks and tool rounds
`<tool>..</tool><output>..</output>` (the output inserted by the host; the paper's own tag names
the tool, `<python>..</python>`: `tool_tags`), and ends with `<answer>..</answer>`. The paper's
reward is R = R_answer + R_format + R_tool:

  artist_answer  1 if the last <answer> is right (math: equivalent by math-verify, a \\boxed{}
                 inside it is unwrapped; qa=True: normalised exact match), else 0
  artist_format  strict: 1 if the tags are well formed and in the order above, else 0;
                 strict=False (relaxed): the fraction of the required tags (think,
                 answer) present and closed
  tool_success   successful tool calls / tool calls (`outcome.tool_success_reward`)

Their scales are the weights of `reward:` in configs/artist.yaml.
"""

from __future__ import annotations

import re
from typing import Any

from jaxrl_tools.rewards.answers import (
    TRUTH_CHECKS,
    last_answer_tag,
    last_boxed,
    math_equal,
    qa_correct,
)
from jaxrl_tools.rewards.registry import TrajectoryInfo, register_reward

ARTIST_TAGS = ("think", "tool", "output", "answer")


def _tag_re(tool_tags: tuple[str, ...]) -> re.Pattern:
    names = ("think", "output", "answer", *tool_tags)
    return re.compile(r"<(/?)(" + "|".join(re.escape(n) for n in names) + r")>")


def artist_tag_sequence(text: str, tool_tags: tuple[str, ...] = ("tool",)) -> list[str] | None:
    """The ARTIST blocks of `text` in order (e.g. ["think", "tool", "output", "answer"]), or
    None when a tag is not closed, is closed without being opened, or is nested in another.

    tool_tags: the tags of tool calls, each reported as "tool": ("tool",) for the literal
    <tool>, the tool names for the paper's <tool_name> (`rollout.tool_tags: named`)."""
    blocks, open_tag = [], None
    for m in _tag_re(tuple(tool_tags)).finditer(text):
        closing, tag = m.group(1) == "/", m.group(2)
        tag = "tool" if tag in tool_tags else tag
        if not closing:
            if open_tag is not None:
                return None
            open_tag = tag
        else:
            if open_tag != tag:
                return None
            blocks.append(tag)
            open_tag = None
    return None if open_tag is not None else blocks


def artist_format_ok(text: str, tool_tags: tuple[str, ...] = ("tool",)) -> bool:
    """Strict format: think first, then think blocks or <tool><output> pairs, <answer> last
    (`tool_tags` as `artist_tag_sequence`'s)."""
    blocks = artist_tag_sequence(text, tool_tags)
    if not blocks or blocks[0] != "think" or blocks[-1] != "answer":
        return False
    i = 1
    while i < len(blocks) - 1:
        if blocks[i] == "think":
            i += 1
        elif blocks[i] == "tool" and blocks[i + 1] == "output":
            i += 2
        else:
            return False
    return i == len(blocks) - 1


@register_reward("artist_format")
def artist_format_reward(
    response: str,
    ground_truth: Any = None,
    info: TrajectoryInfo | None = None,
    *,
    strict: bool = True,
    tool_tags: list[str] | None = None,
) -> float:
    """ARTIST format reward: strict (1 iff `artist_format_ok`) or relaxed (strict=False: the
    fraction of <think> and <answer> present and closed, whatever the order). `tool_tags`: the
    tags of tool calls (None: the literal <tool>; with `rollout.tool_tags: named`, the tools'
    names, e.g. [python])."""
    if strict:
        return float(artist_format_ok(response, tuple(tool_tags or ("tool",))))
    present = [
        re.search(f"<{t}>.*?</{t}>", response, re.DOTALL) is not None for t in ("think", "answer")
    ]
    return sum(present) / len(present)


@register_reward(
    "artist_answer",
    slow=True,
    truth=lambda gt, kwargs: TRUTH_CHECKS["qa_em" if kwargs.get("qa") else "math"](gt),
)
def artist_answer_reward(
    response: str,
    ground_truth: Any,
    info: TrajectoryInfo | None = None,
    *,
    qa: bool = False,
) -> float:
    """ARTIST answer reward: 1 if the last <answer>...</answer> is right, else 0 (none: 0).

    Args:
      qa: False: math-verify equivalence (a \\boxed{} inside the tag is unwrapped); True:
        SQuAD-normalised exact match against any of the ground-truth strings.
    """
    if qa:
        return float(qa_correct(response, ground_truth))
    pred = last_answer_tag(response)
    if pred is None:
        return 0.0
    boxed = last_boxed(pred)
    pred = boxed if boxed is not None else pred
    return float(bool(pred.strip()) and math_equal(pred, ground_truth))
