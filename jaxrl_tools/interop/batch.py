"""A training batch as a parquet file with verl's field names, layout and meanings.

One row per response. B responses, P prompt columns (left-padded), R response columns
(right-padded), exactly as verl's ``DataProto`` holds them after a rollout:

  prompts              [B, P] int      prompt token ids, left-padded
  responses            [B, R] int      response token ids (model and tool-observation tokens),
                                       right-padded
  input_ids            [B, P+R] int    prompts, then responses
  attention_mask       [B, P+R] int    1 on real tokens, 0 on padding
  position_ids         [B, P+R] int    rotary positions: 0 at the first real token, +1 per real
                                       token
  response_mask        [B, R] int      1 on the tokens the policy is trained on (model tokens),
                                       0 on padding and tool observations
  uid                  [B] str         group id: the responses to one prompt share it
  token_level_scores   [B, R] float32  reward before any KL penalty; an outcome reward sits at
                                       the last model token
  token_level_rewards  [B, R] float32  the reward the estimator reads (scores − β·KL when the
                                       KL is in the reward, else the scores)
  old_log_probs        [B, R] float32  log π_old(response token | all before it), tempered, by
                                       the policy before the update
  ref_log_prob         [B, R] float32  the same under the reference policy (KL)
  values               [B, R] float32  critic value of the state in which the token is chosen
  advantages           [B, R] float32  the estimator's advantages (0 where response_mask is 0)
  returns              [B, R] float32  the critic's targets (= advantages without a critic)

Required: the first seven and one of ``token_level_scores`` / ``token_level_rewards``; the rest
are optional: ``ref_log_prob`` and ``values`` feed the KL and GAE, and ``jaxrl-tools repro``
checks ``old_log_probs``, ``advantages`` and ``returns`` against its recomputation. Arrays
keep their exact dtypes (float32 lists stay float32), so save -> load is lossless. The file's
schema metadata (key ``jaxrl_tools.interop``) holds the settings that produced the batch
(``UpdateSettings`` as a dict) and free-form notes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxrl_tools.data import DataError
from jaxrl_tools.types import Trajectory

META_KEY = b"jaxrl_tools.interop"
FORMAT_VERSION = 1

# field -> (columns: "P", "R", "P+R" or "" for one value per row, integer?)
FIELDS: dict[str, tuple[str, bool]] = {
    "prompts": ("P", True),
    "responses": ("R", True),
    "input_ids": ("P+R", True),
    "attention_mask": ("P+R", True),
    "position_ids": ("P+R", True),
    "response_mask": ("R", True),
    "uid": ("", False),
    "token_level_scores": ("R", False),
    "token_level_rewards": ("R", False),
    "old_log_probs": ("R", False),
    "ref_log_prob": ("R", False),
    "values": ("R", False),
    "advantages": ("R", False),
    "returns": ("R", False),
}
REQUIRED = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "uid",
)


def check_batch(batch: dict[str, np.ndarray], where: str = "batch") -> tuple[int, int, int]:
    """(B, P, R) of a verl-layout batch; a missing, unknown or misshapen field is a DataError
    naming it and the expected shape."""
    unknown = sorted(set(batch) - set(FIELDS))
    if unknown:
        raise DataError(f"{where}: unknown fields {unknown}; the fields are {list(FIELDS)}")
    missing = [f for f in REQUIRED if f not in batch]
    if "token_level_scores" not in batch and "token_level_rewards" not in batch:
        missing.append("token_level_scores or token_level_rewards")
    if missing:
        raise DataError(f"{where}: missing fields {missing} (see jaxrl_tools.interop.batch)")
    B, P = np.shape(batch["prompts"])
    R = np.shape(batch["responses"])[1]
    widths = {"P": P, "R": R, "P+R": P + R}
    for name, value in batch.items():
        cols, integer = FIELDS[name]
        want = (B, widths[cols]) if cols else (B,)
        if np.shape(value) != want:
            raise DataError(
                f"{where}: field {name!r} has shape {list(np.shape(value))}, expected "
                f"[B, {cols or '-'}] = {list(want)} (B, P, R from prompts and responses)"
            )
        x = np.asarray(value)
        mask_like = name.endswith("mask") and np.isin(x, (0, 1)).all()  # verl may store floats
        if integer and not (np.issubdtype(x.dtype, np.integer) or mask_like):
            raise DataError(f"{where}: field {name!r} must hold integers (token ids or 0/1)")
    ids = np.concatenate([batch["prompts"], batch["responses"]], axis=1)
    if not np.array_equal(ids, batch["input_ids"]):
        raise DataError(f"{where}: input_ids is not prompts followed by responses")
    return B, P, R


def save_batch(
    path: str | os.PathLike,
    batch: dict[str, np.ndarray],
    settings: dict | None = None,
    notes: str = "",
) -> None:
    """Writes a verl-layout batch (fields of ``FIELDS``) and its settings to a parquet file."""
    B, _, _ = check_batch(batch, os.fspath(path))
    columns, shapes = {}, {}
    for name, value in batch.items():
        x = np.asarray(value)
        shapes[name] = [list(x.shape), x.dtype.str]
        if x.ndim == 1:
            columns[name] = pa.array(x.astype(str) if name == "uid" else x)
        else:
            flat = pa.array(np.ascontiguousarray(x).reshape(-1))
            columns[name] = pa.FixedSizeListArray.from_arrays(flat, x.shape[1])
    meta = {"version": FORMAT_VERSION, "settings": settings or {}, "notes": notes, "B": B}
    meta["arrays"] = shapes
    table = pa.table(columns).replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    pq.write_table(table, os.fspath(path))


def load_batch(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """(batch, settings) from a file of ``save_batch`` or any parquet file with verl's column
    names (one row per response, list columns); a missing or bad field is a DataError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"batch file {path!r} does not exist")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a parquet file ({e})") from None
    meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"{}"))
    dtypes = {k: np.dtype(v[1]) for k, v in meta.get("arrays", {}).items()}
    batch = {}
    for name in table.column_names:
        if name not in FIELDS:
            continue  # verl's non-tensor extras (data_source, reward_model, ...) are not used
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
            flat = col.flatten().to_numpy(zero_copy_only=False)
            lengths = set(col.value_lengths().to_pylist())
            if len(lengths) > 1:
                raise DataError(f"{path}: field {name!r} has rows of lengths {sorted(lengths)}")
            x = flat.reshape(len(col), -1)
        else:
            x = col.to_numpy(zero_copy_only=False)
        if name == "uid":
            x = x.astype(str)
        batch[name] = x.astype(dtypes[name]) if name in dtypes else x
    check_batch(batch, path)
    return batch, meta.get("settings", {})


def response_columns(batch: dict[str, np.ndarray]) -> np.ndarray:
    """[B, R] column of each response token in the trainer's packed row: the prompt's real
    tokens move to the front (the trainer's rows are right-padded), so response token r of a row
    whose prompt has n real tokens sits at column n + r."""
    B, P, R = check_batch(batch)
    prompt_att = np.asarray(batch["attention_mask"])[:, :P] > 0
    n = prompt_att.sum(axis=1)
    left_padded = np.arange(P)[None, :] >= (P - n)[:, None]
    if not np.array_equal(prompt_att, left_padded):
        raise DataError(
            "batch: the prompts' attention_mask must be 0 on the left padding and 1 on the "
            "prompt (verl's left-padded prompts)"
        )
    return n[:, None] + np.arange(R)[None, :]


def spread_responses(x_BR: np.ndarray, columns_BR: np.ndarray, width: int) -> np.ndarray:
    """[B, R] per-response-token values into packed [B, width] rows (0 elsewhere), float32."""
    out = np.zeros((x_BR.shape[0], width), np.float32)
    np.put_along_axis(out, columns_BR, np.asarray(x_BR, np.float32), axis=1)
    return out


def packed(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trainer's layout: [B, P+R] rows of prompt then response, right-padded, per-token
    values aligned to the token they score and 0 on the prompt (``train.policy``): tokens,
    positions, attention, loss_mask, token_rewards and any of old_logp, ref_logp, values,
    advantages, returns present. ``response_columns`` maps the [B, R] fields in and out."""
    B, P, R = check_batch(batch)
    cols = response_columns(batch)
    n = cols[:, 0]
    # Row i: its n_i prompt tokens, the R response columns, then the P - n_i left-pad columns.
    order = (np.arange(P + R)[None, :] + (P - n)[:, None]) % (P + R)
    take = lambda x: np.take_along_axis(np.asarray(x), order, axis=1).astype(np.int32)
    spread = lambda x_BR: spread_responses(x_BR, cols, P + R)
    out = {
        "tokens": take(batch["input_ids"]),
        "positions": take(batch["position_ids"]),
        "attention": take(batch["attention_mask"]),
        "loss_mask": spread(batch["response_mask"]),
        "token_rewards": spread(token_level_rewards(batch)),
    }
    renames = {
        "old_log_probs": "old_logp",
        "ref_log_prob": "ref_logp",
        "values": "values",
        "advantages": "advantages",
        "returns": "returns",
    }
    for verl_name, ours in renames.items():
        if verl_name in batch:
            out[ours] = spread(batch[verl_name])
    return out


def token_level_rewards(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The reward the estimator reads: ``token_level_rewards``, else ``token_level_scores``."""
    key = "token_level_rewards" if "token_level_rewards" in batch else "token_level_scores"
    return np.asarray(batch[key], np.float32)


def batch_from_trajectories(
    trajectories: Sequence[Trajectory], scores: Sequence[float], *, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """A verl-layout batch from this library's rollouts: prompts left-padded, responses
    right-padded, the outcome score at the last model token, ``uid`` = the prompt index."""
    P = max(len(t.prompt_ids) for t in trajectories)
    R = max(len(t.response_ids) for t in trajectories)
    B = len(trajectories)
    prompts = np.full((B, P), pad_id, np.int64)
    responses = np.full((B, R), pad_id, np.int64)
    attention = np.zeros((B, P + R), np.int64)
    response_mask = np.zeros((B, R), np.int64)
    scores_BR = np.zeros((B, R), np.float32)
    for i, t in enumerate(trajectories):
        n_p, n_r = len(t.prompt_ids), len(t.response_ids)
        prompts[i, P - n_p :] = t.prompt_ids
        responses[i, :n_r] = t.response_ids
        attention[i, P - n_p : P + n_r] = 1
        response_mask[i, :n_r] = t.loss_mask
        model_tokens = np.flatnonzero(response_mask[i])
        if model_tokens.size:
            scores_BR[i, model_tokens[-1]] = scores[i]
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": np.maximum(np.cumsum(attention, axis=1) - 1, 0),
        "response_mask": response_mask,
        "uid": np.asarray([str(t.prompt_index) for t in trajectories]),
        "token_level_scores": scores_BR,
        "token_level_rewards": scores_BR.copy(),
    }
