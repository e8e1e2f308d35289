"""Cross-framework reproducibility: one update here equals the PyTorch (verl formulas) one.

Parity is the proof: for GRPO, Dr. GRPO, RLOO and PPO-with-critic batches on tiny random
Qwen2 / Qwen3 / Llama 3 checkpoints, the token log-probs, advantages, loss, gradients (1e-4
relative) and weights after one AdamW step (1e-6) of `interop.jax_update` match
`interop.reference.torch_update`, which shares nothing with our side but the batch file.
"""

from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from fakes import fixed_trajectories

from jaxrl_tools import algorithms, interop, models
from jaxrl_tools.cli import main
from jaxrl_tools.config import AlgorithmSection, ConfigError, RunConfig
from jaxrl_tools.config_loader import config_from_dict
from jaxrl_tools.data import DataError
from jaxrl_tools.interop import reference, trl_grpo
from jaxrl_tools.models.hf_io import from_hf_tensors, hf_names, to_hf_tensors
from jaxrl_tools.train.state import make_optimizer, torch_adamw

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# The same overrides as tests/test_models.py's variants: the session's tiny_hf cache shares them.
FAMILIES = {
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_key_value_heads=1)),
    "llama3": ("llama", dict(num_key_value_heads=2, rope_theta=5e5, rope_scaling=LLAMA3_ROPE)),
}
B, P, R, G = 8, 5, 7, 4


@pytest.fixture(scope="module")
def policy(tiny_hf):
    """family -> (HF folder, our config, our float32 params)."""
    out = {}

    def get(name):
        if name not in out:
            family, overrides = FAMILIES[name]
            _, folder = tiny_hf(family, **overrides)
            out[name] = (str(folder), *models.from_pretrained(folder))
        return out[name]

    return get


def random_batch(seed: int, vocab: int = 256) -> dict:
    """B responses to B/G prompts, uids shuffled (groups not contiguous), left-padded prompts,
    right-padded responses with a tool observation (mask 0) at column 1, 0/1 outcome scores
    at the last model token, critic values."""
    rng = np.random.default_rng(seed)
    prompts = np.zeros((B, P), np.int64)
    responses = np.zeros((B, R), np.int64)
    attention = np.zeros((B, P + R), np.int64)
    mask = np.zeros((B, R), np.int64)
    for i in range(B):
        n_p, n_r = rng.integers(2, P + 1), rng.integers(3, R + 1)
        prompts[i, P - n_p :] = rng.integers(1, vocab, n_p)
        responses[i, :n_r] = rng.integers(1, vocab, n_r)
        attention[i, P - n_p : P + n_r] = 1
        mask[i, :n_r] = 1
        mask[i, 1] = 0
    scores = np.zeros((B, R), np.float32)
    last = [np.flatnonzero(mask[i])[-1] for i in range(B)]
    scores[np.arange(B), last] = [1, 0, 1, 1, 0, 0, 1, 0]  # neither group all-equal
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": np.maximum(np.cumsum(attention, axis=1) - 1, 0),
        "response_mask": mask,
        "uid": np.asarray([f"prompt-{g}" for g in rng.permutation(np.repeat(range(B // G), G))]),
        "token_level_scores": scores,
        "token_level_rewards": scores.copy(),
        "values": (0.5 * rng.normal(size=(B, R))).astype(np.float32),
    }


def torch_logp(folder: str, batch: dict) -> np.ndarray:
    """The policy's response log-probs in PyTorch (what a framework stores as old_log_probs)."""
    model = reference.load_model(folder)
    ids = torch.tensor(batch["input_ids"])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.tensor(batch["attention_mask"]),
            position_ids=torch.tensor(batch["position_ids"]),
        ).logits[:, P - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None])[..., 0].numpy()
    return (logp * batch["response_mask"]).astype(np.float32)


def off_policy_batch(folder: str, seed: int) -> dict:
    """A batch whose old and reference log-probs are 0.3-noisy versions of the policy's, so
    ratios clip (both ways), the dual clip binds and the KL is non-zero."""
    batch = random_batch(seed)
    logp = torch_logp(folder, batch)
    rng = np.random.default_rng(seed + 1)
    m = batch["response_mask"]
    batch["old_log_probs"] = ((logp + 0.3 * rng.normal(size=logp.shape)) * m).astype(np.float32)
    batch["ref_log_prob"] = ((logp + 0.3 * rng.normal(size=logp.shape)) * m).astype(np.float32)
    return batch


def update_settings(**algorithm) -> interop.UpdateSettings:
    """An update with these algorithm fields (no KL unless given), torch's AdamW at lr 1e-6."""
    return interop.UpdateSettings(AlgorithmSection(**{"kl_coef": 0.0, **algorithm}))


def grpo_run(folder: str) -> dict:
    """The run config of the GRPO case, as its YAML file reads."""
    return {
        "model": {"path": folder},
        "algorithm": {"adv_estimator": "grpo", "kl_coef": 0.1, "kl_type": "low_var_kl"},
        "optim": {"lr": 1e-6, "grad_clip": None},
    }


def grpo_run_config(folder: str) -> RunConfig:
    return config_from_dict(grpo_run(folder))


def grpo_run_yaml(folder: str, tmp_path: Path) -> Path:
    """The GRPO case's run config written where `repro --config` reads it."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(grpo_run(folder)))
    return path


# (family, settings): every family and every estimator (GRPO with KL in the loss and the dual
# clip; Dr. GRPO with its length-unbiased aggregation; RLOO with an entropy bonus; PPO with
# critic values and GAE). Not all 12 pairs: `jax_update` splits at the log-probs (the model's
# pullback, per family, is applied to the loss's cotangent, per settings), so each family's
# pullback and each estimator's loss are checked here, and each pair costs another model compile
# in CI. All 12 pairs pass the same tolerances (docs/guide/reproducing.md).
CASES = {
    "qwen2-grpo": ("qwen2", None),
    "qwen3-drgrpo": (
        "qwen3",
        update_settings(
            adv_estimator="drgrpo", norm_adv_by_std=False, loss_agg_mode="seq-mean-token-sum-norm"
        ),
    ),
    "llama3-rloo": (
        "llama3",
        update_settings(
            adv_estimator="rloo", loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01
        ),
    ),
    "qwen2-ppo-critic": (
        "qwen2",
        update_settings(adv_estimator="gae", lam=0.95, clip_eps_high=0.28),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_matches_pytorch_reference(policy, case):
    family, settings = CASES[case]
    folder, cfg, params = policy(family)
    if settings is None:
        settings = interop.UpdateSettings.from_run_config(grpo_run_config(folder))
    batch = off_policy_batch(folder, seed=len(case))
    ours = interop.jax_update(cfg, params, batch, settings)
    ref = reference.torch_update(reference.load_model(folder), batch, settings)

    stages = interop.compare_updates(ours, ref, batch["response_mask"])
    assert all(s.ok for s in stages), "\n".join(s.line() for s in stages)
    grads = interop.grad_differences(ours.grads, ref.grads)
    assert set(grads) == set(ref.grads) == set(ours.grads)  # every HF tensor, nothing extra
    assert max(rel for _, _, rel in grads.values()) <= 1e-4
    assert all(n_ref > 0 for _, n_ref, _ in grads.values())  # every parameter has a gradient
    before = to_hf_tensors(cfg, params)
    moved = max(np.abs(ours.params[n] - before[n]).max() for n in before)
    assert max(np.abs(ours.params[n] - ref.params[n]).max() for n in ref.params) <= 1e-6
    assert moved > 0.5 * settings.optim.lr  # Adam's first step moves weights by about lr
    assert np.abs(ours.advantages).max() > 0.1


# TRL's loss types and the verl aggregation each one is (jaxrl_tools/interop/trl_grpo.py).
# TRL has no dual clip: off here, so that the match does not depend on whether it binds.
_NO_DUAL = dict(dual_clip_c=None)
TRL_CASES = {
    "grpo+kl": update_settings(loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, **_NO_DUAL),
    "bnpo": update_settings(loss_agg_mode="token-mean", clip_eps_high=0.28, **_NO_DUAL),
    "dr_grpo": update_settings(
        adv_estimator="drgrpo",
        norm_adv_by_std=False,
        loss_agg_mode="seq-mean-token-sum-norm",
        **_NO_DUAL,
    ),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_trl_grpo_loss_matches_ours(policy, case):
    # TRL's own GRPOTrainer._compute_loss on the off-policy batch (ratios clip both ways).
    folder, cfg, params = policy("qwen2")
    settings = TRL_CASES[case]
    batch = off_policy_batch(folder, seed=3)
    ours = interop.jax_update(cfg, params, batch, settings)
    loss, grads = trl_grpo.trl_loss(folder, batch, settings, ours.advantages)
    scale = trl_grpo.verl_over_trl(settings, B)
    assert scale == (B if case == "dr_grpo" else 1)
    assert loss * scale == pytest.approx(ours.loss, rel=1e-5, abs=1e-7)
    diffs = interop.grad_differences(ours.grads, {n: g * scale for n, g in grads.items()})
    assert set(diffs) == set(ours.grads)
    assert max(rel for _, _, rel in diffs.values()) <= 1e-4
    stages = trl_grpo.compare_with_trl(ours, folder, batch, settings)
    assert all(s.ok for s in stages), "\n".join(s.line() for s in stages)


def test_trl_refuses_what_it_cannot_express():
    for settings, field in (
        (update_settings(loss_agg_mode="seq-mean-token-sum"), "loss_agg_mode"),
        (update_settings(kl_coef=0.1, kl_type="mse"), "kl_type"),
        (update_settings(entropy_coef=0.01), "entropy_coef"),
    ):
        with pytest.raises(ConfigError, match=field):
            trl_grpo.check_settings(settings)


def test_batch_round_trip_is_lossless(tmp_path):
    batch = random_batch(3)
    batch["old_log_probs"] = np.random.default_rng(0).normal(size=(B, R)).astype(np.float32)
    settings = update_settings(adv_estimator="rloo", dual_clip_c=None)
    interop.save_batch(tmp_path / "b.parquet", batch, settings.to_dict(), notes="test")
    loaded, stored = interop.load_batch(tmp_path / "b.parquet")
    assert set(loaded) == set(batch)
    for name, x in batch.items():
        assert loaded[name].dtype == x.dtype, name
        np.testing.assert_array_equal(loaded[name], x, err_msg=name)
    assert interop.UpdateSettings.from_dict(stored) == settings


def test_rollouts_export_in_verl_layout_and_pack_back_to_the_trainers():
    trajs = fixed_trajectories()
    scores = [float(i) for i in range(len(trajs))]
    batch = interop.batch_from_trajectories(trajs, scores)
    interop.check_batch(batch)
    assert list(batch["uid"]) == ["0"] * 4 + ["1"] * 4
    x = interop.packed(batch)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        assert list(x["tokens"][i, :n]) == t.token_ids  # right-padded, as the trainer packs
        assert list(x["positions"][i, :n]) == list(range(n))
        assert x["attention"][i].sum() == n
        assert list(x["loss_mask"][i, :n]) == t.full_loss_mask
        assert x["token_rewards"][i].sum() == scores[i]
        assert x["token_rewards"][i, np.flatnonzero(t.full_loss_mask)[-1]] == scores[i]


def test_a_plain_parquet_of_row_lists_loads(tmp_path):
    """A file written without save_batch (row lists, e.g. pandas over verl's numpy tensors)."""
    batch = random_batch(7)
    columns = {k: list(v) if v.ndim == 2 else v.tolist() for k, v in batch.items()}
    pq.write_table(pa.table(columns), tmp_path / "verl.parquet")
    loaded, settings = interop.load_batch(tmp_path / "verl.parquet")
    assert settings == {}
    for name, x in batch.items():
        np.testing.assert_array_equal(loaded[name], x, err_msg=name)
    assert loaded["token_level_scores"].dtype == np.float32


def test_bad_batches_name_the_field(tmp_path):
    batch = random_batch(4)
    with pytest.raises(DataError, match="missing fields \\['uid'\\]"):
        interop.check_batch({k: v for k, v in batch.items() if k != "uid"})
    short = dict(batch, response_mask=batch["response_mask"][:, :-1])
    with pytest.raises(DataError, match="'response_mask' has shape \\[8, 6\\], expected"):
        interop.save_batch(tmp_path / "b.parquet", short)
    with pytest.raises(DataError, match="unknown fields \\['reward'\\]"):
        interop.check_batch(dict(batch, reward=batch["uid"]))


@pytest.mark.parametrize("estimator", interop.REFERENCE_ESTIMATORS)
def test_advantages_match_the_torch_transcription(estimator):
    batch = random_batch(6)
    settings = update_settings(adv_estimator=estimator, gamma=0.9, lam=0.8)
    ours = interop.advantages_by_uid(batch, settings)
    ref = [x.numpy() * batch["response_mask"] for x in reference.advantages(batch, settings)]
    for name, a, b in zip(("advantages", "returns"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=name)
    assert np.abs(ours[0]).max() > 0.1


def test_uid_groups_equal_contiguous_rows():
    batch = random_batch(5)
    settings = update_settings(adv_estimator="grpo")
    adv, _ = interop.advantages_by_uid(batch, settings)
    order, group_size = algorithms.contiguous_groups(batch["uid"])
    assert group_size == G and sorted(order) == list(range(B))
    sorted_batch = {k: v[order] for k, v in batch.items()}
    adv_sorted, _ = interop.advantages_by_uid(sorted_batch, settings)
    np.testing.assert_array_equal(adv[order], adv_sorted)
    assert np.abs(adv).max() > 0.5  # not the raw scores of groups of one
    with pytest.raises(ValueError, match="groups of sizes \\[1, 3\\]"):
        algorithms.contiguous_groups(["a", "a", "b", "a"])
    with pytest.raises(ValueError, match="set AdvantageConfig.group_size"):
        algorithms.compute_advantages(
            "grpo",
            algorithms.AdvantageInputs(loss_mask_BT=np.ones((4, 3)), scores_B=np.arange(4.0)),
            algorithms.AdvantageConfig(),
        )


def test_hf_tensor_mapping_matches_torch_names(policy):
    folder, cfg, params = policy("qwen3")
    state = {n: p.detach().numpy() for n, p in reference.load_model(folder).named_parameters()}
    ours = to_hf_tensors(cfg, params)
    assert set(ours) == set(state)
    for name, x in state.items():
        np.testing.assert_array_equal(ours[name], x, err_msg=name)
    table = hf_names(cfg)
    assert set(table) == set(state)
    assert table["model.layers.1.mlp.up_proj.weight"] == (("layers", "mlp", "up_proj", "kernel"), 1)
    back = from_hf_tensors(cfg, ours)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_torch_adamw_is_torch_adamw():
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [rng.normal(size=(5, 3)).astype(np.float32) * 10.0**k for k in (-3, 0, 2)]
    opt = torch_adamw(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    w, state = w0, opt.init(w0)
    w_t = torch.nn.Parameter(torch.tensor(w0))
    opt_t = torch.optim.AdamW([w_t], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for g in grads:
        updates, state = opt.update(g, state, w)
        w = w + updates
        w_t.grad = torch.tensor(g)
        opt_t.step()
    np.testing.assert_allclose(np.asarray(w), w_t.detach().numpy(), rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(w) - w0).max() > 1e-2
    with pytest.raises(ValueError, match="decays over total_steps, which is not set"):
        make_optimizer(1e-3, schedule="cosine")


def test_repro_command_passes_and_fails_on_a_perturbed_batch(policy, tmp_path, capsys):
    folder, _, _ = policy("qwen2")
    batch = random_batch(len("qwen2-grpo"))
    batch["old_log_probs"] = torch_logp(folder, batch)  # as a framework exports it
    rng = np.random.default_rng(1)
    batch["ref_log_prob"] = (batch["old_log_probs"] + 0.3 * rng.normal(size=(B, R))).astype(
        np.float32
    ) * batch["response_mask"]
    settings = interop.UpdateSettings.from_run_config(grpo_run_config(folder))
    adv, _ = reference.advantages(batch, settings)
    batch["advantages"] = adv.numpy().astype(np.float32)
    interop.save_batch(tmp_path / "good.parquet", batch, settings.to_dict())
    bad = dict(batch, responses=batch["responses"].copy())
    bad["responses"][0, 0] = (bad["responses"][0, 0] + 1) % 256  # one sampled token differs
    bad["input_ids"] = np.concatenate([bad["prompts"], bad["responses"]], axis=1)
    interop.save_batch(tmp_path / "bad.parquet", bad, settings.to_dict())
    run = ["repro", "--config", str(grpo_run_yaml(folder, tmp_path)), "--batch"]

    assert main([*run, str(tmp_path / "good.parquet"), "--torch", "--trl"]) == 0
    out = capsys.readouterr().out
    for stage in (
        "log-probs vs batch old_log_probs",
        "advantages vs batch",
        "gradients",
        "weights",
        "TRL loss",
        "TRL gradients",
    ):
        assert f"ok   {stage}" in out, out
    assert "model.embed_tokens.weight" in out  # the per-parameter gradient norms

    assert main([*run, str(tmp_path / "bad.parquet")]) == 1
    assert "FAIL log-probs vs batch old_log_probs" in capsys.readouterr().out

    assert main([*run, str(tmp_path / "missing.parquet")]) == 2
    assert "missing.parquet" in capsys.readouterr().err

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({"tokenizer": {"path": folder}}))
    no_checkpoint = ["repro", "--config", str(tmp_path / "tiny.yaml"), "--batch"]
    assert main([*no_checkpoint, str(tmp_path / "good.parquet")]) == 2
    assert "set model.path" in capsys.readouterr().err
