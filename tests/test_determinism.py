"""Same seed, same run: two whole training runs (sampling, rewards, update) on the same 2x2x2 mesh
of 8 simulated devices give the same rollouts, rewards and parameters bit for bit. The recorded
rollouts differ from step to step and the parameters move, so equal records are not empty ones
(a resumed run that lost its RNG state fails the same comparison in tests/test_resume.py).

The 8-device side runs in a subprocess (this file executed as a script: `python
tests/test_determinism.py OUT_DIR`), like tests/test_train_rl_sharding.py. The run is
tests/test_resume.py's: a tiny random policy, no tools, a reward that varies with the text.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from fakes import run_on_8_devices

RUNS = {"first": 5, "again": 5}  # name -> trainer.seed
STEPS = 2
TIMINGS = ("time", "throughput/")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("determinism")
    run_on_8_devices(__file__, out, timeout=900)
    return out


def _params(out: Path, name: str) -> dict:
    with np.load(out / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def test_same_seed_same_rollouts_rewards_and_metrics(out):
    report = json.loads((out / "report.json").read_text())
    first, again = report["first"], report["again"]
    assert first["devices"] == 8 and first["mesh"] == [2, 2, 2]
    assert len(first["responses"]) == STEPS and all(len(s) == 8 for s in first["responses"])
    assert again["responses"] == first["responses"]
    assert again["metrics"] == first["metrics"]
    assert any(m["reward/std"] > 0 for m in first["metrics"])  # the reward does vary
    # The records are real: each step sampled other tokens than the step before.
    assert first["responses"][0] != first["responses"][1]


def test_same_seed_same_parameters_bitwise(out):
    first, again = (_params(out, name) for name in RUNS)
    init = _params(out, "init")
    assert max(float(np.abs(first[k] - init[k]).max()) for k in first) > 1e-4  # it trained
    for k in first:
        np.testing.assert_array_equal(again[k], first[k], err_msg=k)


# ------------------------------------------------------------------------------------------------
# the 8-device side (runs in the subprocess)


def _main(out_dir: str) -> None:
    import jax
    from test_resume import _config

    from jaxrl_tools import run
    from jaxrl_tools.config_loader import config_from_dict
    from jaxrl_tools.rollout.sampler import Sampler

    assert jax.device_count() == 8, jax.devices()
    out = Path(out_dir)
    flat = lambda tree: {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    # Record every rollout the trainer draws (token ids and rewards as the trainer sees them).
    seen: list = []
    sample = Sampler.__call__

    def recording(self, records, group_size, params, **kw):
        trajs = sample(self, records, group_size, params, **kw)
        seen.append([[int(t) for t in traj.response_ids] for traj in trajs])
        return trajs

    Sampler.__call__ = recording
    report = {}
    for name, seed in RUNS.items():
        raw = _config(out, name)
        raw["trainer"].update(steps=STEPS, seed=seed, mesh="2x2x2", checkpoint_every=STEPS)
        cfg = config_from_dict(raw)
        if name == "first":
            _, init = run.setup_model(cfg, run.setup_tokenizer(cfg), run.make_mesh(cfg))
            np.savez(out / "init.npz", **flat(init))
        seen.clear()
        summary = run.train(cfg)
        np.savez(out / f"{name}.npz", **flat(summary["params"]))
        logged = (out / name / "logs" / "metrics.jsonl").read_text().splitlines()
        report[name] = {
            "devices": jax.device_count(),
            "mesh": list(cfg.trainer.mesh_shape),
            "responses": list(seen),
            # every logged figure of each step but the timings: rewards, loss, gradient norm, ...
            "metrics": [
                {k: v for k, v in json.loads(line).items() if not k.startswith(TIMINGS)}
                for line in logged
            ],
        }
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _main(sys.argv[1])
