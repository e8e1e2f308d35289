"""ARTIST's protocol and rewards (checked against a hand transcription of the formulas), and the
ARTIST / ToRL / ZeroTIR recipes' settings."""

import re
from pathlib import Path

import pytest

from jaxrl_tools import rewards as R
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.rewards import CompositeReward, TrajectoryInfo
from jaxrl_tools.tools import get_parser

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


# ------------------------------------------------------------------------------ protocol


def test_artist_parser_code_call_and_observation():
    p = get_parser("artist")
    assert p.stop_strings == ("</tool>",)
    r = p.parse("<think>square it</think>\n<tool>\n```python\nprint(12**2)\n```\n</tool>")
    assert r.ok and [(c.name, c.arguments) for c in r.calls] == [
        ("python", {"code": "print(12**2)"})
    ]
    assert p.format_observation(["144"]) == "\n<output>\n144\n</output>\n"
    assert p.parse("<think>no tool</think><answer>4</answer>").calls == []


def test_artist_parser_function_call_and_errors():
    p = get_parser("artist")
    r = p.parse('<tool>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool>')
    assert [(c.name, c.arguments) for c in r.calls] == [("get_weather", {"city": "Paris"})]
    # A JSON object without "name" is Python code (a dict literal), not a function call.
    assert p.parse('<tool>{"a": 1}</tool>').calls[0].name == "python"
    bad = p.parse('<tool>{"name": "f", "arguments": [1]}</tool>')
    assert "'arguments' of <tool> must be a JSON object, got list" in bad.error
    assert "unterminated <tool>" in p.parse("<tool>print(1)").error
    assert "2 <tool> blocks" in p.parse("<tool>a</tool><tool>b</tool>").error
    assert "empty <tool>" in p.parse("<tool> </tool>").error


def test_artist_parser_named_tags_as_the_paper():
    """The paper's <tool_name>: the tag is the tool's name; the code tool's body is code, any
    other tool's body its JSON arguments; generation stops at each tool's closing tag."""
    p = get_parser("artist", tool_tags="named", tools=("python", "get_weather"))
    assert p.stop_strings == ("</python>", "</get_weather>")
    r = p.parse("<think>square it</think>\n<python>\n```python\nprint(12**2)\n```\n</python>")
    assert r.ok and [(c.name, c.arguments) for c in r.calls] == [
        ("python", {"code": "print(12**2)"})
    ]
    assert r.calls[0].raw.startswith("<python>") and r.calls[0].raw.endswith("</python>")
    r = p.parse('<think>weather</think><get_weather>{"city": "Lima"}</get_weather>')
    assert [(c.name, c.arguments) for c in r.calls] == [("get_weather", {"city": "Lima"})]
    assert p.format_observation(["144"]) == "\n<output>\n144\n</output>\n"
    # the literal <tool> is no call in this form; <answer> alone is an answer
    assert p.parse("<tool>print(1)</tool>").calls == []
    assert p.parse("<think>a</think><answer>4</answer>").calls == []
    assert (
        "JSON object of its arguments, got list" in p.parse("<get_weather>[1]</get_weather>").error
    )
    assert "must be its JSON arguments" in p.parse("<get_weather>city=Lima</get_weather>").error
    assert (
        "2 tool calls in one turn"
        in p.parse("<python>a</python><get_weather>{}</get_weather>").error
    )
    assert "unterminated <python>" in p.parse("<python>print(1)").error
    assert "empty <python>" in p.parse("<python> </python>").error
    with pytest.raises(ValueError, match="cannot all be ARTIST tags"):
        get_parser("artist", tool_tags="named", tools=("answer",))


def test_artist_recipe_uses_the_papers_python_tag():
    cfg = load_config(CONFIGS / "artist.yaml")
    assert cfg.rollout.protocol == "artist" and cfg.rollout.tool_tags == "named"
    assert "<python>" in cfg.data.system_prompt and "<tool>" not in cfg.data.system_prompt
    from jaxrl_tools.rollout.sampler import rollout_parser

    p = rollout_parser(cfg.rollout, ("python",))
    assert p.stop_strings == ("</python>",)
    assert p.parse("<python>print(2)</python>").calls[0].arguments == {"code": "print(2)"}
    fmt = [r for r in cfg.reward if r.name == "artist_format"][0]
    assert fmt.kwargs["tool_tags"] == ["python"]
    text = "<think>a</think><python>x</python><output>7</output><answer>7</answer>"
    assert R.artist_format_reward(text, tool_tags=["python"]) == 1.0
    assert R.artist_format_reward(text) == 0.0  # the literal form does not read <python>
    with pytest.raises(Exception, match="tool_tags"):
        load_config(CONFIGS / "torl.yaml", ["rollout.tool_tags=named"])


# ------------------------------------------------------------------------------- rewards


def _strict_by_hand(text: str, tool: str = "tool") -> float:
    """The strict format rule transcribed: the tags come in consecutive open/close pairs, and
    the blocks read think (think | tool output)* answer (`tool`: the tool call's tag)."""
    tags = re.findall(rf"</?(?:think|{tool}|output|answer)>", text)
    tags = [t.replace(tool, "tool") for t in tags]
    opens, closes = tags[0::2], tags[1::2]
    if len(opens) != len(closes) or any(c != o.replace("<", "</") for o, c in zip(opens, closes)):
        return 0.0
    blocks = " ".join(o[1:-1] for o in opens)
    return float(re.fullmatch(r"think( think| tool output)* answer", blocks) is not None)


TRANSCRIPTS = [
    # (response, tool-call ok flags, answer right?)
    ("<think>a</think><tool>x</tool><output>7</output><answer>7</answer><|im_end|>", [1], 1),
    ("<think>a</think><answer>\\boxed{\\frac{14}{2}}</answer>", [], 1),
    (
        "<think>a</think><tool>x</tool><output>E</output><think>b</think><tool>y</tool>"
        "<output>7</output><answer>7</answer>",
        [0, 1],
        1,
    ),
    ("<answer>7</answer><think>late</think>", [], 1),  # right answer, wrong order
    ("<think>a</think><tool>x</tool><answer>7</answer>", [1], 1),  # no <output> after <tool>
    ("<think>a<answer>7</answer></think>", [], 1),  # nested
    ("<think>a</think><tool>x</tool><output>1</output><answer>8</answer>", [0], 0),
    ("7", [], 0),  # no <answer>: not right even though the text is the answer
]


@pytest.mark.parametrize("text,oks,right", TRANSCRIPTS)
def test_artist_composite_matches_hand_transcription(text, oks, right):
    text = text.replace("tool>", "python>")  # the recipe's tag: the paper's <tool_name>
    info = TrajectoryInfo(tool_calls=[{"ok": bool(o)} for o in oks])
    reward = CompositeReward(load_config(CONFIGS / "artist.yaml").reward)
    answer = 1.0 if right else 0.0
    tool = sum(oks) / len(oks) if oks else 0.0
    assert reward.components(text, "7", info) == {
        "artist_answer": answer,
        "artist_format": _strict_by_hand(text, "python"),
        "tool_success": tool,
    }
    assert reward(text, "7", info) == pytest.approx(
        2.0 * answer + 0.5 * _strict_by_hand(text, "python") + 1.0 * tool
    )


def test_artist_format_values_and_relaxed():
    assert [_strict_by_hand(t) for t, _, _ in TRANSCRIPTS] == [1, 1, 1, 0, 0, 0, 1, 0]
    relaxed = [R.artist_format_reward(t, None, None, strict=False) for t, _, _ in TRANSCRIPTS]
    assert relaxed == [1, 1, 1, 1, 1, 1, 1, 0]  # relaxed: present and closed, order aside
    assert R.artist_answer_reward("<answer> Paris </answer>", ["paris"], qa=True) == 1.0
    assert R.artist_answer_reward("<answer></answer>", "0") == 0.0


# ------------------------------------------------------------------------------- recipes


def test_recipes_carry_the_published_settings():
    torl = load_config(CONFIGS / "torl.yaml")
    assert torl.model.path.endswith("Qwen2.5-Math-1.5B") and not torl.sft.enabled
    assert (torl.rollout.protocol, torl.rollout.max_tool_calls) == ("torl", 1)
    assert (torl.data.batch_size, torl.rollout.group_size) == (128, 16)
    assert (torl.optim.lr, torl.algorithm.kl_coef, torl.rollout.max_response_len) == (
        1e-6,
        0.0,
        3072,
    )
    assert [(r.name, r.kwargs) for r in torl.reward] == [("math", {"correct": 1.0, "wrong": -1.0})]
    assert R.math_reward("\\boxed{3}", "3") == 1.0 and R.math_reward("\\boxed{4}", "3") == -1.0
    failed = TrajectoryInfo(tool_calls=[{"ok": False}])
    assert R.exec_penalty_reward("", None, failed) == -0.5  # ToRL's optional penalty

    zt = load_config(CONFIGS / "zerotir.yaml")
    f = zt.algorithm.filters
    assert not zt.sft.enabled and zt.model.path.endswith("Qwen2.5-7B")
    assert zt.rollout.protocol == "zerotir"  # code runs at the block's closing fence
    assert (f.zerotir, f.zerotir_low, f.zerotir_high) == (True, 0.2, 0.8)
    assert zt.algorithm.adv_estimator == "reinforce_pp_baseline" and zt.rollout.group_size == 16

    artist = load_config(CONFIGS / "artist.yaml")
    assert artist.rollout.protocol == "artist" and artist.tools[0].cls == "python"
