"""Data curation by pass rate (jaxrl_tools/curation.py): the band filter, the records it writes,
the curriculum's order, and `jaxrl-tools pass-rate` on a trained checkpoint."""

import json
from pathlib import Path

import numpy as np
import pytest
from fakes import tiny_run_config

from jaxrl_tools import cli, curation, records
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.types import Trajectory


def test_band_and_zero_variance_by_hand():
    assert curation.parse_band("0.1..0.9") == (0.1, 0.9)
    assert curation.parse_band("0..1") == (0.0, 1.0)
    for bad in ("0.9..0.1", "0.1-0.9", "a..b", "-0.1..0.5", "0.2..1.5"):
        with pytest.raises(ConfigError, match=rf"^--keep={bad!r}: give LO\.\.HI with 0 <= LO"):
            curation.parse_band(bad)
    rates = np.array([0.0, 0.125, 0.5, 1.0, 0.875, 1.0])
    assert curation.in_band(rates, 0.1, 0.9).tolist() == [False, True, True, False, True, False]
    assert curation.zero_variance_frac(rates) == pytest.approx(3 / 6)
    assert curation.zero_variance_frac(rates[curation.in_band(rates, 0.1, 0.9)]) == 0.0


def tiny_run_config_dict(tmp="/tmp/unused", **sections):
    return tiny_run_config(Path(tmp), "curation", "math", **sections)


class Scripted:
    """A sampler whose k samples of a prompt answer right `right[prompt]` times."""

    def __init__(self, right):
        self.right = right

    def __call__(self, recs, k, params, *, temperature, seed):
        out = []
        for p, rec in enumerate(recs):
            n = self.right[rec["prompt"]]
            for s in range(k):
                answer = rec["ground_truth"] if s < n else "wrong"
                out.append(Trajectory(p, s, [1], model_text=f"\\boxed{{{answer}}}"))
        return out


def test_pass_rates_count_the_answer_checkers_verdicts():
    cfg = config_from_dict(tiny_run_config_dict())
    recs = [{"prompt": f"q{i}", "ground_truth": str(i)} for i in range(4)]
    right = {"q0": 0, "q1": 1, "q2": 4, "q3": 3}
    reward = CompositeReward([("math", 1.0, {"correct": 1.0, "wrong": 0.0})])
    rates = curation.sample_pass_rates(cfg, Scripted(right), None, recs, reward, 4, seed=0)
    assert rates.tolist() == [0.0, 0.25, 1.0, 0.75]


def test_written_records_read_back_and_the_curriculum_orders_them(tmp_path):
    cfg = config_from_dict(tiny_run_config_dict(tmp_path))
    recs = [
        {"prompt": f"What is {i} + 1?", "ground_truth": str(i + 1), "difficulty": i % 3}
        for i in range(6)
    ]
    rates = np.array([0.25, 1.0, 0.5, 0.0, 0.75, 0.5])
    keep = curation.in_band(rates, 0.1, 0.9)
    path = tmp_path / "kept.jsonl"
    assert curation.write_records(cfg, recs, rates, keep, path) == 4
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["pass_rate"] for r in rows] == [0.25, 0.5, 0.75, 0.5]
    assert rows[0] == {"prompt": "What is 0 + 1?", "ground_truth": "1", "difficulty": 0,
                       "pass_rate": 0.25}  # fmt: skip
    data = {"task": None, "train_files": [str(path)], "batch_size": 4}
    shuffled = config_from_dict(tiny_run_config_dict(tmp_path, data=data))
    ordered = config_from_dict(
        tiny_run_config_dict(tmp_path, data={**data, "curriculum": "easy_to_hard"})
    )
    # A file record keeps its other fields, pass_rate among them, and the curriculum reads it.
    read = records.records(ordered, "train")
    assert [curation.pass_rate_of(r) for r in read] == [0.25, 0.5, 0.75, 0.5]
    tok = None  # no prompt is dropped (data.drop_long_prompts is off): no tokenizer needed
    batch = next(records.train_loader(ordered, tok))
    assert [r["prompt"] for r in batch] == [
        "What is 4 + 1?", "What is 2 + 1?", "What is 5 + 1?", "What is 0 + 1?"
    ]  # fmt: skip
    again = records.train_loader(ordered, tok)
    next(again)
    assert next(again) == batch  # every epoch in the same order
    assert {r["prompt"] for r in next(records.train_loader(shuffled, tok))} == {
        r["prompt"] for r in batch
    }


def test_a_curriculum_over_records_without_pass_rates_is_refused(tmp_path):
    cfg = config_from_dict(tiny_run_config_dict(tmp_path, data={"curriculum": "easy_to_hard"}))
    with pytest.raises(ConfigError, match=r"data\.curriculum='easy_to_hard' orders by pass rate"):
        records.train_loader(cfg, None)
    with pytest.raises(ConfigError, match=r"data\.curriculum='hardest' is not one of"):
        config_from_dict(tiny_run_config_dict(tmp_path, data={"curriculum": "hardest"}))


def test_pass_rate_command_samples_a_checkpoint_and_writes_the_band(tmp_path, capsys):
    cfg = tiny_run_config_dict(
        tmp_path,
        data={"task_train_size": 6},
        rollout={"protocol": "none", "max_response_len": 16},
        trainer={"steps": 1},
    )
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    assert cli.main(["train", "--config", str(path)]) == 0
    out = tmp_path / "all.jsonl"
    argv = ["pass-rate", "--config", str(path), "--checkpoint", "--samples", "2"]
    assert cli.main([*argv, "--keep", "0..1", "--output", str(out), "--recheck"]) == 0
    printed = capsys.readouterr().out
    assert f"kept 6 of 6 prompts with a pass rate in 0..1 over 2 samples -> {out}" in printed
    assert "recheck_zero_variance_frac_kept:" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["pass_rate"] in (0.0, 0.5, 1.0) for r in rows)
    # Nothing is overwritten, and a random tiny model is not what anyone wants sampled.
    assert cli.main([*argv, "--output", str(out)]) == 2
    assert "give a new file in an existing folder" in capsys.readouterr().err
    assert cli.main([*argv[:3], "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "model.path is null (a random tiny model)" in capsys.readouterr().err


def test_training_files_mixed_by_weight_in_their_proportions(tmp_path):
    files = []
    for name, n in (("small", 10), ("large", 50)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(
            json.dumps({"prompt": f"{name} {i}", "ground_truth": "1"}) + "\n" for i in range(n)
        ))  # fmt: skip
        files.append(str(path))

    def drawn(weights, seed=0, batches=50):
        data = {"task": None, "train_files": files, "train_weights": weights, "batch_size": 8,
                "shuffle_seed": seed}  # fmt: skip
        cfg = config_from_dict(tiny_run_config_dict(tmp_path, data=data))
        loader = records.train_loader(cfg, None)  # no prompt is dropped: no tokenizer needed
        return [r["prompt"] for _ in range(batches) for r in next(loader)]

    prompts = drawn([3.0, 1.0])
    small = sum(p.startswith("small") for p in prompts) / len(prompts)
    assert small == pytest.approx(0.75, abs=0.02)  # 3:1, though the small file is 5x smaller
    assert len({p for p in prompts if p.startswith("small")}) == 10  # each file repeated
    assert drawn([3.0, 1.0]) == prompts and drawn([3.0, 1.0], seed=1) != prompts
    with pytest.raises(ConfigError, match=r"data\.train_weights needs one weight > 0 per"):
        drawn([1.0])
    with pytest.raises(ConfigError, match=r"data\.train_weights mixes the files forever"):
        data = {"task": None, "train_files": files, "train_weights": [1, 1], "num_epochs": 1}
        config_from_dict(tiny_run_config_dict(tmp_path, data=data))


def test_limr_scores_against_a_loop_transcription():
    """LIMR (2502.11886): s_i = 1 - sum_k (r_ik - rbar_k)^2 / sum_k (1 - rbar_k)^2."""
    rng = np.random.default_rng(0)
    r = rng.random((7, 5))
    r[0] = r[1:].mean(axis=0)  # then also the mean of all: it follows the average curve, score 1
    mean = [sum(r[i, k] for i in range(7)) / 7 for k in range(5)]
    den = sum((1 - mean[k]) ** 2 for k in range(5))
    want = [1 - sum((r[i, k] - mean[k]) ** 2 for k in range(5)) / den for i in range(7)]
    np.testing.assert_allclose(curation.limr_scores(r), want, rtol=1e-12)
    assert curation.limr_scores(r)[0] == pytest.approx(1.0)
    keep = curation.limr_keep(r, threshold=0.6)
    assert keep.tolist() == [w > 0.6 for w in want] and keep[0]
    with pytest.raises(ValueError, match=r"rewards must be \[samples, epochs\]"):
        curation.limr_scores(np.ones(3))
