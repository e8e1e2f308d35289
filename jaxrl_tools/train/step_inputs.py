"""A `Batch` (host arrays) as the RL step's input: the step's rows, the estimator's view and the
layout between them (`train.step`), built on the host with NumPy.

  rows       [P, T] "tokens", "positions", "attention", "loss_mask" (+ "behaviour_logp" with
             `algorithm.tis_cap`, "correct" with VAPO's NLL term): the padded rows, or with
             `optim.pack` the sequences packed back to back ("attention" then holds segment ids;
             `train.packing`), P rounded up to mini-batches x micro-batches; with
             `optim.share_prefix` each group's prompt once in a prompt slot before its samples'
             slots ("prompt_keys" [P, N, S]: the prompt-slot tokens each sample slot sees).
  estimator  what the advantage estimator reads: "scores_B", "row_mask_B" (1 on real rows: the
             count of real rows is data, not a shape) and the per-turn inputs or baseline the
             estimator declares; windowed episodes give one entry per turn ([E, S], with their
             own "loss_mask_BT").
  layout     packed rows: "src_PT", "dst_RT" (where every token went) and the padded
             "loss_mask_RT"; windowed episodes: "turn_slot_R" (each row's turn entry).

Every array has a leading axis of rows, packed rows or episodes, so one sharding places them all.
"""

from __future__ import annotations

import numpy as np

from jaxrl_tools import algorithms
from jaxrl_tools.train.packing import plan_packing, plan_shared_packing, slot_width
from jaxrl_tools.types import Batch

f32 = np.float32


def _estimator_view(batch: Batch, estimator: str, group_size: int) -> dict[str, np.ndarray]:
    """The estimator's inputs: padded rows, or windowed episodes as [E, S] turn entries."""
    reads = algorithms.estimator_inputs(estimator)
    if batch.turn_slot_R is not None:  # one entry per turn, each turn's "token"
        E, S = batch.step_mask_RS.shape
        turns = np.zeros(E * S, f32)
        turns[batch.turn_slot_R[batch.turn_slot_R >= 0]] = 1.0
        view = {"loss_mask_BT": turns.reshape(E, S), "scores_B": batch.episode_scores_E}
        real, token_step = batch.num_episodes, np.tile(np.arange(S, dtype=np.int32), (E, 1))
    else:
        view = {"scores_B": batch.scores_R}
        real, token_step = batch.num_rows, batch.token_step_RT
    rows = view["scores_B"].shape[0]
    if algorithms.uses_group_baseline(estimator) and real % group_size:
        raise ValueError(
            f"the batch has {real} real rows, not whole groups of {group_size}: padding rows "
            "must come in whole groups at the end (train.batch pads kept groups)"
        )
    view["row_mask_B"] = (np.arange(rows) < real).astype(f32)
    # Per-turn inputs (GiGPO, Kevin) and the greedy baseline (ReMax), where the estimator reads
    # them; a required one the batch lacks fails in compute_advantages, naming it.
    for key, value in (
        ("step_rewards_BS", batch.step_rewards_RS),
        ("step_mask_BS", batch.step_mask_RS),
        ("anchor_ids_BS", batch.anchor_ids_RS),
        ("token_step_BT", token_step),
        ("baseline_B", batch.baseline_R),
    ):
        if value is not None and key in reads:
            view[key] = value
    return view


def step_inputs(
    batch: Batch, settings, slots: tuple[int, int] = (0, 0)
) -> tuple[dict, dict[str, float]]:
    """(the step's input arrays, host metrics) of `batch` (module docstring).

    Args:
      batch: the scored, padded batch (`train.batch.make_batch`).
      settings: the step's `train.step.StepSettings`.
      slots: with shared prompts, the least prompt and sample slot widths (`shared_slots` of
        an earlier step's inputs: the same shapes, compiled once, while batches fit them).

    Returns:
      ({"rows": ..., "estimator": ..., "layout": ...} of NumPy arrays ("layout" only when there
      is one), {"packing/rows", "packing/fill"} with packing, else {}).

    Raises:
      ValueError: padding rows inside a group (group estimators).
    """
    a, o = settings.algorithm, settings.optim
    rows = {
        "tokens": batch.tokens_RT,
        "positions": batch.positions_RT,
        "attention": batch.attention_RT,
        "loss_mask": batch.loss_mask_RT,
    }
    if a.corrects_off_policy:  # weights against the sampler's log-probs
        rows["behaviour_logp"] = batch.behaviour_logp_RT
    correct_R = (batch.scores_R > 0).astype(f32) if a.nll_coef else None
    layout, metrics = {}, {}
    if settings.pack:
        lengths = np.sum(batch.attention_RT > 0, axis=1)
        multiple = o.num_mini_batches * o.micro_batch_size
        T = batch.tokens_RT.shape[1]
        width = o.pack_width or T
        if settings.share_prefix:
            packing = plan_shared_packing(
                batch.tokens_RT,
                lengths,
                batch.loss_mask_RT,
                width=width,
                multiple=multiple,
                least=slots,
            )
        else:
            packing = plan_packing(lengths, width, multiple=multiple, padded_width=T)
        rows = {k: packing.pack(v) for k, v in rows.items()}
        rows["attention"] = packing.segments_PT
        if packing.prompt_keys_PNS is not None:
            rows["prompt_keys"] = packing.prompt_keys_PNS
        if correct_R is not None:
            rows["correct"] = packing.pack_rows(correct_R)
        layout = {
            "src_PT": packing.src_PT,
            "dst_RT": packing.dst_RT,
            "loss_mask_RT": batch.loss_mask_RT,
        }
        metrics = {
            "packing/rows": float(packing.packed_rows),
            "packing/fill": packing.fill_fraction,
        }
        if settings.share_prefix:  # the padded batch's tokens the shared prompts saved
            placed = np.count_nonzero(packing.segments_PT)
            metrics["packing/shared_frac"] = 1.0 - placed / max(1, int(lengths.sum()))
    elif correct_R is not None:
        rows["correct"] = correct_R
    if batch.turn_slot_R is not None:
        layout["turn_slot_R"] = batch.turn_slot_R
    inputs = {
        "rows": rows,
        "estimator": _estimator_view(batch, a.adv_estimator, settings.group_size),
    }
    if layout:
        inputs["layout"] = layout
    return inputs, metrics


def shared_slots(inputs: dict, least: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """The prompt and sample slot widths of `step_inputs`' rows, at least `least`, rounded up to
    one of 4 widths per doubling: what a later step passes as its `slots`, so that its rows keep
    one shape while they fit (each new shape is a compile)."""
    keys = inputs["rows"].get("prompt_keys")
    if keys is None:
        return least
    _, N, S = keys.shape
    L = (inputs["rows"]["tokens"].shape[1] - S) // N
    return max(least[0], slot_width(S, 4)), max(least[1], slot_width(L, 4))


def full_batch(
    rows: int, length: int, *, step_len: int = 4, baseline: bool = False, group_size: int = 1
) -> Batch:
    """A batch of `rows` sequences filling all `length` tokens (responses on the second half):
    the most a step of that shape computes (packing leaves every sequence its own row; shared
    prompts, `optim.share_prefix`, share one per `group_size` consecutive rows). For lowering
    the step on shapes (`plan`)."""
    ones = np.ones((rows, length), np.int32)
    tokens = ones.copy()
    bits = min(length // 2, 30)  # each group's prompt opens with its index in binary (ids 1, 2)
    group = np.arange(rows) // max(group_size, 1)
    tokens[:, :bits] += (group[:, None] >> np.arange(bits)) & 1
    mask = np.zeros((rows, length), f32)
    mask[:, length // 2 :] = 1.0
    return Batch(
        tokens_RT=tokens,
        positions_RT=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        attention_RT=ones,
        loss_mask_RT=mask,
        behaviour_logp_RT=np.zeros((rows, length), f32),
        scores_R=np.zeros(rows, f32),
        num_rows=rows,
        step_rewards_RS=np.zeros((rows, step_len), f32),
        step_mask_RS=np.zeros((rows, step_len), f32),
        anchor_ids_RS=np.zeros((rows, step_len), np.int32),
        token_step_RT=np.zeros((rows, length), np.int32),
        baseline_R=np.zeros(rows, f32) if baseline else None,
    )
