"""`verifiers` environments (`data.verifiers`): a taskset written here as a hub package would be
(`vf_products.py`), its tasks as records, its episodes run by verifiers against the policy
through the gateway (token-exact, the tool's output masked), its rubric's reward trained."""

import json
from pathlib import Path

import numpy as np
import pytest
from test_agents import _enc, _engine  # the scripted engine

from jaxrl_tools import cli
from jaxrl_tools.agents.rollouts import run_agent_rollouts
from jaxrl_tools.agents.verifiers_envs import episode, records
from jaxrl_tools.config import ConfigError
from jaxrl_tools.rollout import RolloutLimits
from jaxrl_tools.tools import get_parser

SECTION = {"taskset": "vf-products", "train": {"split": "train"}, "eval": {"split": "test"}}
CALL = '<tool_call>\n{"name": "calc_toolset_multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


def test_a_tasksets_tasks_are_the_records_of_each_split():
    train, held_out = records(SECTION, "train"), records(SECTION, "eval")
    assert [r["id"] for r in train] == ["train-0", "train-1", "train-2"]
    assert train[0]["prompt"] == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 6 times 7?"},
    ]
    assert [r["prompt"][-1]["content"] for r in held_out] == ["What is 9 times 9?"]
    assert records({**SECTION, "eval": None}, "eval") == []
    with pytest.raises(ConfigError, match=r"data.verifiers: taskset 'vf-nope' .*not found"):
        records({"taskset": "vf-nope", "train": {}}, "train")
    with pytest.raises(ConfigError, match=r"taskset 'vf-products' with \{'splt': 'x'\}"):
        records({"taskset": "vf-products", "train": {"splt": "x"}}, "train")


def _rollouts(tok_model, tok, section, script):
    eng, params = _engine(tok_model, tok, [t for s in script for t in _enc(tok, s)])
    limits = RolloutLimits(max_response_tokens=200, chunk_size=8)
    recs = records(section, "train")
    trajs = run_agent_rollouts(
        eng, params, recs, episode, tokenizer=tok, parser=get_parser("qwen"), num_samples=2,
        limits=limits,
    )  # fmt: skip
    return recs, trajs


def test_verifiers_runs_its_episodes_against_the_policy_and_scores_them(tok_model, tok):
    _, trajs = _rollouts(tok_model, tok, SECTION, ["42<|im_end|>"])
    assert [t.agent_reward for t in trajs] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # 6 * 7 only
    for t in trajs:
        assert tok.decode(t.response_ids) == "42<|im_end|>" and all(t.loss_mask)


def test_a_tasks_mcp_tool_runs_between_the_policys_turns(tok_model, tok, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # verifiers' tool server
    section = {**SECTION, "train": {"split": "train", "task": {"with_tool": True}}}
    recs, trajs = _rollouts(tok_model, tok, section, [CALL + "<|im_end|>", "42<|im_end|>"])
    assert [t.agent_reward for t in trajs] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    t = trajs[0]
    text = tok.decode(t.response_ids)
    assert text.startswith(CALL + "<|im_end|>") and "<tool_response>\n42\n</tool_response>" in text
    assert text.endswith("42<|im_end|>")
    masked = [tok.decode([i]) for i, m in zip(t.response_ids, t.loss_mask) if not m]
    assert "42" in "".join(masked) and "tool_response" in "".join(masked)  # the tool's output


def test_a_verifiers_taskset_trains_in_a_smoke_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--config", "grpo_tool_math", "--smoke", "data.task=null"]
    argv += ["data.verifiers={taskset: vf-products, train: {split: train}}"]
    argv += ["rollout.protocol=qwen", "sft.enabled=false", "tools=[]"]
    assert cli.main(argv) == 0
    logs = tmp_path / "runs/smoke/grpo_tool_math/logs/metrics.jsonl"
    steps = [json.loads(line) for line in logs.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["agent/calls_per_run"] == 1 and np.isfinite(s["actor/loss"]) for s in steps)
