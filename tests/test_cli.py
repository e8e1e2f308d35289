"""The CLI end to end on a tiny run: train (SFT + RL, checkpoints), eval, export, bad input."""

import re

import numpy as np
import pytest
import yaml
from fakes import tiny_run_config

from jaxrl_tools.cli import main


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    cfg = tiny_run_config(
        d,
        "tiny",
        {"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}},
        tokenizer={"path": str(d / "tok")},
        data={"task_eval_size": 8, "eval_batch_size": 8},
        rollout={"protocol": "retool", "max_response_len": 16},
        tools=[{"class": "python", "config": {"n_workers": 1}}],
        optim={"micro_batch_size": 8},
        trainer={
            "steps": 2,
            "checkpoint_dir": str(d / "ckpt"),
            "checkpoint_every": 1,
            "log_dir": str(d / "logs"),
            "resume": False,
        },
        sft={"enabled": True, "epochs": 1, "num_traces": 16, "batch_size": 8, "lr": 1e-3},
    )
    path = d / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 0
    return d, path


def test_train_writes_checkpoints_and_metrics(run_config):
    d, _ = run_config
    lines = (d / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"reward/mean"' in lines[0]
    assert sorted(p.name for p in (d / "ckpt").iterdir() if p.name.isdigit()) == ["1", "2"]
    assert (d / "logs" / "curves.png").stat().st_size > 0


def test_eval_of_the_checkpoint(run_config, capsys):
    _, path = run_config
    assert main(["eval", "--config", str(path), "--checkpoint"]) == 0
    out = capsys.readouterr().out
    assert "reward/accuracy:" in out and "num_problems: 8" in out


def test_export_loads_in_transformers(run_config):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jaxrl_tools import run
    from jaxrl_tools.config_loader import load_config

    d, path = run_config
    out = d / "hf"
    assert main(["export", "--config", str(path), "--out", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    _, params, _, step = run.restore_policy(load_config(path))
    assert step == 2
    np.testing.assert_array_equal(
        hf.model.embed_tokens.weight.detach().numpy(), np.asarray(params["embed"]["embedding"])
    )
    assert (out / "tokenizer.json").exists()


def test_config_errors_name_the_key(run_config, capsys):
    _, path = run_config
    # The checkpoints of the finished run are not silently mixed with a new one.
    assert main(["train", "--config", str(path)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert main(["train", "--config", str(path), "optim.lrr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and "did you mean 'lr'" in err
    # The README's `--section.key value` form reaches the config (argparse does not eat it).
    assert main(["train", "--config", str(path), "--optim.lrr", "1e-3"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert main(["train", "--config", "no_such_recipe"]) == 2
    assert "grpo_tool_math" in capsys.readouterr().err


def test_export_of_a_missing_step_lists_the_steps(run_config, capsys):
    d, path = run_config
    out = d / "not_written"
    assert main(["export", "--config", str(path), "--out", str(out), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"jaxrl-tools: --step 7: there is no checkpoint of step 7 in {d / 'ckpt'}; steps there: "
        "1, 2"
    )
    assert not out.exists()


def test_demo_compares_with_a_baseline_reward(run_config, capsys):
    """`demo --baseline-reward`: SFT once, RL with OTC and with plain `math` from the same SFT
    policy, one report with the three policies and OTC's tool-efficiency figures."""
    d, path = run_config
    out = d / "otc"
    overrides = [
        "reward.0.name=otc_grpo",
        "reward.0.kwargs={}",
        f"trainer.log_dir={out / 'logs'}",
        f"trainer.checkpoint_dir={out / 'ckpt'}",
    ]
    assert main(["demo", "--config", str(path), "--baseline-reward", "math", *overrides]) == 0
    report = (out / "logs" / "report.md").read_text()
    assert report in capsys.readouterr().out
    rows = [line.split(" |")[0] for line in report.splitlines() if line.startswith("| SFT")]
    assert rows == ["| SFT (before RL)", "| SFT + RL (math)", "| SFT + RL (otc_grpo)"]
    assert "Against RL with math from the same SFT policy" in report
    assert "tool productivity (correct answers per tool call)" in report
    # where the time went: SFT, an evaluation, the RL step's generate / score / update
    assert re.search(r"Time: SFT \d+ s, one evaluation \d+ s, mean RL step [\d.]+ s \(generate "
                     r"[\d.]+ s, score [\d.]+ s, update [\d.]+ s\)", report), report  # fmt: skip
    assert report.index("Examples before RL:") < report.index("Examples after RL:")
    assert (out / "ckpt" / "baseline" / "2").is_dir() and (out / "ckpt" / "2").is_dir()


def test_runs_keep_compiled_programs_in_the_configured_cache(monkeypatch, tmp_path):
    import jax

    from jaxrl_tools import setup
    from jaxrl_tools.config_loader import config_from_dict

    folder = str(tmp_path / "xla_cache")
    cfg = config_from_dict(
        {"tokenizer": {"path": "unused"}, "trainer": {"compile_cache_dir": folder}}
    )
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    try:
        assert setup.use_compile_cache(cfg) == folder
        assert jax.config.jax_compilation_cache_dir == folder
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    # The environment's cache (the test suite's, a cluster's shared one) wins.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "shared"))
    assert setup.use_compile_cache(cfg) == str(tmp_path / "shared")


def test_config_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["check", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"--config {tmp_path} is a directory" in err and "YAML file" in err


def test_smoke_says_when_it_overrides_the_dtype(caplog):
    from jaxrl_tools import smoke
    from jaxrl_tools.config_loader import config_from_dict

    def smoked(**model):
        caplog.clear()
        cfg = config_from_dict({"tokenizer": {"path": "unused"}, "model": model})
        return smoke.smoke_config(cfg)

    assert smoked(dtype="bfloat16").model.dtype == "float32"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "model.dtype=bfloat16" in line and "float32" in line
    # bfloat16 master weights would not pass with a float32 compute: all three go to float32.
    cfg = smoked(dtype="bfloat16", param_dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert (cfg.model.param_dtype, cfg.model.kv_cache_dtype) == ("float32", None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "model.param_dtype=bfloat16" in line and "model.kv_cache_dtype=bfloat16" in line
    smoked(dtype="float32")
    assert not caplog.records  # nothing overridden, nothing said


def test_serve_host_defaults_to_loopback_and_warns_otherwise(monkeypatch, tmp_path, capsys):
    from jaxrl_tools import serve

    started = []

    class Server:
        def wait_for_termination(self):
            pass

    def start_server(cfg, **kwargs):
        started.append(kwargs)
        return Server()

    monkeypatch.setattr(serve, "start_server", start_server)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"tokenizer": {"path": "unused"}}))
    assert main(["serve", "--config", str(path), "--port", "9123"]) == 0
    assert started[-1]["host"] == "127.0.0.1"
    out = capsys.readouterr().out.strip()
    assert "127.0.0.1:9123" in out and "authentication" not in out
    assert main(["serve", "--config", str(path), "--host", "0.0.0.0", "--port", "9123"]) == 0
    assert started[-1]["host"] == "0.0.0.0"
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "0.0.0.0:9123" in line and "no authentication" in line and "plain text" in line
