"""The real-model task (`data.task: when_to_call`): questions a small chat model answers in its
head (level 0: facts and one-step reasoning) mixed with arithmetic it cannot do without Python
(levels 1-2: multi-digit, multi-step). A policy that learns *when* to call the tool answers the
first kind directly and runs code for the second.

    records = task_records(cfg.data, "train")          # prompts, "difficulty" 0, 1 or 2
    traces = sft_traces(records, tokenizer, cfg.sft, protocol="zerotir", ...)

Answers are checked by the `boxed` checker (numbers numerically, words by normalised match), so
each record's ground truth is a plain string. Facts are split between train and eval by a hash
of the question, so the held-out facts were never seen in SFT or RL.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, NamedTuple

from jaxrl_tools.config import DataSection, SFTSection
from jaxrl_tools.tools import get_parser

PROTOCOLS = ("zerotir", "torl")  # inline ```python protocols the traces are written in
EVAL_SEED = 10_000

_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = (
    "January February March April May June July August September October November December"
).split()
# fmt: off
_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "England": "London",
    "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Peru": "Lima", "Argentina": "Buenos Aires", "Kenya": "Nairobi", "Thailand": "Bangkok",
    "South Korea": "Seoul", "India": "New Delhi", "Cuba": "Havana", "Belgium": "Brussels",
    "Hungary": "Budapest", "Turkey": "Ankara", "Iran": "Tehran", "Chile": "Santiago",
}
_LEGS = {"dog": 4, "cat": 4, "horse": 4, "cow": 4, "spider": 8, "bird": 2, "chicken": 2,
         "duck": 2, "ant": 6, "bee": 6, "snake": 0, "fish": 0, "octopus": 8, "human": 2}
_OPPOSITES = {"hot": "cold", "big": "small", "up": "down", "day": "night", "fast": "slow",
              "happy": "sad", "open": "closed", "light": "dark", "old": "young", "wet": "dry",
              "full": "empty", "hard": "soft", "early": "late", "left": "right", "in": "out",
              "yes": "no", "high": "low", "win": "lose", "long": "short", "black": "white"}
# fmt: on
_NAMES = ("Tom", "Anna", "Sam", "Lily", "Max", "Mia", "Ben", "Zoe")
_THINGS = ("apples", "books", "coins", "pens", "cards", "balls", "cookies", "stickers")


class Question(NamedTuple):
    """A level-0 question: its answer, the fact's sentence or the reasoning step as the model
    writes it unprompted ("The capital of Norway is Oslo.", "Max has 35 cookies."), and its
    kind."""

    question: str
    answer: str
    work: str
    kind: str


def _facts() -> list[Question]:
    """Every fact question (a fixed list, split train/eval by hash)."""
    out = [
        Question(f"What is the capital of {c}?", a, f"The capital of {c} is {a}.", "capital")
        for c, a in _CAPITALS.items()
    ]
    out += [
        Question(f"How many legs does a {x} have?", str(n), f"A {x} has {n} legs.", "legs")
        for x, n in _LEGS.items()
    ]
    out += [
        Question(f"What is the opposite of {w}?", a, f"The opposite of {w} is {a}.", "opposite")
        for w, a in _OPPOSITES.items()
    ]
    for seq, kind in ((_DAYS, "day"), (_MONTHS, "month")):
        for way, step in (("after", 1), ("before", -1)):
            for i, x in enumerate(seq):
                y = seq[(i + step) % len(seq)]
                out.append(
                    Question(
                        f"What {kind} comes {way} {x}?", y, f"The {kind} {way} {x} is {y}.", kind
                    )
                )
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out += [
        Question(
            f"What letter comes after {a} in the alphabet?",
            b,
            f"The letter after {a} is {b}.",
            "letter",
        )
        for a, b in zip(letters, letters[1:])
    ]
    return out


def _in_eval(question: str) -> bool:
    """A stable quarter of the facts is held out (never in SFT or RL prompts)."""
    return hashlib.sha256(question.encode()).digest()[0] < 64


def _head_question(rng: random.Random, facts: list[Question]) -> Question:
    """A level-0 question: a fact, a number read back from a story, or one step of reasoning on
    small numbers. No sums: this model adds one-digit numbers in a story right about half the
    time (48-57% after the cold start), so a call is worth making there."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(facts)
    if kind == 1:  # the word problems' surface with no arithmetic: it reads one number back
        (w1, w2), (x1, x2) = rng.sample(_NAMES, 2), rng.sample(_THINGS, 2)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        who, what, n = (w1, x1, a) if rng.random() < 0.5 else (w2, x2, b)
        q = f"{w1} has {a} {x1} and {w2} has {b} {x2}. How many {what} does {who} have?"
        return Question(q, str(n), f"{who} has {n} {what}.", "reading")
    if kind == 2:
        n = rng.randint(2, 98)
        m, op = (n + 1, "+") if rng.random() < 0.5 else (n - 1, "-")
        q = f"What number comes {'after' if op == '+' else 'before'} {n}?"
        return Question(q, str(m), f"{n} {op} 1 = {m}.", "next number")
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    q = f"Which number is larger, {a} or {a + b}?"
    return Question(q, str(a + b), f"{a + b} > {a}.", "larger")


def _tool_question(rng: random.Random, level: int) -> tuple[str, str, str]:
    """(question, Python expression, answer) of a level-1 or level-2 arithmetic problem."""
    if level == 1:  # 3-digit x 2-digit, then plus a 3-digit number
        a, b, c = rng.randint(100, 999), rng.randint(12, 99), rng.randint(100, 999)
        expr = f"{a} * {b} + {c}"
        q = rng.choice(("What is {e}?", "Compute {e}.", "Calculate {e}."))
        return q.format(e=expr), expr, str(a * b + c)
    # two steps in words: a product, then a difference
    a, b, c = rng.randint(1000, 9999), rng.randint(100, 999), rng.randint(1000, 99999)
    who, what = rng.choice(_NAMES), rng.choice(_THINGS)
    q = (
        f"{who} packs {a} boxes with {b} {what} each, then gives away {c} {what}. "
        f"How many {what} are left?"
    )
    return q, f"{a} * {b} - {c}", str(a * b - c)


def make_records(n: int, seed: int, split: str) -> list[dict]:
    """`n` prompt records, half of them arithmetic (levels 1 and 2 alike), the rest level-0
    questions; facts from the `split`'s side of the hash split. The held-out set alternates the
    two kinds (exactly n/2 of each); training draws each record's kind."""
    facts = [f for f in _facts() if _in_eval(f.question) == (split == "eval")]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if (i % 2 == 1) if split == "eval" else (rng.random() < 0.5):
            level = rng.choice((1, 2))
            q, expr, ans = _tool_question(rng, level)
            work = f"To calculate: {expr} = {ans}."
            kind = ("multiply-add", "word problem")[level - 1]
        else:
            q, ans, work, kind = _head_question(rng, facts)
            level, expr = 0, ""
        out.append(
            {
                "id": f"when-{split}-{seed}-{i}",
                "prompt": q,
                "ground_truth": ans,
                "difficulty": level,
                "expression": expr,
                "work": work,  # the step a direct trace writes before its answer
                "kind": kind,  # evaluations report accuracy and tool use per kind
            }
        )
    return out


def task_records(data: DataSection, split: str) -> list[dict]:
    """The task's prompt records: "train" (drawn by `data.shuffle_seed`), or the held-out "eval"
    set: held-out facts, and the same problems for every seed (so the base model's score is
    measured once)."""
    if split == "train":
        return make_records(data.task_train_size, data.shuffle_seed, "train")
    return make_records(data.task_eval_size, EVAL_SEED, "eval")


def tokenizer_texts(data: DataSection) -> list[str]:
    """A tiny model's tokenizer corpus (smoke runs; the real model has its own): the system
    prompt and questions of both kinds."""
    recs = make_records(1000, data.shuffle_seed, "train")
    return [data.system_prompt or ""] * 20 + [r["prompt"] for r in recs]


def _final(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def trace_parts(record: dict, use_tool: bool, protocol: str) -> list[tuple[str, bool]]:
    """The response of one trace as (text, trainable) parts: the answer after the step the
    model writes unprompted (bare answers taught it to skip the step and get it wrong; and with one
    opening for facts and arithmetic, RL's push away from direct
    arithmetic carried facts onto the tool), or a ```python block, the output block the host
    inserts (not trained) and the answer."""
    ans = record["ground_truth"]
    if not use_tool:
        work = record.get("work", "")
        return [((f"{work} " if work else "") + _final(ans), True)]
    code = f"```python\nprint({record['expression'] or repr(ans)})\n```"
    if protocol == "torl":
        code += "\n```output"
    obs = get_parser(protocol).format_observation([f"{ans}\n"])
    return [(code, True), (obs, False), (_final(ans), True)]


def sft_traces(
    records: list[dict],
    tokenizer,
    sft: SFTSection,
    *,
    protocol: str,
    system_prompt: str | None,
    seed: int,
) -> list[list[list[Any]]]:
    """SFT traces as segment lists ([[text, trainable], ...]): arithmetic with the tool with
    probability `sft.tool_mix`, level-0 questions with it with probability `sft.easy_tool_mix`,
    the rest answered directly (so the choice of the first token is what RL refines)."""
    rng = random.Random(seed)
    out = []
    for rec in records:
        p = sft.easy_tool_mix if rec["difficulty"] == 0 else sft.tool_mix
        parts = trace_parts(rec, rng.random() < p, protocol)
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": rec["prompt"]}
        ]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        body = "".join(t for t, _ in parts)
        full = tokenizer.apply_chat_template(
            msgs + [{"role": "assistant", "content": body}], tokenize=False
        )
        if not full.startswith(prompt + body):
            raise ValueError(
                "the chat template does not render an assistant turn after the generation "
                "prompt: when_to_call traces need a ChatML-like template"
            )
        segs = [[prompt, False]] + [[t, train] for t, train in parts]
        segs.append([full[len(prompt + body) :], True])  # the end of turn is trained
        out.append(segs)
    return out
