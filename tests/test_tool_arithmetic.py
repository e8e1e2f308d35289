"""Tests for jaxrl_tools.tasks.tool_arithmetic: generated arithmetic problems and SFT traces."""

import dataclasses
import json

import pytest

from jaxrl_tools import rewards
from jaxrl_tools.config import RolloutSection
from jaxrl_tools.prompts import chat_continuation
from jaxrl_tools.rollout import Sampler
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tasks.tool_arithmetic import (
    TRACE_PROTOCOLS,
    make_problems,
    printed,
    problem_from_dict,
    sft_traces,
    trace_messages,
    write_jsonl,
)
from jaxrl_tools.tools import PythonTool, ToolExecutor


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=512)


def test_answers_exact():
    for level in range(4):
        for p in make_problems(50, seed=level, difficulty=level):
            a, op, b = p.expression.split()
            expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert p.answer == str(expected)
            assert p.expression in p.question
            assert p.difficulty == level


def test_difficulty_scales():
    easy = make_problems(20, 0, 0)
    hard = make_problems(20, 0, 3)
    assert all(p.is_easy for p in easy) and not any(p.is_easy for p in hard)
    assert max(len(p.answer) for p in easy) <= 2
    assert min(len(p.answer) for p in hard) >= 6
    mixed = make_problems(200, 0, (0, 1, 2, 3))
    assert {p.difficulty for p in mixed} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="difficulty"):
        make_problems(1, 0, 7)


def test_deterministic_by_seed():
    assert make_problems(30, 5, (1, 2)) == make_problems(30, 5, (1, 2))
    assert make_problems(30, 5, 2) != make_problems(30, 6, 2)
    ps = make_problems(30, 1, (0, 2))
    assert sft_traces(ps, mix=0.5, seed=3) == sft_traces(ps, mix=0.5, seed=3)


@pytest.mark.parametrize("protocol", TRACE_PROTOCOLS)
def test_traces_answer_matches_math_reward(tok, protocol):
    ps = make_problems(12, 0, (0, 2, 3))
    traces = sft_traces(ps, tok, mix=1.0, protocol=protocol)
    for p, t in zip(ps, traces):
        assert t["uses_tool"] == (not p.is_easy)
        final = t["messages"][-1]["content"]
        # the answer format is the one the math reward checks
        assert rewards.math_reward(final, p.answer) == 1.0
        assert rewards.last_boxed(final) == p.answer
        assert "".join(s for s, _ in t["segments"]) == t["text"]
        trainable = "".join(s for s, train in t["segments"] if train)
        if t["uses_tool"]:
            # the tool output is never a training target, the call is
            assert f"print({p.expression.replace(' ', '')})" in trainable
            assert p.answer not in trainable.split("boxed")[0]
        assert p.question not in trainable


def test_qwen_trace_structure(tok):
    p = make_problems(1, 0, 3)[0]
    msgs = trace_messages(p, True, "qwen")
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    call = msgs[1]["tool_calls"][0]["function"]
    assert call["name"] == "python" and call["arguments"]["code"].startswith("print(")
    assert msgs[2]["content"] == printed(p.answer)
    text = sft_traces([p], tok, mix=1.0, protocol="qwen")[0]["text"]
    assert '<tool_call>\n{"name": "python"' in text and "<tool_response>\n" + p.answer in text


def test_inline_protocols(tok):
    p = make_problems(1, 0, 2)[0]
    torl = trace_messages(p, True, "torl")[-1]["content"]
    assert "```python\nprint(" in torl and "```output" in torl
    retool = trace_messages(p, True, "retool")[-1]["content"]
    assert "<code>print(" in retool and "</code>" in retool and p.answer in retool
    direct = trace_messages(p, False, "torl")[-1]["content"]
    assert "```" not in direct and rewards.math_reward(direct, p.answer) == 1.0
    with pytest.raises(ValueError, match="protocol"):
        trace_messages(p, True, "nope")


def test_mix_fraction():
    ps = make_problems(400, 0, 2)
    frac = sum(t["uses_tool"] for t in sft_traces(ps, mix=0.25)) / len(ps)
    assert 0.15 < frac < 0.35
    assert not any(t["uses_tool"] for t in sft_traces(ps, mix=0.0))


def test_write_jsonl(tmp_path):
    ps = make_problems(5, 0, 1)
    path = write_jsonl(ps, tmp_path / "sub" / "p.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["ground_truth"] for r in rows] == [p.answer for p in ps]
    assert rows[0]["prompt"] == ps[0].question and rows[0]["tools"] == ["python"]
    write_jsonl(sft_traces(ps), tmp_path / "sft.jsonl")
    assert problem_from_dict(dataclasses.asdict(ps[0])) == ps[0]


@pytest.fixture(scope="module")
def python_tool():
    from jaxrl_tools.tools import PythonTool, SandboxConfig, SandboxPool

    pool = SandboxPool(1, SandboxConfig(timeout_s=5.0))
    yield PythonTool(pool=pool, tool_schema=None)
    pool.close()


@pytest.mark.parametrize("protocol", ["torl", "retool", "qwen"])
def test_traces_match_what_rollouts_do(tok, python_tool, protocol):
    """The model segments of a trace parse into the python call the rollout would execute, and
    the trace's observation is what the rollout inserts after running it in the sandbox."""
    import asyncio

    from jaxrl_tools.tools import get_parser

    parser = get_parser(protocol)
    p = make_problems(1, 2, 3)[0]
    t = sft_traces([p], tok, mix=1.0, protocol=protocol)[0]
    first_model = next(s for s, train in t["segments"] if train)
    segment = first_model[: first_model.index(parser.stop_strings[0]) + len(parser.stop_strings[0])]
    result = parser.parse(segment)
    assert result.error is None and len(result.calls) == 1
    code = result.calls[0].arguments["code"].strip()
    assert code == f"print({p.expression.replace(' ', '')})"
    out = asyncio.run(python_tool.call({"code": code}))
    assert out.ok and out.text == printed(p.answer)
    if protocol == "qwen":
        assert t["messages"][2]["content"] == out.text
        # the rollout appends the chat template's own tool turn: the trace holds the same text
        after = t["text"][t["text"].index(segment) + len(segment) :]
        assert after.startswith(chat_continuation(tok, "tool", [out.text]))
    else:
        obs = next(s for s, train in t["segments"][1:] if not train)
        assert obs == parser.format_observation([out.text])


def test_sft_and_rl_prompts_declare_byte_identical_tools(tok):
    """Function calling: the SFT trace's prompt (system turn with the tool declarations) is the
    very text the RL sampler renders for the same problem."""
    p = make_problems(1, 0, 1)[0]
    trace = sft_traces([p], tok, mix=1.0, protocol="qwen", system_prompt="Be brief.")[0]
    executor = ToolExecutor([PythonTool()])  # built, not started: no worker pool
    sampler = Sampler(
        None, tok, executor, RolloutSection(protocol="qwen"), system_prompt="Be brief."
    )
    rl_prompt = tok.decode(sampler.encode_prompt(p.to_record()), skip_special_tokens=False)
    sft_prompt = trace["segments"][0][0]
    assert not trace["segments"][0][1] and "<tools>" in sft_prompt
    assert sft_prompt == rl_prompt
