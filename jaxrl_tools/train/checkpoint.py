"""Orbax checkpoints of the whole training state: params, optimizer state, step, RNG, data iterator.

A checkpoint is a folder per step under `directory`, written asynchronously every `every` steps,
keeping the `keep` newest. `restore` checks the stored shapes against the run's own state first,
so a checkpoint of another model is an error naming the parameter and both shapes.
"""

import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores (state pytree, JSON-able extras) pairs by step.

    Args:
      directory: where step folders go (created if missing).
      every: save only on steps that are multiples of this (`force=True` overrides).
      keep: how many of the newest checkpoints to keep.
      async_save: write in a background thread while training goes on.
    """

    def __init__(self, directory: str, *, every: int = 100, keep: int = 3, async_save: bool = True):
        self.directory = epath.Path(directory).absolute()
        self.every = max(1, every)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=1,  # `save` applies `every` itself (orbax saves step 1)
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
            ),
            # Registered up front: a fresh manager (a resumed run) can read the stored tree's
            # metadata (shapes) before restoring.
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "extras": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self, step: int, state: Any, extras: Mapping[str, Any], *, force: bool = False
    ) -> bool:
        """Saves `state` (arrays) and `extras` (JSON: data iterator state, metrics) at `step`.

        Returns:
          Whether a save started: `step` is a multiple of `every`, or `force`.
        """
        if step % self.every and not force:
            return False
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), extras=ocp.args.JsonSave(dict(extras))
            ),
            force=force,
        )
        if saved:
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return saved

    def restore(self, state_like: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """Restores the checkpoint at `step` (default: latest) into the structure of `state_like`.

        `state_like` gives shapes, dtypes and shardings (arrays or ShapeDtypeStructs); restored
        arrays take its shardings.

        Raises:
          FileNotFoundError: there is no checkpoint in the directory.
          ValueError: the checkpoint's tree or shapes differ from `state_like`.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        stored = self._manager.item_metadata(step)["state"]
        if stored is None:
            raise ValueError(f"checkpoint {self.directory}/{step} has no readable 'state' item")
        _check_compatible(stored, state_like, f"{self.directory}/{step}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            state_like,
        )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), extras=ocp.args.JsonRestore()
            ),
        )
        return step, restored["state"], dict(restored["extras"] or {})

    def wait(self) -> None:
        """Blocks until asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _check_compatible(stored: Any, expected: Any, where: str) -> None:
    stored_leaves = dict(_flat_shapes(stored))
    expected_leaves = dict(_flat_shapes(expected))
    missing = sorted(set(expected_leaves) - set(stored_leaves))
    extra = sorted(set(stored_leaves) - set(expected_leaves))
    if missing or extra:
        raise ValueError(
            f"checkpoint {where} does not match this run's state: missing {missing[:5]}, "
            f"unexpected {extra[:5]} (a checkpoint of another model or algorithm?)"
        )
    for key, shape in expected_leaves.items():
        if tuple(stored_leaves[key]) != tuple(shape):
            raise ValueError(
                f"checkpoint {where}: {key} has shape {tuple(stored_leaves[key])} in the "
                f"checkpoint but {tuple(shape)} in this run (a checkpoint of another model shape?)"
            )


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat_shapes(tree: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(dotted path, shape) of each array leaf.

    Paths are dotted names ("actor.params.embed.embedding", "actor.opt_state.1.0.mu. ..."), the
    same whether the tree is the run's own (dataclasses, named tuples) or the checkpoint's
    metadata (nested dicts and lists), as orbax names the stored arrays.
    """
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and not isinstance(x, Mapping)
    )[0]
    return [
        (
            ".".join(_key_name(k) for k in p),
            tuple(np.shape(x) if not hasattr(x, "shape") else x.shape),
        )
        for p, x in leaves
    ]
