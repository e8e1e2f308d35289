"""Host-side batch filters on group rewards (NumPy; not jitted). Each returns kept group indices.

Rewards come as ``[B]`` with B = num_groups * G, groups contiguous (row i in group i // G), or
already as ``[num_groups, G]``. The result is a sorted int64 array of group indices. A flat
``[B]`` whose B is not a multiple of G, a ``[num_groups, G']`` with G' != G, any other rank, or
a non-integer group size is a ValueError.

  dynamic_sampling_filter  DAPO (2503.14476): drop groups whose rewards are all equal.
  starpo_s_filter          StarPO-S (RAGEN, 2504.20073): keep the top ``keep_fraction`` of groups
                           by in-group reward std (unbiased; at least one group; ties -> lower
                           index).
  accuracy_band_filter     ZeroTIR (2505.07773): keep groups with accuracy in [low, high].
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def _groups(fn: str, rewards, group_size: int | None) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if group_size is not None and (
        not isinstance(group_size, numbers.Integral)
        or isinstance(group_size, bool)
        or group_size < 1
    ):
        raise ValueError(f"{fn}: group_size must be an int >= 1, got {group_size!r}")
    if r.ndim == 2 and group_size in (None, r.shape[1]):
        return r
    if r.ndim != 1 or group_size is None:
        raise ValueError(
            f"{fn}: rewards has shape {r.shape}, expected [B] with group_size or "
            f"[num_groups, G]{'' if group_size is None else f' with G = {group_size}'}"
        )
    if r.shape[0] % group_size:
        raise ValueError(
            f"{fn}: rewards has shape {r.shape}: batch size {r.shape[0]} is not a "
            f"multiple of group_size {group_size}"
        )
    return r.reshape(-1, int(group_size))


def dynamic_sampling_filter(
    rewards, group_size: int | None = None, *, atol: float = 0.0
) -> np.ndarray:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal (max − min > atol).

    Args:
      rewards: [B] (with group_size) or [num_groups, G] rewards.
      group_size: G when rewards is flat.
      atol: rewards closer than this count as equal.
    Returns:
      Sorted indices of the kept groups.
    """
    r = _groups("dynamic_sampling_filter", rewards, group_size)
    return np.flatnonzero(np.ptp(r, axis=1) > atol)


def starpo_s_filter(
    rewards, group_size: int | None = None, *, keep_fraction: float = 0.25
) -> np.ndarray:
    """StarPO-S: keep the max(1, floor(keep_fraction · num_groups)) groups of largest reward std.

    Args:
      rewards: [B] (with group_size) or [num_groups, G] rewards.
      group_size: G when rewards is flat.
      keep_fraction: fraction of groups to keep, in (0, 1].
    Returns:
      Sorted indices of the kept groups.
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    r = _groups("starpo_s_filter", rewards, group_size)
    # RAGEN: int(ratio * num_groups) groups (floor); we keep at least one.
    n_keep = max(1, math.floor(keep_fraction * r.shape[0] + 1e-9))
    std = r.std(axis=1, ddof=1) if r.shape[1] > 1 else np.zeros(r.shape[0])
    order = np.argsort(-std, kind="stable")
    return np.sort(order[:n_keep])


def accuracy_band_filter(
    rewards,
    group_size: int | None = None,
    *,
    low: float = 0.2,
    high: float = 0.8,
    correct_threshold: float = 0.5,
) -> np.ndarray:
    """ZeroTIR: keep groups whose accuracy (fraction with reward >= correct_threshold) is in
    [low, high].

    Args:
      rewards: [B] (with group_size) or [num_groups, G] rewards (1/0, 1/−1 or booleans).
      group_size: G when rewards is flat.
      low, high: the accuracy band, inclusive.
      correct_threshold: a response counts as correct when its reward is >= this.
    Returns:
      Sorted indices of the kept groups.
    """
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"need 0 <= low <= high <= 1, got low={low}, high={high}")
    r = _groups("accuracy_band_filter", rewards, group_size)
    acc = np.mean(r >= correct_threshold, axis=1)
    return np.flatnonzero((acc >= low - 1e-12) & (acc <= high + 1e-12))
