"""The real-model task (jaxrl_tools.tasks.when_to_call): records, held-out facts, SFT traces in
the zerotir protocol, and the `boxed` answer check."""

import pytest

from jaxrl_tools.config import SFTSection
from jaxrl_tools.rewards import is_correct
from jaxrl_tools.rollout.stops import first_stop
from jaxrl_tools.tasks import when_to_call
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tools import get_parser


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=512)


def test_records_mix_both_kinds_with_exact_answers():
    recs = when_to_call.make_records(480, seed=10_000, split="eval")
    assert recs == when_to_call.make_records(480, seed=10_000, split="eval")  # deterministic
    levels = [r["difficulty"] for r in recs]
    assert levels.count(0) == 240 and levels.count(1) + levels.count(2) == 240
    for r in recs:
        if r["difficulty"]:
            a, op, b, op2, c = r["expression"].split()
            assert (op, op2) in (("*", "+"), ("*", "-"))
            value = int(a) * int(b) + (int(c) if op2 == "+" else -int(c))
            assert r["ground_truth"] == str(value) and len(r["ground_truth"]) >= 4
        else:
            assert r["expression"] == "" and r["ground_truth"]


def test_held_out_facts_never_reach_training():
    facts = {f.question for f in when_to_call._facts()}
    train = {r["prompt"] for r in when_to_call.make_records(4000, 0, "train")} & set(facts)
    held = {r["prompt"] for r in when_to_call.make_records(480, 10_000, "eval")} & set(facts)
    assert train and held and not train & held


@pytest.mark.parametrize("use_tool", [True, False])
def test_traces_are_what_rollouts_write_and_insert(tok, use_tool):
    """A tool trace's model text stops where zerotir decoding stops, parses into the call of
    the record's expression, and its untrained part is the observation the host inserts."""
    rec = next(r for r in when_to_call.make_records(50, 3, "train") if r["difficulty"] == 1)
    sft = SFTSection(tool_mix=float(use_tool), easy_tool_mix=0.0)
    segs = when_to_call.sft_traces(
        [rec], tok, sft, protocol="zerotir", system_prompt="Be brief.", seed=0
    )[0]
    text = "".join(t for t, _ in segs)
    assert text == tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": rec["prompt"]},
            {"role": "assistant", "content": "".join(t for t, _ in segs[1:-1])},
        ],
        tokenize=False,
    )
    model = [t for t, train in segs if train]
    assert is_correct("".join(model), rec["ground_truth"], "boxed")
    if not use_tool:
        assert [train for _, train in segs] == [False, True, True]
        return
    parser = get_parser("zerotir")
    assert first_stop(model[0], parser.stop_strings)[0] == len(model[0])  # stops at its end
    call = parser.parse(model[0]).calls[0]
    assert call.arguments["code"].strip() == f"print({rec['expression']})"
    assert segs[2] == [parser.format_observation([rec["ground_truth"] + "\n"]), False]


def test_tool_mix_applies_per_kind(tok):
    recs = when_to_call.make_records(400, 1, "train")
    sft = SFTSection(tool_mix=1.0, easy_tool_mix=0.0)
    traces = when_to_call.sft_traces(recs, tok, sft, protocol="zerotir", system_prompt=None, seed=0)
    for r, segs in zip(recs, traces):
        assert ("```python" in segs[1][0]) == (r["difficulty"] > 0)


def test_direct_traces_write_out_the_step_before_the_answer(tok):
    """A direct trace shows its step before the answer, as the model writes it unprompted: the
    fact's sentence, the number read back, the calculation (bare answers taught it to skip the
    step and get it wrong); and arithmetic opens with a word no level-0 trace opens with (one shared
    opening let RL's push away from direct arithmetic carry the facts onto the tool)."""
    recs = when_to_call.make_records(400, 2, "train")
    sft = SFTSection(tool_mix=0.0, easy_tool_mix=0.0)
    traces = when_to_call.sft_traces(recs, tok, sft, protocol="zerotir", system_prompt=None, seed=0)
    facts = {f.question: f.work for f in when_to_call._facts()}
    openings = {0: set(), 1: set()}
    for r, segs in zip(recs, traces):
        answer, work = segs[1][0], r["work"]
        assert answer == f"{work} The answer is \\boxed{{{r['ground_truth']}}}."
        openings[min(r["difficulty"], 1)].add(work.split()[0])
        if r["prompt"] in facts:
            assert work == facts[r["prompt"]] and r["ground_truth"] in work
            continue
        step = work.removeprefix("To calculate: ").rstrip(".")
        if r["kind"] == "reading":  # "Max has 35 cookies.", read back from the question
            assert step in r["prompt"] and step.split()[2] == r["ground_truth"]
            continue
        if " > " in step:  # "13 > 7."
            larger, smaller = step.split(" > ")
            assert int(larger) > int(smaller) and larger == r["ground_truth"]
            continue
        lhs, rhs = step.split(" = ")
        assert eval(lhs) == int(rhs) == int(r["ground_truth"])  # noqa: S307 -- our own digits
    assert openings[1] == {"To"} and "To" not in openings[0] and len(openings[0]) > 3
    kinds = {r["kind"] for r in recs}  # evaluations report each kind
    assert {"capital", "reading", "larger", "multiply-add", "word problem"} <= kinds


def test_boxed_check_numbers_and_words():
    assert is_correct("so \\boxed{1,234}", "1234", "boxed")
    assert is_correct("The answer is \\boxed{the Paris.}", "Paris", "boxed")
    assert not is_correct("The answer is \\boxed{Lyon}", "Paris", "boxed")
    assert not is_correct("Paris", "Paris", "boxed")  # no box, no answer
    assert not is_correct("\\boxed{1233}", "1234", "boxed")


def test_training_batches_report_reward_and_tool_use_per_level(tmp_path):
    """Each step's rollout statistics split by level (the curves of a head question's tool use
    and of arithmetic's apart), and the end-of-run plot draws them, one line per level."""
    import numpy as np

    from jaxrl_tools.train.metrics import MetricsLogger
    from jaxrl_tools.train.scoring import rollout_metrics
    from jaxrl_tools.types import Trajectory

    recs = [{"difficulty": 0}, {"difficulty": 2}, {"prompt": "no level"}]
    calls = [0, 1, 1, 1, 0, 0]  # two samples per record
    trajs = [Trajectory(0, 0, [1], num_tool_calls=n) for n in calls]
    scores = np.array([1.0, 0.5, 1.0, 0.0, 0.0, 1.0])
    m = rollout_metrics(trajs, scores, {}, group_size=2, records=recs)
    assert m["level/0/tool"] == 0.5 and m["level/0/reward"] == 0.75
    assert m["level/2/tool"] == 1.0 and m["level/2/reward"] == 0.5
    assert not any(k.startswith("level/") and k.split("/")[1] not in "02" for k in m)
    logger = MetricsLogger(tmp_path, progress=False)
    for step in (1, 2):
        logger.log(step, m)
    assert logger.plot().stat().st_size > 1000
