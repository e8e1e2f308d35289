"""`eval.evaluate` with a sampler and a reward only: accuracy by the reward's own checker."""

import pytest

from jaxrl_tools.eval import evaluate
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.types import Span, ToolCallRecord, Trajectory


class ScriptedSampler:
    """Answers each record with the scripted responses, `group_size` per record."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, records, group_size, params, *, temperature=None, seed=None):
        self.calls.append((len(records), temperature, seed))
        out = []
        for i, rec in enumerate(records):
            for g in range(group_size):
                text = self.answers[rec["id"]][g]
                calls = [ToolCallRecord("search", {"query": "q"}, True, None, 0.0, True, 0)]
                out.append(
                    Trajectory(
                        i,
                        g,
                        [1],
                        [2, 3],
                        [1, 1],
                        [0.0, 0.0],
                        [Span("model", 0, 2)],
                        calls if "search" in text else [],
                        int("search" in text),
                        "eos",
                        response_text=text,
                        model_text=text,
                    )
                )
        return out


RECORDS = [
    {"id": "a", "prompt": "Capital of France?", "ground_truth": ["Paris"], "difficulty": 1},
    {"id": "b", "prompt": "Capital of Italy?", "ground_truth": ["Rome"], "difficulty": 2},
    {"id": "c", "prompt": "Capital of Peru?", "ground_truth": ["Lima"], "kind": "capital"},
]


@pytest.mark.parametrize(
    "terms", [[("qa_em", 1.0, {})], [("otc_grpo", 1.0, {"correctness": "qa_em"})]]
)
def test_evaluate_on_a_qa_reward(terms):
    sampler = ScriptedSampler(
        {
            "a": ["<search>q</search><answer> paris </answer>", "<answer>Lyon</answer>"],
            "b": ["<answer>Milan</answer>", "<answer>Turin</answer>"],
            "c": ["<search>q</search><answer>Lima</answer>", "<search>q</search>"],
        }
    )
    m = evaluate(
        sampler,
        None,
        RECORDS,
        CompositeReward(terms),
        group_size=2,
        batch_size=1,
        temperature=0.5,
        seed=7,
    )
    assert m["reward/accuracy"] == pytest.approx(2 / 6)  # SQuAD-normalised exact match
    assert m["reward/pass@2"] == pytest.approx(2 / 3)
    assert m["level/1/accuracy"] == 0.5 and m["level/2/accuracy"] == 0.0
    assert m["kind/capital/accuracy"] == 0.5 and m["kind/capital/tool"] == 1.0
    assert not any(k.startswith("kind/") and "capital" not in k for k in m)  # a and b name none
    assert m["tools/calls_per_response"] == pytest.approx(3 / 6)
    assert m["_per_problem"] == {
        "reward/accuracy": [0.5, 0.0, 0.5],
        "tools/used_frac": [0.5, 0.0, 1.0],
    }
    assert sampler.calls == [(1, 0.5, 7), (1, 0.5, 8), (1, 0.5, 9)]
    # The answers a report shows: each level's first sample (c has none: its own).
    assert [ex["prompt"] for ex in m["_examples"]] == [r["prompt"] for r in RECORDS]
    assert m["_examples"][2]["response"] == "<search>q</search><answer>Lima</answer>"
