"""Batches in and out, and one update compared across frameworks (reproducibility studies).

  batch      the interchange format: verl's field names and layout in a parquet file
             (``FIELDS``, ``save_batch``, ``load_batch``, ``batch_from_trajectories``, ``packed``)
  update     ``UpdateSettings`` (the run's own algorithm and optim sections) and
             ``jax_update``: one update through the trainer's own objective code
  reference  ``torch_update``: the same update in PyTorch with verl's formulas (imports torch
             when called; import ``jaxrl_tools.interop.reference`` explicitly)
  compare    per-stage differences and the tolerances they are held to
  trl_grpo   ``trl_loss`` / ``compare_with_trl``: TRL's own GRPO loss on the batch (imports trl
             when called; import ``jaxrl_tools.interop.trl_grpo`` explicitly)

``jaxrl-tools repro --config X --batch B.parquet [--torch] [--trl]`` drives them
(docs/guide/reproducing.md).
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.interop.batch import (
        FIELDS,
        REQUIRED,
        batch_from_trajectories,
        check_batch,
        load_batch,
        packed,
        save_batch,
    )
    from jaxrl_tools.interop.compare import (
        BF16,
        FP32,
        Stage,
        Tolerances,
        compare_updates,
        compare_with_batch,
        format_grad_table,
        grad_differences,
    )
    from jaxrl_tools.interop.update import (
        REFERENCE_ESTIMATORS,
        UpdateResult,
        UpdateSettings,
        advantages_by_uid,
        jax_update,
    )

__all__ = [
    "BF16",
    "FIELDS",
    "FP32",
    "REFERENCE_ESTIMATORS",
    "REQUIRED",
    "Stage",
    "Tolerances",
    "UpdateResult",
    "UpdateSettings",
    "advantages_by_uid",
    "batch_from_trajectories",
    "check_batch",
    "compare_updates",
    "compare_with_batch",
    "format_grad_table",
    "grad_differences",
    "jax_update",
    "load_batch",
    "packed",
    "save_batch",
]

__getattr__, __dir__ = lazy_api(__name__)
