"""Recipes' mechanisms on scripted model text (`eval --scripted`): budgets as the papers wrote
them, several calls per Qwen turn, and the dry run's command. Text level: no model, no JAX
compile; tools are stand-ins (no sandbox)."""

import asyncio
import json
import time

import pytest

from jaxrl_tools import cli, configs
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.rollout.resolver import BUDGET_NOTICE, INVALID_NOTICE
from jaxrl_tools.rollout.scripted import ScriptedRun, scripted_rows, text_tokenizer
from jaxrl_tools.tools import function_tool


@pytest.fixture(scope="module")
def tok():
    return text_tokenizer()


@function_tool
def python(code: str) -> str:
    """Runs code (a stand-in: prints the code's length)."""
    return f"ran {len(code)} chars"


@function_tool
def search(query: str) -> str:
    """Searches (a stand-in)."""
    return f"passages about {query}"


@function_tool(name="search")
async def slow_search(query: str) -> str:
    """Searches (a stand-in that takes 0.3 s)."""
    await asyncio.sleep(0.3)
    return f"passages about {query}"


def rows(name, lines, tok, overrides=(), tools=(python,)):
    """`tools` None: the recipe's own."""
    cfg = load_config(configs.path(name), list(overrides))
    return scripted_rows(cfg, lines, tools=None if tools is None else list(tools), tokenizer=tok)


def block(i):
    return f"```python\nprint({i})\n```"


def test_torl_a_second_block_is_ignored_and_the_model_writes_on(tok):
    """ToRL (C = 1, over_budget ignore, max_turns 2): the second block runs nothing and the
    model's own text follows its ```output, up to its answer (not the turn limit)."""
    turns = [
        f"Let me compute.\n{block(1)}\n```output",
        f"\nAgain:\n{block(2)}\n```output",
        "\n2\n```\nSo the answer is \\boxed{2}.",
    ]
    (r,) = rows("torl", [{"prompt": "1+1?", "ground_truth": "2", "turns": turns}], tok)
    assert r["finish_reason"] == "eos" and r["num_tool_calls"] == 1
    assert [(c["name"], c["ok"], c["error"]) for c in r["tool_calls"]] == [
        ("python", True, None),
        ("python", False, "budget"),
    ]
    assert r["response_text"].count("ran ") == 1
    assert "```output\n2\n```\nSo the answer" in r["response_text"]  # written on, not answered
    assert r["reward"] == 1.0


def test_search_r1_runs_its_four_searches_and_then_notices(tok):
    """Search-R1 (B = 4, max_turns 4): four searches run; a fifth gets the notice (not the
    turn limit), and the answer after it is scored."""
    turns = [f"<search>q{i}</search>" for i in range(5)] + ["<answer>Paris</answer>"]
    line = {"prompt": "Capital of France?", "ground_truth": ["Paris"], "turns": turns}
    (r,) = rows("search_r1", [line], tok, tools=[search])
    assert r["num_tool_calls"] == 4 and r["finish_reason"] == "eos"
    assert [c["ok"] for c in r["tool_calls"]] == [True] * 4 + [False]
    assert r["response_text"].count(BUDGET_NOTICE) == 1 and r["reward"] == 1.0
    # past the budget's one notice, the turn limit ends a response that keeps calling
    turns = [f"<search>q{i}</search>" for i in range(7)]
    (r,) = rows("search_r1", [{**line, "turns": turns}], tok, tools=[search])
    assert r["finish_reason"] == "turns" and r["num_tool_calls"] == 4


def test_search_r1_answers_a_turn_with_neither_tag_with_its_invalid_action_notice(tok):
    """Search-R1's loop: a turn with neither <search> nor <answer> gets its notice (the EOS
    that ended it dropped, the notice masked out and unseen by the reward) and counts as a
    turn; the turn limit ends a response that never acts."""
    turns = ["I think it is Paris.", "<search>capital of France</search>", "<answer>Paris</answer>"]
    line = {"prompt": "Capital of France?", "ground_truth": ["Paris"], "turns": turns}
    (r,) = rows("search_r1", [line], tok, tools=[search])
    assert r["finish_reason"] == "eos" and r["num_tool_calls"] == 1 and r["invalid_actions"] == 1
    assert r["response_text"].startswith(f"I think it is Paris.{INVALID_NOTICE}<search>")
    assert INVALID_NOTICE not in r["model_text"] and r["reward"] == 1.0
    # each invalid turn is one of the 4 turns: the fifth ends the response
    (r,) = rows("search_r1", [{**line, "turns": ["Hmm."] * 6}], tok, tools=[search])
    assert r["finish_reason"] == "turns" and r["invalid_actions"] == 5
    assert r["response_text"].count(INVALID_NOTICE) == 4 and r["reward"] == 0.0
    # "end" (the default elsewhere): the turn ends the response
    (r,) = rows("search_r1", [line], tok, ["rollout.invalid_action=end"], tools=[search])
    assert r["finish_reason"] == "eos" and r["invalid_actions"] == 0 and r["reward"] == 0.0


def test_search_r1_notices_a_turn_cut_at_its_token_cap(tok):
    """A turn cut at max_turn_tokens without a tag is invalid too (Search-R1 reads the 500
    tokens it generated); one cut after its answer ends the response."""
    over = ["rollout.max_turn_tokens=40"]
    turns = ["x" * 60, "<search>capital", "<answer>Paris</answer>"]
    line = {"prompt": "Capital?", "ground_truth": ["Paris"], "turns": turns}
    (r,) = rows("search_r1", [line], tok, over, tools=[search])
    # an unclosed <search> is no action either (Search-R1's regex needs both tags)
    assert r["invalid_actions"] == 2 and r["finish_reason"] == "eos" and r["reward"] == 1.0
    line["turns"] = ["<answer>Paris</answer>" + "x" * 40]
    (r,) = rows("search_r1", [line], tok, over, tools=[search])
    assert r["finish_reason"] == "turn_length" and r["invalid_actions"] == 0
    assert r["reward"] == 1.0


def test_invalid_action_notice_needs_an_answer_tag():
    with pytest.raises(ConfigError, match="rollout.invalid_action"):
        load_config(configs.path("retool"), ["rollout.invalid_action=notice"])


def test_retool_runs_eight_calls(tok):
    turns = [f"<code>print({i})</code>" for i in range(8)] + ["\\boxed{3}"]
    (r,) = rows("retool", [{"prompt": "x?", "ground_truth": "3", "turns": turns}], tok)
    assert r["num_tool_calls"] == 8 and r["finish_reason"] == "eos" and r["reward"] == 1.0


def test_retool_paper_scores_plus_minus_one_with_no_turn_bonus(tok):
    """The paper's reward: +1 / -1 only; verl's recipe lifts a wrong answer by its turns."""
    turns = [f"<code>print({i})</code>" for i in range(6)] + ["\\boxed{4}"]
    wrong = {"prompt": "x?", "ground_truth": "3", "turns": turns}
    (paper,) = rows("retool_paper", [wrong], tok)
    (verl,) = rows("retool", [wrong], tok)
    assert paper["num_tool_calls"] == 6 and paper["reward"] == -1.0 and verl["reward"] > -1.0
    (right,) = rows("retool_paper", [{**wrong, "ground_truth": "4"}], tok)
    assert right["reward"] == 1.0


def test_zerotir_writes_on_past_its_budget_as_its_code_does(tok):
    """ZeroTIR (C = 8): past the budget its code drops the stops, so a ninth block is not
    run and the model writes on; the turn limit (9) never cuts the eighth call."""
    turns = [f"{block(i)}" for i in range(9)] + ["\nDone: \\boxed{8}"]
    (r,) = rows("zerotir", [{"prompt": "x?", "ground_truth": "8", "turns": turns}], tok)
    assert r["num_tool_calls"] == 8 and r["finish_reason"] == "eos" and r["reward"] == 1.0
    assert r["tool_calls"][-1]["error"] == "budget"
    assert r["response_text"].endswith(f"{block(8)}\nDone: \\boxed{{8}}<|endoftext|>")


def test_an_end_policy_ends_at_the_budget_and_answers_never_count(tok):
    """over_budget end: the call past C ends the response ("tool_budget"), even at the turn
    limit; an answer turn after C calls is never cut by the turn limit."""
    calls = [f"<code>print({i})</code>" for i in range(3)]
    over = ["rollout.max_tool_calls=2", "rollout.max_turns=2", "rollout.over_budget=end"]
    line = {"prompt": "x?", "ground_truth": "3", "turns": calls}
    (r,) = rows("retool", [line], tok, over)
    assert r["finish_reason"] == "tool_budget" and r["num_tool_calls"] == 2
    (r,) = rows("retool", [{**line, "turns": calls[:2] + ["\\boxed{3}"]}], tok, over)
    assert r["finish_reason"] == "eos" and r["reward"] == 1.0


CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'


def test_qwen_runs_every_call_of_a_turn_concurrently_in_one_tool_turn(tok):
    """mixed_tools (qwen, multi_call on): both calls of the turn run at once (two 0.3 s
    searches in under 0.6 s), their results in one user turn, in order."""
    turn = CALL.format("search", '{"query": "a"}') + "\n" + CALL.format("search", '{"query": "b"}')
    line = {"prompt": [{"role": "user", "content": "Go."}], "ground_truth": "1"}
    line["turns"] = [turn + "<|im_end|>", "\\boxed{1}"]
    cfg = load_config(configs.path("mixed_tools"), [])
    run = ScriptedRun(cfg, tools=[slow_search, python], tokenizer=tok)
    start = time.monotonic()
    (r,) = asyncio.run(run.run([line]))
    assert time.monotonic() - start < 0.55
    assert r["num_tool_calls"] == 2 and [c["ok"] for c in r["tool_calls"]] == [True, True]
    text = r["response_text"]
    tool_turn = (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\npassages about a\n</tool_response>\n"
        "<tool_response>\npassages about b\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == turn + tool_turn + "\\boxed{1}<|im_end|>" and r["reward"] == 1.0


def test_qwen_one_call_mode_stops_at_the_first_call(tok):
    turn = CALL.format("search", '{"query": "a"}') + "\n" + CALL.format("search", '{"query": "b"}')
    line = {"prompt": "Go.", "ground_truth": "1", "turns": [turn, "\\boxed{1}"]}
    (r,) = rows("mixed_tools", [line], tok, ["rollout.multi_call=false"], tools=[search, python])
    assert r["num_tool_calls"] == 1 and "passages about b" not in r["response_text"]


@pytest.mark.parametrize(
    "turn, error",
    [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "a"}}', "unterminated"),
        ("<think>maybe " + CALL.format("search", '{"query": "a"}') + "</think>", "inside <think>"),
    ],
)
def test_a_malformed_qwen_turn_is_an_error_the_model_sees(tok, turn, error):
    line = {"prompt": "Go.", "ground_truth": "1", "turns": [turn, "\\boxed{1}"]}
    (r,) = rows("mixed_tools", [line], tok, tools=[search, python])
    assert r["num_tool_calls"] == 0 and r["finish_reason"] == "eos"
    (c,) = r["tool_calls"]
    assert c["name"] is None and not c["ok"] and error in c["error"]
    assert "<tool_response>\nError: " in r["response_text"] and r["reward"] == 1.0


def test_eval_scripted_command_writes_rows(tmp_path, tok, monkeypatch, capsys):
    """`jaxrl-tools eval --config search_demo --scripted FILE --output OUT` with the recipe's
    own BM25 search: no model path, no model."""
    script = tmp_path / "s.jsonl"
    line = {"prompt": "Who?", "ground_truth": ["x"], "turns": ["<search>who</search>", "no"]}
    script.write_text(json.dumps(line) + "\n")
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr("jaxrl_tools.rollout.scripted.recipe_tokenizer", lambda cfg: tok)
    argv = ["eval", "--config", "search_demo", "--scripted", str(script), "--output", str(out)]
    assert cli.main(argv) in (0, None)
    (r,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert r["num_tool_calls"] == 1 and r["tool_calls"][0]["name"] == "search"
    assert {"finish_reason", "response_text", "reward", "tool_calls"} <= set(r)
    assert "no model was run" in capsys.readouterr().out


def test_scripted_run_refuses_environment_recipes(tok):
    cfg = load_config(configs.path("frozenlake_grpo"), [])
    with pytest.raises(Exception, match="environment"):
        ScriptedRun(cfg, tools=[], tokenizer=tok)


def test_check_warns_when_the_turn_limit_would_cut_the_budget():
    from jaxrl_tools.check.setup import budget_warning

    for name in ("torl", "zerotir", "search_r1", "retool", "retool_paper", "artist", "mixed_tools"):
        assert budget_warning(load_config(configs.path(name), [])) is None, name
    cfg = load_config(configs.path("retool"), ["rollout.max_turns=4"])
    assert "max_turns=4 ends a response after 4 tool turns" in budget_warning(cfg)
    several = load_config(configs.path("mixed_tools"), ["rollout.max_turns=2"])
    assert budget_warning(several) is None  # several calls per turn fit


def test_artist_calls_python_by_its_own_tag(tok):
    """ARTIST (rollout.tool_tags named): the model writes <python>code</python>, generation
    stops at </python>, the result comes back in <output>, and the strict format reads the
    named tag; the literal <tool> is text, not a call."""
    turns = [
        "<think>square 12</think><python>print(12**2)</python>",
        "<think>done</think><answer>\\boxed{144}</answer>",
    ]
    line = {"prompt": "12^2?", "ground_truth": "144", "turns": turns}
    (r,) = rows("artist", [line], tok)
    assert r["num_tool_calls"] == 1 and r["finish_reason"] == "eos"
    assert [(c["name"], c["ok"]) for c in r["tool_calls"]] == [("python", True)]
    assert "</python>\n<output>\nran 12 chars" in r["response_text"]
    assert r["reward"] == pytest.approx(2.0 + 0.5 + 1.0)
    old = ["<think>square 12</think><tool>print(12**2)</tool><answer>\\boxed{144}</answer>"]
    (r,) = rows("artist", [{**line, "turns": old}], tok)
    assert r["num_tool_calls"] == 0


def test_artist_functions_call_each_function_by_its_own_tag(tok):
    """ARTIST's function calling (rollout.tool_tags named): <get_weather>{JSON}</get_weather>
    runs the recipe's function with those arguments, its result comes back in <output>, and
    the strict format reads the function's tag."""
    from jaxrl_tools.datasets import tool_world

    city = "Quillan"
    temp = tool_world.get_weather(city)["temperature"]
    turns = [
        f'<think>look it up</think><get_weather>{{"city": "{city}"}}</get_weather>',
        f"<think>read it</think><answer>{temp}</answer>",
    ]
    line = {"prompt": f"How warm is {city}?", "ground_truth": str(temp), "turns": turns}
    (r,) = rows("artist_functions", [line], tok, tools=None)
    assert [(c["name"], c["ok"]) for c in r["tool_calls"]] == [("get_weather", True)]
    assert f'"temperature": {temp}' in r["response_text"].split("<output>")[1]
    assert r["reward"] == pytest.approx(2.0 + 0.5 + 1.0)
