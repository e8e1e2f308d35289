"""A run killed with SIGKILL, or stopped with SIGTERM, and resumed reaches the same params and
metrics as one that was not, and its log reads as one run.

`jaxrl_tools.run.train` runs in subprocesses (this file executed as a script: `python
tests/test_resume.py CONFIG_JSON OUT_DIR`): once uninterrupted, once killed as soon as its first
checkpoint is on disk (async saves may be cut mid-write) and then started again with
`trainer.resume`. The resumed run must restore the policy, optimizer state, RNG, the data
iterator's position and the rollout call counter (the rollout's sampling seeds) exactly. A third
run goes through the CLI and gets SIGTERM (a preempted host) after its first logged step: it
must finish that step, save it (between the periodic checkpoints) and exit with one line.

A tiny random policy, no tools (a random model does not call them; the rollout's tool path has
its own tests) and a reward that varies with the sampled text, so that GRPO's advantages are not
all zero and every step moves the params.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import tiny_run_config

STEPS = 6
EVERY = 2
HERE = Path(__file__).resolve().parent


def text_reward(response: str, ground_truth=None, info=None) -> float:
    """Varies with the sampled text (distinct characters mod 3), so groups are not all equal.

    It also takes a little time, as a real verifier does: compiled steps of this tiny run are
    otherwise so fast that the run would end before the kill lands."""
    time.sleep(0.05)
    return (len(set(response)) % 3) / 2.0


def hangs_after_step_1(response: str, ground_truth=None, info=None) -> float:
    """text_reward at step 1; from step 2 on it never returns (a verifier stuck on an answer),
    saying so in the file $HANGING."""
    if info is not None and (info.step or 0) >= 2:
        Path(os.environ["HANGING"]).touch()
        threading.Event().wait()
    return text_reward(response)


def _config(tmp: Path, name: str) -> dict:
    return tiny_run_config(
        tmp,
        name,
        "test_resume:text_reward",
        rollout={"protocol": "none", "max_response_len": 16},
        trainer={"steps": STEPS, "checkpoint_every": EVERY},
    )


def _command(tmp: Path, name: str) -> list[str]:
    cfg_path = tmp / f"{name}.json"
    cfg_path.write_text(json.dumps(_config(tmp, name)))
    return [sys.executable, __file__, str(cfg_path), str(tmp / name)]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _finished_steps(ckpt: Path) -> list[int]:
    """Steps whose checkpoint was finalised (orbax renames a temporary folder at the end)."""
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    env = _env()
    full = subprocess.run(
        _command(tmp, "full"), env=env, capture_output=True, text=True, timeout=600
    )
    assert full.returncode == 0, full.stderr[-4000:]

    # Killed as soon as its first checkpoint is on disk, then run again to the end.
    cmd = _command(tmp, "killed")
    ckpt = tmp / "killed" / "ckpt"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while not _finished_steps(ckpt) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-4000:]
    resumed_from = _finished_steps(ckpt)[-1]
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return tmp, resumed_from, resumed.stderr


def test_killed_mid_run(runs):
    _, resumed_from, _ = runs
    assert EVERY <= resumed_from < STEPS


def test_resumed_log_reads_as_one_run(runs):
    """No step twice in metrics.jsonl (steps logged after the last checkpoint are dropped and
    redone), the progress bar starts at the resumed step."""
    tmp, resumed_from, stderr = runs
    assert [r["step"] for r in _records(tmp / "killed" / "logs")] == list(range(1, STEPS + 1))
    assert f"{resumed_from}/{STEPS}" in stderr


def test_resumed_params_equal_uninterrupted(runs):
    tmp, _, _ = runs
    full = np.load(tmp / "full" / "params.npz")
    killed = np.load(tmp / "killed" / "params.npz")
    assert sorted(full.files) == sorted(killed.files)
    init = np.load(tmp / "full" / "init.npz")
    moved = max(float(np.abs(full[k] - init[k]).max()) for k in full.files)
    assert moved > 1e-4  # the run did train
    for k in full.files:
        np.testing.assert_array_equal(killed[k], full[k], err_msg=k)


def test_resumed_metrics_equal_uninterrupted(runs):
    tmp, resumed_from, _ = runs
    skip = ("step", "time", "time/", "throughput/")
    full = {r["step"]: r for r in _records(tmp / "full" / "logs")}
    resumed = [r for r in _records(tmp / "killed" / "logs") if r["step"] > resumed_from]
    assert resumed
    for r in resumed:
        ref = full[r["step"]]
        keys = {k for k in ref if not k.startswith(skip)}
        assert keys == {k for k in r if not k.startswith(skip)}
        for k in sorted(keys):
            assert r[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-7), (r["step"], k)


def test_sigterm_saves_the_step_and_exits_with_one_line(runs):
    tmp, _, _ = runs
    cfg = _config(tmp, "term")
    cfg["trainer"]["checkpoint_every"] = STEPS  # no periodic checkpoint before the signal's
    cfg_path = tmp / "term.json"
    cfg_path.write_text(json.dumps(cfg))
    cli = [sys.executable, "-m", "jaxrl_tools.cli", "train", "--config", str(cfg_path)]
    env = _env()
    proc = subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log = tmp / "term" / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and log.read_text().strip():
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    err = err.decode()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxrl-tools: stopped by SIGTERM after step ") and "--resume" in last
    assert "Traceback" not in err
    stopped = int(last.split("after step ")[1].split(";")[0])
    assert stopped < STEPS and _finished_steps(tmp / "term" / "ckpt") == [stopped]
    done = subprocess.run(cli + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [r["step"] for r in _records(tmp / "term" / "logs")] == list(range(1, STEPS + 1))
    # the summary printed at the end is the uninterrupted run's
    full = {r["step"]: r for r in _records(tmp / "full" / "logs")}
    term = {r["step"]: r for r in _records(tmp / "term" / "logs")}
    assert term[STEPS]["reward/mean"] == pytest.approx(full[STEPS]["reward/mean"], rel=1e-6)


def test_sigterm_while_a_reward_hangs_saves_the_step_and_exits(runs):
    """A reward that never returns is given up at its deadline (reward[].timeout_s), so the
    step it hangs ends, is saved and the run exits on SIGTERM, its timeouts logged."""
    tmp, _, _ = runs
    cfg = _config(tmp, "hung")
    cfg["reward"] = [{"name": "test_resume:hangs_after_step_1", "timeout_s": 0.5}]
    cfg_path = tmp / "hung.json"
    cfg_path.write_text(json.dumps(cfg))
    cli = [sys.executable, "-m", "jaxrl_tools.cli", "train", "--config", str(cfg_path)]
    hanging = tmp / "hung" / "hanging"
    env = {**_env(), "HANGING": str(hanging)}
    proc = subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline and not hanging.exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # while step 2's reward hangs
    _, err = proc.communicate(timeout=120)  # it hung here for ever before the deadlines
    err = err.decode()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert err.strip().splitlines()[-1].startswith("jaxrl-tools: stopped by SIGTERM after step 2")
    steps = _records(tmp / "hung" / "logs")
    assert [r["reward/timeouts"] for r in steps] == [0, 8]  # 2 prompts x 4 samples given up
    assert _finished_steps(tmp / "hung" / "ckpt") == [2]


# ------------------------------------------------------------------------------------------------
# the training side (runs in the subprocess)


def _main(config_path: str, out_dir: str) -> None:
    import jax

    from jaxrl_tools import run
    from jaxrl_tools.config_loader import config_from_dict

    cfg = config_from_dict(json.loads(Path(config_path).read_text()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = lambda tree: {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    if not (out / "init.npz").exists():
        tokenizer = run.setup_tokenizer(cfg)
        _, init = run.setup_model(cfg, tokenizer)
        np.savez(out / "init.npz", **flat(init))
    summary = run.train(cfg)
    np.savez(out / "params.npz", **flat(summary["params"]))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
