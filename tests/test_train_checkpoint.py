"""Checkpoints: exact round trips of the whole state, keep-K pruning, clear errors, unreadable
checkpoints skipped, one run per folder."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import tiny_model_config

from jaxrl_tools import models
from jaxrl_tools.config import ConfigError
from jaxrl_tools.train.checkpoint import Checkpointer
from jaxrl_tools.train.state import apply_update, create_train_state, make_optimizer

tiny = tiny_model_config


def trained_state(config: models.ModelConfig, seed: int = 0):
    """A state one update in: non-trivial params, Adam moments, counters and rng."""
    optimizer = make_optimizer(1e-2, total_steps=10)
    params = models.init_params(config, jax.random.key(seed))
    state = create_train_state(params, optimizer, seed=seed + 7)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    state, _ = apply_update(state, grads, optimizer)
    return state


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_restores_everything_exactly(tmp_path):
    state = {"actor": trained_state(tiny()), "ref": models.init_params(tiny(), jax.random.key(3))}
    extras = {"data": {"next_index": 5, "epoch": 1}, "rollout_calls": 3, "metrics": {"a": 0.5}}
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    assert ckpt.save(4, state, extras)
    ckpt.close()

    # A fresh run: the same structure, other values.
    like = {
        "actor": trained_state(tiny(), seed=1),
        "ref": models.init_params(tiny(), jax.random.key(9)),
    }
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    step, restored, restored_extras = ckpt.restore(like)
    ckpt.close()
    assert step == 4
    assert_trees_equal(restored, state)  # params, Adam mu/nu and counts, step, rng, ref
    assert int(restored["actor"].step) == 1
    np.testing.assert_array_equal(restored["actor"].rng, state["actor"].rng)
    assert restored_extras == extras


def test_keeps_the_newest_k_and_saves_on_multiples_of_every(tmp_path):
    state = {"actor": trained_state(tiny())}
    ckpt = Checkpointer(str(tmp_path), every=2, keep=2, async_save=False)
    saved = [s for s in range(1, 8) if ckpt.save(s, state, {"step": s})]
    assert saved == [2, 4, 6]
    assert ckpt.save(7, state, {"step": 7}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    _, _, extras = ckpt.restore(state, step=6)
    assert extras == {"step": 6}
    ckpt.close()


def test_checkpoint_of_another_model_shape_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every=1)
    ckpt.save(1, {"actor": trained_state(tiny(64))}, {})
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path), every=1)
    with pytest.raises(ValueError) as err:
        ckpt.restore({"actor": trained_state(tiny(96))})
    ckpt.close()
    msg = str(err.value)
    assert "actor.params.layers.mlp.down_proj.kernel" in msg, msg  # names the parameter
    assert "(2, 64, 32)" in msg and "(2, 96, 32)" in msg, msg  # and both shapes


def test_checkpoint_of_another_tree_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every=1)
    ckpt.save(1, {"actor": trained_state(tiny())}, {})
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path), every=1)
    with pytest.raises(ValueError, match="missing.*critic"):
        ckpt.restore({"actor": trained_state(tiny()), "critic": {"w": jnp.zeros(3)}})
    ckpt.close()


def test_a_checkpoint_from_before_the_rl_state_says_so(tmp_path):
    """Checkpoints written before the RL state kept its step and key (the actor alone)."""
    ckpt = Checkpointer(str(tmp_path), every=1)
    ckpt.save(1, {"actor": trained_state(tiny())}, {"rollout_calls": 1})
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path), every=1)
    now = {"actor": trained_state(tiny()), "step": jnp.zeros((), jnp.int32), "rng": jnp.zeros(2)}
    with pytest.raises(ValueError, match="older jaxrl-tools.*another trainer.checkpoint_dir"):
        ckpt.restore(now)
    ckpt.close()


def test_restoring_from_an_empty_directory_is_file_not_found(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore({"actor": trained_state(tiny())})
    ckpt.close()


def _two_checkpoints(directory) -> dict:
    state = {"actor": trained_state(tiny())}
    ckpt = Checkpointer(str(directory), every=1, async_save=False)
    for step in (1, 2):
        ckpt.save(step, state, {"step": step})
    ckpt.close()
    return state


def _damage(step_dir, how: str) -> None:
    if how == "truncated arrays":  # a disk that filled up, a copy cut short
        for f in step_dir.glob("state/ocdbt.process_*/d/*"):
            os.truncate(f, 10)
    else:
        (step_dir / "state" / "_METADATA").unlink()


@pytest.mark.parametrize("how", ["truncated arrays", "no _METADATA"])
def test_an_unreadable_newest_checkpoint_is_skipped_with_one_line(tmp_path, caplog, how):
    state = _two_checkpoints(tmp_path)
    _damage(tmp_path / "2", how)
    ckpt = Checkpointer(str(tmp_path), every=1, async_save=False)
    with caplog.at_level(logging.WARNING):
        step, restored, extras = ckpt.restore(state)
    ckpt.close()
    assert step == 1 and extras == {"step": 1}
    assert_trees_equal(restored, state)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert f"step 2 in {tmp_path}" in warnings[0] and "restoring step 1 instead" in warnings[0]
    assert (tmp_path / "2").is_dir()  # a reader (eval, export) leaves the folder as it is


def test_the_run_that_holds_the_folder_sets_an_unreadable_checkpoint_aside(tmp_path):
    state = _two_checkpoints(tmp_path)
    _damage(tmp_path / "2", "truncated arrays")
    ckpt = Checkpointer(str(tmp_path), every=1, async_save=False, lock=True)
    step, _, _ = ckpt.restore(state)
    assert step == 1 and ckpt.all_steps() == [1]
    assert ckpt.save(2, state, {"step": 2})  # the resumed run saves its step 2 again
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["1", "2", "2.unreadable"]


def test_no_readable_checkpoint_is_one_line_naming_the_folder(tmp_path):
    state = _two_checkpoints(tmp_path)
    for step in ("1", "2"):
        _damage(tmp_path / step, "no _METADATA")
    ckpt = Checkpointer(str(tmp_path), every=1)
    with pytest.raises(ConfigError) as err:
        ckpt.restore(state)
    ckpt.close()
    msg = str(err.value)
    assert "\n" not in msg and f"no readable checkpoint in {tmp_path}" in msg, msg


# A run holding a checkpoint folder, in another process (killed with SIGKILL by the test).
HOLD = """
import sys, time
from jaxrl_tools.train.checkpoint import Checkpointer
Checkpointer(sys.argv[1], lock=True)
print("holding", flush=True)
time.sleep(600)
"""


def test_a_live_folder_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(ConfigError) as err:
            Checkpointer(str(tmp_path), lock=True)
        msg = str(err.value)
        assert "\n" not in msg and str(tmp_path) in msg and f"pid {holder.pid} on " in msg, msg
        Checkpointer(str(tmp_path)).close()  # readers (eval, export, serve) take no lock
    finally:
        holder.kill()  # SIGKILL: no clean-up runs
        holder.wait()
    Checkpointer(str(tmp_path), lock=True).close()  # the kernel dropped the dead run's lock
