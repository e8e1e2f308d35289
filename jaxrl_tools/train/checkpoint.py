"""Orbax checkpoints of the whole training state: params, optimizer state, step, RNG, data iterator.

A checkpoint is a folder per step under `directory`, written asynchronously every `every` steps,
keeping the `keep` newest. `restore` checks the stored shapes against the run's own state first,
so a checkpoint of another model is an error naming the parameter and both shapes; it skips an
unreadable newest checkpoint (a disk that filled up, a copy cut short) for the newest readable
one. The run that trains into a folder locks it (`lock=True`): a second one is refused.
"""

import fcntl
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from jaxrl_tools import sharding
from jaxrl_tools.config import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"  # in the checkpoint folder; holds the holder's pid and host


class CheckpointError(ConfigError):
    """A checkpoint folder the run cannot use (another run holds it, its checkpoints are of
    another model or algorithm, or none can be read): one line naming it and the fix."""


class _Unreadable(ValueError):
    """A checkpoint that the checks before orbax's read find broken (the message says how)."""


class Checkpointer:
    """Saves and restores (state pytree, JSON-able extras) pairs by step.

    Args:
      directory: where step folders go (created if missing).
      every: save only on steps that are multiples of this (`force=True` overrides).
      keep: how many of the newest checkpoints to keep.
      async_save: write in a background thread while training goes on.
      lock: hold the folder for this object's life (the run that trains into it; readers such as
        eval or export do not): another run on it is refused (`CheckpointError`), and `restore`
        moves an unreadable checkpoint aside so that its step can be saved again.

    Raises:
      CheckpointError: with `lock`, a live run holds the folder.
    """

    def __init__(
        self,
        directory: str,
        *,
        every: int = 100,
        keep: int = 3,
        async_save: bool = True,
        lock: bool = False,
    ):
        self.directory = epath.Path(directory).absolute()
        self.every = max(1, every)
        self._lock = _lock_folder(self.directory) if lock else None
        self.holds_folder = lock
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
        """Restores the checkpoint at `step` (default: the newest readable one) into the
        structure of `state_like`.

        `state_like` gives shapes, dtypes and shardings (arrays or ShapeDtypeStructs); restored
        arrays take its shardings. A newer checkpoint orbax cannot read (no tree metadata, array
        files cut short) is skipped with one warning line; the holder of the folder (`lock`)
        moves it aside, to `<step>.unreadable`.

        Raises:
          FileNotFoundError: there is no checkpoint in the directory.
          CheckpointError: the checkpoint's tree or shapes differ from `state_like`, or no
            checkpoint (or `step`'s) can be read.
        """
        steps = sorted(self.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        skipped: list[tuple[int, str]] = []
        for s in steps:
            reason = None
            try:
                restored = self._restore(s, state_like)
            except CheckpointError:  # another model or algorithm: older ones are no better
                raise
            except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
                reason = _reason(e)
            # The processes of a job move on together (each reads its own shards).
            reason = next((r for r in sharding.agree(reason) if r is not None), None)
            if reason is None:
                break
            skipped.append((s, reason))
        else:
            where = "; ".join(f"step {s}: {r}" for s, r in skipped)
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} ({where}): restore another step, "
                "or give trainer.checkpoint_dir a new folder to start over"
            )
        for bad, reason in skipped:
            aside = self._set_aside(bad) if self.holds_folder else None
            log.warning(
                "checkpoint: step %d in %s is unreadable (%s); restoring step %d instead%s",
                *(bad, self.directory, reason, s),
                f" (moved to {aside})" if aside else "",
            )
        return s, restored["state"], dict(restored["extras"] or {})

    def _restore(self, step: int, state_like: Any) -> dict:
        # Cheap checks before orbax reads anything: orbax's own of the item folder (tree metadata
        # and array files there; item_metadata would log a warning of its own), then the data
        # files' lengths (a failed read prints a traceback per pending read of orbax's).
        item = self.directory / str(step) / "state"
        if not ocp.path.format_utils.is_pytree_checkpoint(item):
            raise _Unreadable("its 'state' item has no tree metadata or no array files")
        _check_data_files(item)
        stored = self._manager.item_metadata(step)["state"]
        if stored is None:
            raise _Unreadable("its 'state' item has no readable tree metadata")
        _check_compatible(stored, state_like, f"{self.directory}/{step}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            state_like,
        )
        return self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), extras=ocp.args.JsonRestore()
            ),
        )

    def _set_aside(self, step: int) -> epath.Path:
        """Renames step `step`'s folder out of orbax's sight (kept for a look, not re-read), so
        the resumed run can save that step again."""
        src, n = self.directory / str(step), 0
        dst = src.parent / f"{step}.unreadable"
        while dst.exists():
            n += 1
            dst = src.parent / f"{step}.unreadable.{n}"
        if sharding.is_main_process():
            src.rename(dst)
        sharding.agree(None)  # every process sees the rename before orbax lists the steps again
        self._manager.reload()
        return dst

    def wait(self) -> None:
        """Blocks until asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        if self._lock is not None:
            os.close(self._lock)  # releases the folder
            self._lock = None


def _reason(error: BaseException) -> str:
    """The root cause of an orbax / tensorstore error, on one short line."""
    if isinstance(error, _Unreadable):
        return str(error)
    while error.__cause__ is not None:
        error = error.__cause__
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:200]}"


def _check_data_files(item: epath.Path) -> None:
    """Raises _Unreadable when a B-tree node or chunk that the item's OCDBT index points to lies
    past the end of its file (a file cut short or missing: a full disk, an interrupted copy).

    Reads the index only (tensorstore's `ocdbt.dump`), not the arrays.
    """
    if not ocp.path.format_utils.is_ocdbt_checkpoint(item):
        return
    url = str(item) if "://" in str(item) else f"file://{item}"
    store = ts.KvStore.open(url.rstrip("/") + "/").result()
    versions = ts.ocdbt.dump(store).result()["versions"]
    todo = [versions[-1]["root"].get("location")] if versions else []
    lengths: dict[epath.Path, int] = {}
    while todo:
        location = todo.pop()
        if location is None:  # an empty tree
            continue
        # "btreenode:<prefix>:<file>:<offset>:<length>", "value:<prefix>:<file>:<offset>:<length>"
        kind, prefix, rest = location.split(":", 2)
        name, offset, length = rest.rsplit(":", 2)
        path = item / prefix / name
        if path not in lengths:
            lengths[path] = path.stat().length if path.exists() else -1
        if lengths[path] < int(offset) + int(length):
            missing = "missing" if lengths[path] < 0 else f"{lengths[path]} bytes, cut short"
            raise _Unreadable(f"its file {path.relative_to(item.parent)} is {missing}")
        if kind == "btreenode":
            for entry in ts.ocdbt.dump(store, location).result()["entries"]:
                todo += [
                    v
                    for v in entry.values()
                    if isinstance(v, str) and v.startswith(("btreenode:", "value:"))
                ]


def _lock_folder(directory: epath.Path) -> int | None:
    """An exclusive `flock` on `directory/run.lock`, held while the returned descriptor is open.

    The kernel drops the lock when the holder ends, however it ends (kill -9, a crash), so no
    stale lock is left behind. A job's processes share the folder: process 0 alone takes the
    lock (on NFS, flock works across hosts) and the others learn whether it got it. Object stores
    (gs://) have no locks: none is taken there.

    Raises:
      CheckpointError: another live run holds it (the message names it: pid and host).
    """
    fd = holder = None
    if sharding.is_main_process() and "://" not in str(directory):
        directory.mkdir(parents=True, exist_ok=True)
        path = os.path.join(directory, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by subprocesses
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "holder unknown"
        except OSError as e:  # a file system without locks
            log.warning("checkpoint: cannot lock %s (%s): a second run is not refused", path, e)
            os.close(fd)
            fd = None
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        if holder is not None:
            os.close(fd)
            fd = None
    holder = sharding.agree(holder)[0]
    if holder is not None:
        raise CheckpointError(
            f"trainer.checkpoint_dir {directory} is in use by a live run ({holder}): wait for it "
            "to end or stop it, or give this run another trainer.checkpoint_dir"
        )
    return fd


def _check_compatible(stored: Any, expected: Any, where: str) -> None:
    stored_leaves = dict(_flat_shapes(stored))
    expected_leaves = dict(_flat_shapes(expected))
    missing = sorted(set(expected_leaves) - set(stored_leaves))
    extra = sorted(set(stored_leaves) - set(expected_leaves))
    fix = "use the config of the run that wrote it, or another trainer.checkpoint_dir"
    if not extra and {m.split(".")[0] for m in missing} == {"step", "rng"}:
        raise CheckpointError(
            f"checkpoint {where} was written by an older jaxrl-tools, before the RL state kept its "
            "step and random key: resume it with the version that wrote it, or start this run "
            "in another trainer.checkpoint_dir"
        )
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {where} does not match this run's state: missing {missing[:5]}, "
            f"unexpected {extra[:5]} (a checkpoint of another model or algorithm?): {fix}"
        )
    for key, shape in expected_leaves.items():
        if tuple(stored_leaves[key]) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {where}: {key} has shape {tuple(stored_leaves[key])} in the "
                f"checkpoint but {tuple(shape)} in this run (a checkpoint of another model "
                f"shape?): {fix}"
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
