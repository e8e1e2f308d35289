"""Function calling end to end, without training: ToolRL's dynamic reward scale against a
transcription of the released code's formulas, prompts rendered through chat templates with the
records' tools, the generated task and its SFT traces, and the call metrics of `evaluate`."""

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl_tools.config import DataSection, SFTSection
from jaxrl_tools.datasets import call_metrics, generate
from jaxrl_tools.eval import evaluate
from jaxrl_tools.prompts import render_prompt
from jaxrl_tools.rewards import CompositeReward, TrajectoryInfo, get_reward
from jaxrl_tools.tasks import function_calling as fc
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.train.scoring import score_trajectories
from jaxrl_tools.types import Span, Trajectory


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    """The demo's Qwen2.5-style tokenizer (its chat template declares tools), built locally."""
    return build_tokenizer(tmp_path_factory.mktemp("fc") / "tok", vocab_size=300)


GT = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]


def _call(name, **args):
    return json.dumps({"name": name, "arguments": args})


def _answer(*lines, think=True):
    body = "\n".join(lines)
    return ("<think>ok</think>\n" if think else "") + f"<tool_call>\n{body}\n</tool_call>"


def _released_code_scales(step, horizon=150):
    """ToolRL's SCHEDULEREWARD, transcribed as its code writes it: format max 1 / min 0 and
    correctness max 3 / min -3 moved from 2 / -2 by step / 150, then clipped."""
    f_max = 2 - (2 - 1.0) * step / horizon
    f_min = -2 + (2 + 0.0) * step / horizon
    f_max, f_min = (1.0 if f_max < 1.0 else f_max), (-1.0 if f_min > -1.0 else f_min)
    c_max = (3.0 - 2) * step / horizon + 2
    c_min = (-3.0 + 2) * step / horizon - 2
    c_max, c_min = (3.0 if c_max > 3.0 else c_max), (-3.0 if c_min < -3.0 else c_min)
    return f_min, f_max, c_min, c_max


def test_toolrl_dynamic_scale_matches_the_released_formulas():
    toolrl = get_reward("toolrl")
    exact = _answer(_call("get_weather", city="Paris", unit="celsius"))
    # one value wrong: S = 1 (names) + 1 (keys) + 1 (values) of S_max = 1 + (1 + 2) = 4
    partial = _answer(_call("get_weather", city="Paris", unit="fahrenheit"))
    no_think = _answer(_call("get_weather", city="Paris", unit="celsius"), think=False)
    unreadable = "<think>ok</think>\n<tool_call>\n{oops\n</tool_call>"
    for step in (0, 1, 30, 75, 100, 149, 150, 400):
        f_min, f_max, c_min, c_max = _released_code_scales(step)
        info = TrajectoryInfo(step=step)
        got = [toolrl(r, GT, info, schedule="dynamic") for r in (exact, partial, no_think)]
        want = [f_max + c_max, f_max + (c_max - c_min) * 3 / 4 + c_min, f_min + c_max]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=f"step {step}")
        assert toolrl(unreadable, GT, info, schedule="dynamic") == pytest.approx(f_max + c_min)
    # the fixed scale is the paper's main one: [0, 1] + [-3, 3], whatever the step
    assert toolrl(partial, GT, TrajectoryInfo(step=99)) == pytest.approx(1 + 6 * 3 / 4 - 3)
    # a horizon of 20 steps reaches the final ranges at step 20
    assert toolrl(no_think, GT, TrajectoryInfo(step=20), schedule_steps=20, schedule="dynamic") == (
        pytest.approx(-1 + 3)
    )
    with pytest.raises(ValueError, match="schedule"):
        toolrl(exact, GT, info, schedule="linear")


def test_composite_reward_scores_at_the_trainers_step():
    reward = CompositeReward([("toolrl", 1.0, {"schedule": "dynamic"})])
    bad_format = _answer(_call("get_weather", city="Paris", unit="celsius"), think=False)
    traj = Trajectory(0, 0, [1], model_text=bad_format)
    # The training loop scores each step's batch at that step (collect_batch(step=...)).
    totals, parts = score_trajectories(reward, [{"ground_truth": GT}], [traj], 1, step=150)
    assert totals[0] == pytest.approx(-1 + 3) and parts["toolrl"][0] == totals[0]
    assert score_trajectories(reward, [{"ground_truth": GT}], [traj], 1)[0][0] == pytest.approx(
        -2 + 2
    )  # no step: scored as at step 0
    assert reward(bad_format, GT, TrajectoryInfo(step=150)) == pytest.approx(-1 + 3)
    assert reward(bad_format, GT, TrajectoryInfo(step=0)) == pytest.approx(-2 + 2)
    # function-calling rewards count exact calls as accuracy in evaluations
    assert reward.correctness == "tool_calls"
    assert CompositeReward([("tool_n1", 1.0, {})]).correctness == "tool_calls"


def test_toolrl_call_list_with_no_calls_wants_a_response():
    toolrl = get_reward("toolrl")
    assert toolrl("<think>a</think>\n<response>Hi!</response>", []) == 1.0  # format 1, correct 0
    assert toolrl(_answer(_call("set_timer", minutes=3)), []) == 0.0
    assert toolrl("<think>a</think>", []) == 0.0
    # a decoded response keeps its end-of-turn token; the format is read before it
    assert toolrl("<think>a</think>\n<response>Hi!</response><|im_end|>", []) == 1.0
    assert toolrl("<think>a</think>\n<response>Hi!</response><|eot_id|>", []) == 1.0


def test_prompts_render_the_records_tools_through_the_chat_template(qwen_tok):
    (record,) = generate(1, seed=3, num_tools=(3, 3))
    qwen = qwen_tok
    text = render_prompt(qwen, record)
    lines = [json.dumps(t, ensure_ascii=False) for t in record["tools"]]
    assert "<tools>\n" + "\n".join(lines) + "\n</tools>" in text  # Qwen2.5: one JSON per line
    assert text.endswith(f"{record['prompt'][-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
    # A Llama-3.1-style template (tools in the first user turn) gets the same declarations.
    llama = PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(),
        chat_template=(
            "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' and loop.index0 == 1 "
            "and tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following "
            "functions:\n{%- for t in tools %}\n{{ t | tojson(indent=4) }}{%- endfor %}\n\n"
            "{{ m.content }}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}"
            "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{%- endif %}"
        ),
        bos_token="<|begin_of_text|>",
    )
    text = render_prompt(llama, record)
    for tool in record["tools"]:
        assert json.dumps(tool, indent=4, ensure_ascii=False) in text
    assert text.index("Given the following") > text.index(record["prompt"][0]["content"])
    # A record naming tools by name takes them from the run's declarations.
    named = dict(record, tools=[t["function"]["name"] for t in record["tools"][:1]])
    assert render_prompt(qwen, named, record["tools"]).count('{"type": "function"') == 1


def _word_tokenizer():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_task_records_and_imperfect_sft_traces(qwen_tok):
    data = DataSection(
        task="function_calling", task_train_size=40, task_eval_size=10, task_difficulty=3
    )
    train, held_out = fc.task_records(data, "train"), fc.task_records(data, "eval")
    assert len(train) == 40 and len(held_out) == 10
    other_seed = DataSection(task="function_calling", task_train_size=40, shuffle_seed=1)
    assert train != fc.task_records(other_seed, "train")
    for rec in train + held_out:
        assert 2 <= len(rec["tools"]) <= 3 and len(rec["tools"]) > len(rec["ground_truth"])
        assert rec["difficulty"] == len(rec["ground_truth"])
    toolrl = get_reward("toolrl")
    for rec in train:  # a complete answer in ToolRL's format scores full marks (no call: 1 + 0)
        full = 4.0 if rec["ground_truth"] else 1.0
        assert toolrl(fc.toolrl_answer(rec["ground_truth"]), rec["ground_truth"]) == full
    # Imperfect traces: with tool_mix 0.4 about 60% of two-call requests keep only one call.
    rng = random.Random(0)
    two = [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"unit": "celsius"}}]
    kept = [len(fc.imperfect_calls(two, rng, 0.4)) for _ in range(2000)]
    assert 0.55 < kept.count(1) / 2000 < 0.65
    assert fc.imperfect_calls(two, rng, 1.0) == two
    # ... and about 60% of requests that need a call describe it in a <response> instead: the
    # values are copied as in a call, but nothing is called and ToolRL's correctness is lost.
    for rec in train:
        if rec["ground_truth"]:
            said = fc.described_answer(rec["ground_truth"])
            assert all(json.dumps(c["arguments"]) in said for c in rec["ground_truth"])
            assert "<tool_call>" not in said and "<response>" in said
            assert toolrl(said, rec["ground_truth"]) < 0
    traces = fc.task_sft_traces(data, SFTSection(num_traces=400, tool_mix=0.4), qwen_tok)
    for (prompt, p_train), (answer, a_train) in traces:
        assert not p_train and a_train and prompt.endswith("<|im_start|>assistant\n")
        assert answer.startswith("<think>") and answer.rstrip().endswith("<|im_end|>")
    needing = [a for (_, _), (a, _) in traces if a.startswith("<think>I need")]
    described = sum("<tool_call>" not in a for a in needing) / len(needing)
    assert len(needing) > 250 and 0.5 < described < 0.7, (len(needing), described)


def test_evaluate_reports_call_metrics_for_function_calling():
    records = [
        {"id": "w", "prompt": "weather?", "ground_truth": GT},
        {"id": "n", "prompt": "hi", "ground_truth": []},
        {
            "id": "t",
            "prompt": "timer",
            "ground_truth": [{"name": "set_timer", "arguments": {"minutes": 5}}],
        },
    ]
    answers = {
        "w": _answer(_call("get_weather", city="Paris", unit="celsius")),
        "n": "<think>no</think>\n<response>Hello</response>",
        "t": _answer(_call("set_timer", minutes=50)),
    }

    def sampler(recs, group_size, params, *, temperature=None, seed=None):
        return [
            Trajectory(i, 0, [1], [2], [1], [0.0], [Span("model", 0, 1)], [], 0, "eos",
                       response_text=answers[r["id"]], model_text=answers[r["id"]])
            for i, r in enumerate(recs)
        ]  # fmt: skip

    m = evaluate(sampler, None, records, CompositeReward([("toolrl", 1.0, {})]))
    predicted = [
        [json.loads(_call("get_weather", city="Paris", unit="celsius"))],
        [],
        [{"name": "set_timer", "arguments": {"minutes": 50}}],
    ]
    want = call_metrics(predicted, [r["ground_truth"] for r in records])
    for key, value in want.items():
        assert m[f"calls/{key}"] == pytest.approx(value), key
    # by hand: 2 of 3 exact; names all right; arguments 2/2, -, 0/2 -> (1 + 1 + 0) / 3
    assert m["calls/exact_call_accuracy"] == pytest.approx(2 / 3) == m["reward/accuracy"]
    assert m["calls/name_f1"] == 1.0 and m["calls/argument_f1"] == pytest.approx(2 / 3)
    assert m["calls/no_call_precision"] == 1.0 and m["calls/call_rate"] == pytest.approx(2 / 3)
