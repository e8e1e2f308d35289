"""Multi-controller runs: 2 processes x 4 simulated CPU devices == 1 process x 8 devices.

The tiny RL run of tests/test_resume.py, with the sandboxed Python tool in the loop (ReTool's
`<code>...</code>` protocol), trained on the mesh 2x2x2. The two-process run decodes on a rollout
mesh of its own (`rollout.mesh: 4x1x2`: the weights are resharded onto it after each update) and
each process reads only its slice of every prompt batch. A random policy never writes a tool call,
so the engine gets a logits hook that favours a fixed script (`<code>print(6*7)</code>`) for the
first tokens of each response: most samples call the tool, the sandbox runs it, and its output goes
back into the KV cache; the rest of each response is the policy's own sampling, and the reward
varies with it. The script's bias is not part of the policy: the update trains the policy's own
log-probs, as with any behaviour policy.

Each run is this file executed as a script (`python tests/test_multihost.py CONFIG_JSON OUT_DIR
[jaxrl-tools flags]`), which runs `jaxrl-tools train` (`jaxrl_tools.cli.main`) with the hook and
saves the final params: once as 1 process with 8 devices, then as 2 processes with 4 devices
each on 127.0.0.1 (`--coordinator/--num-processes/--process-id`). The two-process launch has
process 1 killed after its first checkpoint: process 0 must exit with one line within the
(lowered) heartbeat timeout, and the relaunch resumes and ends with both processes exiting 0
and the single-process run's params: the processes agreed on every host-side decision (each
ran the tool calls of its own slots and shared the results), so they issued the same device
calls. With rollouts ahead of the update (`trainer.max_staleness` 1 and 2) the update, an
evaluation and the checkpoints run in turns agreed between the processes' decode passes: the
two-process run again equals the single-process one; also with one device per process, where
only the hand-overs' fences keep the two threads' device work from running at once.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import FAST_COMPILE, tiny_run_config

STEPS = 2
HERE = Path(__file__).resolve().parent
SCRIPT = "<code>print(6*7)</code>"
HEARTBEAT_S = 5  # how soon a dead peer is noticed (jax's default is 100 s)
TIMEOUT = 900  # per launch (a loaded 2-core CI machine): a hang fails the test, not the CI


def text_reward(response: str, ground_truth=None, info=None) -> float:
    """Varies with the sampled text (distinct characters mod 3), so groups are not all equal,
    and takes a little time, as a real verifier does (the kill test needs a step to take some)."""
    time.sleep(0.02)
    return (len(set(response)) % 3) / 2.0


def _config(tmp: Path, name: str, rollout_mesh: str | None, **sections) -> dict:
    cfg = tiny_run_config(
        tmp,
        name,
        "test_multihost:text_reward",
        rollout={
            "protocol": "retool",
            "max_response_len": 48,
            "max_tool_calls": 1,
            "max_turns": 2,
            "max_obs_tokens": 16,
            "mesh": rollout_mesh,
            # 8 samples on 4 slots: all 4 pause on their tool call in one chunk, and are parked
            # so that the 4 queued samples decode meanwhile (rows leave and return across hosts)
            "slots": 4,
        },
        tools=[{"class": "python", "config": {"mode": "stateless", "n_workers": 1}}],
        # Each run builds its own (process 0 of two, the other waiting for it).
        tokenizer={"path": str(tmp / name / "tokenizer"), "vocab_size": 300},
        trainer={"steps": STEPS, "mesh": "2x2x2", "checkpoint_every": 1},
    )
    for section, value in sections.items():
        cfg[section] = {**cfg[section], **value}
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "")  # the caller's flags, and the devices
    # -O0: every comparison here is between launches compiled alike (CI time).
    flags += f" {FAST_COMPILE} --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = flags.strip()
    env["JAXRL_HEARTBEAT_TIMEOUT_S"] = str(HEARTBEAT_S)
    env["JAXRL_SHUTDOWN_TIMEOUT_S"] = str(HEARTBEAT_S)
    return env


def _launch(
    tmp: Path, name: str, processes: int, devices: int = 8, **sections
) -> list[subprocess.Popen]:
    """The run `name` on `devices` devices, split over `processes` processes (its config from
    `_config` unless tmp/name.json exists)."""
    cfg = tmp / f"{name}.json"
    if not cfg.exists():
        # Two processes: the engine on a mesh of its own (data-parallel decode over both).
        rollout_mesh = None if processes == 1 else "4x1x2"
        cfg.write_text(json.dumps(_config(tmp, name, rollout_mesh, **sections)))
    cmd = [sys.executable, __file__, str(cfg), str(tmp / name)]
    if processes == 1:
        return [
            subprocess.Popen(cmd, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ]
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    return [
        subprocess.Popen(
            [*cmd, *flags, "--process-id", str(i)],
            env=_env(devices // processes),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(processes)
    ]


def _notable(err: str) -> str:
    """A process's stderr, short: its first error lines (the cause) and its last lines."""
    first = [ln for ln in err.splitlines() if re.search(r"Traceback|Error|jaxrl-tools:", ln)]
    return "\n".join(first[:20]) + "\n...\n" + err[-1500:]


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err.decode()))
    return out


def _finished_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _params(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run; the two-process run, killed after its first checkpoint (process
    1 gets SIGKILL) and relaunched. The relaunch's end is the two-process run's result: it
    resumed, so it also proves the resume (a resumed run equals an uninterrupted one:
    tests/test_resume.py), and one two-process run is enough (CI time)."""
    tmp = tmp_path_factory.mktemp("multihost")
    timings = {}
    t0 = time.monotonic()
    [(rc, err)] = _wait(_launch(tmp, "single", 1))
    assert rc == 0, err[-4000:]
    timings["single_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    procs = _launch(tmp, "two", 2)
    ckpt = tmp / "two" / "ckpt"
    deadline = time.monotonic() + TIMEOUT
    while not _finished_steps(ckpt) and procs[1].poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not _finished_steps(ckpt):  # nothing to kill after: say why, with both processes' ends
        code = procs[1].poll()
        why = f"none in {TIMEOUT} s" if code is None else f"process 1 exited with {code}"
        for p in procs:
            p.kill()
        ends = [
            f"process {i}: {_notable(p.communicate()[1].decode())}" for i, p in enumerate(procs)
        ]
        pytest.fail(f"the two-process run wrote no checkpoint ({why})\n" + "\n".join(ends))
    procs[1].send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=TIMEOUT)
    finally:
        procs[0].kill()
        procs[1].communicate(timeout=60)
    killed = {
        "returncode": procs[0].returncode,
        "stderr": err.decode(),
        "exit_s": time.monotonic() - t_kill,
        "resumed_from": _finished_steps(ckpt)[-1],
    }
    timings["killed_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    relaunch = _wait(_launch(tmp, "two", 2))
    timings["relaunch_s"] = time.monotonic() - t0
    print(timings, killed["exit_s"])
    return tmp, killed, relaunch


def test_a_killed_process_stops_the_other_with_one_line(runs):
    _, killed, _ = runs
    err = killed["stderr"]
    assert killed["returncode"] == 1, err[-4000:]
    assert killed["exit_s"] < 2 * HEARTBEAT_S + 20, killed["exit_s"]  # no hang
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxrl-tools: process 0 of 2: "), err[-4000:]
    assert "--resume" in last
    assert 1 <= killed["resumed_from"] < STEPS


def test_the_relaunch_resumes_and_both_processes_exit_cleanly(runs):
    _, killed, relaunch = runs
    for rc, err in relaunch:
        assert rc == 0, err[-4000:]
        assert f"resumed from step {killed['resumed_from']}" in err
    # Metrics are written once: process 1 shows no progress bar of its own.
    assert f"{STEPS}/{STEPS}" in relaunch[0][1] and f"{STEPS}/{STEPS}" not in relaunch[1][1]


def test_two_processes_reach_the_single_process_params(runs):
    tmp, _, _ = runs
    single, two = _params(tmp / "single" / "params.npz"), _params(tmp / "two" / "params.npz")
    init = _params(tmp / "single" / "init.npz")
    assert sorted(single) == sorted(two)
    assert max(float(np.abs(single[k] - init[k]).max()) for k in single) > 1e-4  # it trained
    # The same sums over the same mesh shape, but not the same device order: float32 rounding.
    for k in single:
        np.testing.assert_allclose(two[k], single[k], rtol=0, atol=2e-5, err_msg=k)


def test_the_tool_ran_and_both_runs_logged_the_same(runs):
    tmp, _, _ = runs
    single, two = _records(tmp / "single" / "logs"), _records(tmp / "two" / "logs")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(single, two):
        assert a["tools/calls_per_response"] > 0.5  # the sandbox ran for most samples
        assert b["schedule/parks"] >= 4, b  # parked rows came back (the params match)
        for k in a:
            if not k.startswith(("time", "throughput/", "schedule/")):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


@pytest.fixture(scope="module", params=[2], ids=lambda k: f"k{k}")
def async_runs(request, tmp_path_factory):
    """`trainer.max_staleness: k` for 3 steps (staleness 0, 1, then k), one process x 8 devices
    and two x 4 (k = 1 across processes: the one-device-per-process test below), with a checkpoint every step and an evaluation at step 2: the main thread's
    device work (updates, the evaluation, the saves) takes its turns in the worker's decode
    passes at agreed points, so both runs issue the same device calls in the same order."""
    k = request.param
    tmp = tmp_path_factory.mktemp(f"async_k{k}")
    sections = {
        "trainer": {"steps": 3, "max_staleness": k, "eval_every": 2},
        "algorithm": {"tis_cap": 2.0},
    }
    ends = {}
    for name, processes in (("single", 1), ("two", 2)):
        for i, (rc, err) in enumerate(_wait(_launch(tmp, name, processes, **sections))):
            assert rc == 0, f"{name}, process {i}: {_notable(err)}"
        ends[name] = (_params(tmp / name / "params.npz"), _records(tmp / name / "logs"))
    return k, ends


def test_two_processes_with_rollouts_ahead_equal_one(async_runs):
    k, ends = async_runs
    (single, single_log), (two, two_log) = ends["single"], ends["two"]
    assert [r["async/staleness_max"] for r in two_log] == [0, 1, k]  # the bound, reached
    assert "eval/reward/mean" in two_log[1]
    for a, b in zip(single_log, two_log):
        for key in a:
            if not key.startswith(("time", "throughput/", "schedule/", "async/trainer_wait_s",
                                   "async/rollout_gate_s")):  # fmt: skip
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert sorted(single) == sorted(two)
    for key in single:
        np.testing.assert_allclose(two[key], single[key], rtol=0, atol=2e-5, err_msg=key)


def test_one_device_per_process_with_rollouts_ahead_equals_one_process(tmp_path):
    """2 processes x 1 device with `trainer.max_staleness: 1` == 1 process x 2 devices, on the
    same meshes (update 1x2x1, decode 2x1x1). The update (main thread) and the decode passes'
    agreements (worker thread) are called in turns, but with one device per process XLA:CPU ran
    them at once, and their collectives interleaved (a gloo size mismatch before step 1). No
    tool and short responses: the cheapest run that has both threads' device calls."""
    ends = {}
    for name, processes in (("single", 1), ("two", 2)):
        cfg = tiny_run_config(
            tmp_path,
            name,
            "test_multihost:text_reward",
            rollout={"protocol": "none", "max_response_len": 16, "mesh": "2x1x1"},
            trainer={"steps": 2, "mesh": "1x2x1", "max_staleness": 1},
            algorithm={"tis_cap": 2.0},
        )
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        for i, (rc, err) in enumerate(_wait(_launch(tmp_path, name, processes, devices=2))):
            assert rc == 0, f"{name}, process {i}: {_notable(err)}"
        ends[name] = (_params(tmp_path / name / "params.npz"), _records(tmp_path / name / "logs"))
    (single, single_log), (two, two_log) = ends["single"], ends["two"]
    init = _params(tmp_path / "single" / "init.npz")
    assert max(float(np.abs(single[k] - init[k]).max()) for k in single) > 1e-4  # it trained
    assert [r["async/staleness_max"] for r in two_log] == [0, 1]
    for a, b in zip(single_log, two_log, strict=True):
        for key in a:
            if not key.startswith(("time", "throughput/", "schedule/", "async/trainer_wait_s",
                                   "async/rollout_gate_s")):  # fmt: skip
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for key in single:
        np.testing.assert_allclose(two[key], single[key], rtol=0, atol=2e-5, err_msg=key)


def test_a_two_process_smoke_run_with_sft_checkpoints_and_resumes(tmp_path):
    """`train --smoke` of the demo recipe (SFT, then RL) on 2 processes x 1 device, on the mesh
    given on the command line (`--smoke` used to replace it by 1x1x1: each process trained alone
    on its own device, and the first checkpoint failed on host-local arrays), then a relaunch
    with --resume that continues it. One SFT step, one RL step, then one more after resuming.
    The mesh 1x2x1 shards every parameter over both processes (FSDP), so each checkpoint
    gathers across them; one device each is the cheapest launch that does (CI time)."""
    cmd = [sys.executable, "-m", "jaxrl_tools.cli", "train", "--config", "grpo_tool_math"]
    cmd += ["--smoke", "trainer.mesh=1x2x1", "sft.num_traces=8", "sft.max_traces=8"]
    cmd += [f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'logs'}"]
    env = _env(1)
    for k in ("JAXRL_HEARTBEAT_TIMEOUT_S", "JAXRL_SHUTDOWN_TIMEOUT_S"):  # no kill here: defaults
        env.pop(k)

    def launch(*flags: str) -> list[tuple[int, str]]:
        port = _free_port()
        dist = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
        return _wait(
            [
                subprocess.Popen(
                    [*cmd, *flags, *dist, "--process-id", str(i)],
                    cwd=tmp_path,  # runs/smoke/grpo_tool_math/tokenizer goes there
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                for i in range(2)
            ]
        )

    first = launch("trainer.steps=1")
    for i, (rc, err) in enumerate(first):
        assert rc == 0, f"process {i}: {_notable(err)}"
        assert "SFT on 8 traces" in err
    assert _finished_steps(tmp_path / "ckpt") == [1]
    for i, (rc, err) in enumerate(launch("trainer.steps=2", "--resume")):
        assert rc == 0, f"process {i}: {_notable(err)}"
        assert "resumed from step 1" in err and "SFT on" not in err
    assert _finished_steps(tmp_path / "ckpt") == [2]  # smoke keeps 1
    assert [r["step"] for r in _records(tmp_path / "logs")] == [1, 2]
    assert not (tmp_path / "runs" / "smoke" / "grpo_tool_math" / "checkpoints").exists()


def test_partial_launch_settings_are_one_line_errors(monkeypatch, capsys):
    from jaxrl_tools import cli
    from jaxrl_tools.sharding import distributed

    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert cli.main(["check", "--num-processes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxrl-tools: a multi-process launch needs --coordinator, --process-id")
    assert "\n" not in err
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="needs JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID"):
        distributed.initialize_distributed()
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=2 must be in 0..1"):
        distributed.initialize_distributed()


def test_single_process_agreement_is_the_local_value():
    import jax.numpy as jnp

    from jaxrl_tools.sharding.distributed import agree, to_host

    assert agree({"slot": 3}) == [{"slot": 3}]
    np.testing.assert_array_equal(to_host(jnp.arange(4)), np.arange(4))


# ------------------------------------------------------------------------------------------------
# one process of a run (this file executed as a script)


def _script_hook(logits_BV, sampled_B, seq_B, script_S):
    """Favours token `script_S[i]` as a response's i-th model token (then nothing)."""
    import jax
    import jax.numpy as jnp

    n = script_S.shape[0]
    want_B = script_S[jnp.minimum(sampled_B, n - 1)]
    bias_BV = 12.0 * jax.nn.one_hot(want_B, logits_BV.shape[-1], dtype=logits_BV.dtype)
    return logits_BV + jnp.where((sampled_B < n)[:, None], bias_BV, 0.0)


def _main(config_path: str, out_dir: str, flags: list[str]) -> int:
    import jax

    from jaxrl_tools import cli, run
    from jaxrl_tools.rollout import sampler
    from jaxrl_tools.sharding.distributed import to_host

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine_core = sampler.EngineCore

    def scripted_engine(*args, tokenizer, **kwargs):
        script = np.asarray(tokenizer.encode(SCRIPT, add_special_tokens=False), np.int32)
        return engine_core(
            *args, tokenizer=tokenizer, logits_hook=_script_hook, hook_data=script, **kwargs
        )

    sampler.EngineCore = scripted_engine
    train = run.train

    def train_and_save(cfg, **kwargs):
        summary = train(cfg, **kwargs)
        leaves = jax.tree_util.tree_leaves_with_path(summary["params"])
        flat = {jax.tree_util.keystr(p): to_host(x) for p, x in leaves}
        if jax.process_index() == 0:
            np.savez(out / "params.npz", **flat)
        return summary

    run.train = train_and_save
    setup_model = run.setup_model

    def setup_and_save(*args, **kwargs):
        """The run's own initial params, saved by a single-process run (no second init to
        compile)."""
        model_cfg, init = setup_model(*args, **kwargs)
        if not flags and not (out / "init.npz").exists():
            leaves = jax.tree_util.tree_leaves_with_path(init)
            flat = {jax.tree_util.keystr(p): to_host(x) for p, x in leaves}
            np.savez(out / "init.npz", **flat)
        return model_cfg, init

    run.setup_model = setup_and_save
    return cli.main(["train", "--config", config_path, *flags])


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(_main(sys.argv[1], sys.argv[2], sys.argv[3:]))
