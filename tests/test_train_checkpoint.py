"""Checkpoints: exact round trips of the whole state, keep-K pruning, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import tiny_model_config

from jaxrl_tools import models
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


def test_restoring_from_an_empty_directory_is_file_not_found(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore({"actor": trained_state(tiny())})
    ckpt.close()
