"""The registry of record sources (`jaxrl_tools.records`): each source's records, SFT traces and
tokenizer texts, the one-line error of an unknown source, and a training path that loads its
data without the pre-flight package."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_tools import data, records
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.tasks.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _config(**sections):
    base = {"tokenizer": {"path": "unused"}, "data": {"batch_size": 2}, "trainer": {"steps": 1}}
    for name, section in sections.items():
        base[name] = {**base.get(name, {}), **section}
    return config_from_dict(base)


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ENV = {"name": "frozenlake", "kwargs": {"size": 4}, "train_episodes": 6, "eval_episodes": 3}
TASK = {"task": "tool_arithmetic", "task_train_size": 8, "task_eval_size": 4}


def test_the_registry_names_its_sources_and_refuses_others_in_one_line():
    assert records.list_sources() == ["env", "files", "task", "verifiers"]
    for name in records.list_sources():
        assert records.get_source(name).name == name
    with pytest.raises(ValueError) as e:
        records.get_source("parquet")
    assert str(e.value) == "unknown record source 'parquet'; valid: env, files, task, verifiers"


def test_the_config_chooses_the_source():
    assert records.source_name(_config(env=ENV, data=TASK)) == "env"  # episodes replace data
    assert records.source_name(_config(data=TASK)) == "task"
    assert records.source_name(_config(data={"train_files": ["x.jsonl"]})) == "files"


def test_env_source_gives_train_and_held_out_episodes():
    cfg = _config(env=ENV, data={"max_eval_records": 2})
    train, held = records.records(cfg, "train"), records.records(cfg, "eval")
    assert [r["env_seed"] for r in train] == list(range(cfg.env.seed, cfg.env.seed + 6))
    assert len(held) == 2  # data.max_eval_records
    assert not {r["env_seed"] for r in train} & {r["env_seed"] for r in held}
    assert records.source(cfg).describe(cfg, "train") == "episodes of env frozenlake"
    assert records.tokenizer_texts(cfg)  # a grid game's turns


def test_task_source_generates_each_split_from_its_own_seed():
    cfg = _config(data=TASK, rollout={"protocol": "retool"})
    train, held = records.records(cfg, "train"), records.records(cfg, "eval")
    assert (len(train), len(held)) == (8, 4)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert records.records(cfg, "train") == train  # deterministic
    assert records.source(cfg).describe(cfg, "eval") == "generated tool_arithmetic"
    assert records.tokenizer_texts(cfg) == []  # arithmetic needs no extra texts
    fc = _config(data={**TASK, "task": "function_calling"})
    assert records.records(fc, "train")[0]["id"].startswith("fc-")
    assert records.tokenizer_texts(fc)


def test_files_source_reads_the_splits_it_has(tmp_path):
    rows = [{"prompt": f"What is {i}+1?", "ground_truth": str(i + 1)} for i in range(5)]
    f = _jsonl(tmp_path / "train.jsonl", rows)
    cfg = _config(data={"train_files": [str(f)], "eval_files": [str(f)], "max_eval_records": 3})
    src = records.source(cfg)
    train = records.records(cfg, "train")
    assert isinstance(train, data.RecordSource) and len(train) == 5
    assert len(records.records(cfg, "eval")) == 3
    assert src.files(cfg, "train") == (str(f),) and src.describe(cfg, "train") == str(f)
    only_train = _config(data={"train_files": [str(f)]})
    assert src.has(only_train, "train") and not src.has(only_train, "eval")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "no answer"}])
    with pytest.raises(data.DataError, match=r"bad\.jsonl:1: missing field 'ground_truth'"):
        records.records(_config(data={"train_files": [str(bad)]}), "train")
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        records.records(cfg, "test")


def test_sft_traces_from_files_or_the_source(tmp_path):
    trace = {"segments": [["Q: 1+1?", False], ["2", True]]}
    f = _jsonl(tmp_path / "sft.jsonl", [trace] * 5)
    files = {"enabled": True, "train_files": [str(f)], "max_traces": 3, "batch_size": 1}
    assert records.sft_traces(_config(data=TASK, sft=files), None) == [trace["segments"]] * 3
    no_traces = _config(data={"train_files": ["x.jsonl"]}, sft={"enabled": True})
    with pytest.raises(ConfigError, match=r"^sft\.enabled=true needs sft\.train_files"):
        records.sft_traces(no_traces, None)
    cfg = _config(env={**ENV, "name": "refine", "kwargs": {}}, sft={"enabled": True})
    assert "needs a grid game" in records.source(cfg).trace_error(cfg)
    cfg = _config(data=TASK, rollout={"protocol": "search_r1"}, sft={"enabled": True})
    assert "needs rollout.protocol in" in records.source(cfg).trace_error(cfg)


def test_long_prompts_are_dropped_with_the_tokenizer_passed_in(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tok", vocab_size=300)
    short = [{"prompt": f"What is {i}+1?", "ground_truth": str(i + 1)} for i in range(4)]
    long = [{"prompt": "word " * 200, "ground_truth": "0"}]
    cfg = _config(rollout={"max_prompt_len": 64}, data={"drop_long_prompts": True})
    assert records.fit_prompts(cfg, short + long, "train", tokenizer) == short
    with pytest.raises(ConfigError, match="all 1 eval prompts are longer than"):
        records.fit_prompts(cfg, long, "eval", tokenizer)
    keep_all = _config(rollout={"max_prompt_len": 64})
    assert records.fit_prompts(keep_all, short + long, "train", tokenizer) == short + long


def test_the_training_path_loads_data_without_the_preflight_package():
    """The run's loaders (records, setup, SFT, smoke, the demo's data) never import `check`;
    `run` imports it only for `check.preflight`, which `train` calls first on purpose (and
    `check.check_new_output` before an export writes)."""
    loaders = [
        "jaxrl_tools.records",
        "jaxrl_tools.setup",
        "jaxrl_tools.data",
        "jaxrl_tools.train.sft",
        "jaxrl_tools.smoke",
        "jaxrl_tools.tasks.tool_arithmetic",
        "jaxrl_tools.tasks.grid_games",
    ]
    code = (
        f"import sys\nfor m in {loaders}: __import__(m)\nprint('jaxrl_tools.check' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
    tree = ast.parse((ROOT / "jaxrl_tools" / "run.py").read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "check"
    }
    assert used == {"preflight", "check_new_output"}
