"""Group-normalised advantages (GRPO) from the broker's :class:`~tidal.broker.types.Group` objects.

Each sample of a group gets one scalar advantage, later broadcast over its response tokens by the packer:

    A_i = (r_i - mean(r)) / (std(r) + eps)     with std normalisation (GRPO, DeepSeekMath)
    A_i =  r_i - mean(r)                       without (Dr. GRPO; DAPO keeps the std)

``std`` is the unbiased (n - 1) sample standard deviation, as in verl's GRPO. A group of one sample
carries no baseline, so its advantage is 0 (it trains nothing) rather than its raw reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tidal.broker.types import Group
from tidal.trainer.metrics import StepStats


def group_advantages(
    rewards: Sequence[float] | np.ndarray, *, norm_by_std: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Advantages of one group's samples, float32 ``[n]``, in the order of ``rewards``."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"a group's rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"group rewards must be finite, got {r.tolist()}; check the reward function")
    if r.size == 1:
        return np.zeros(1, dtype=np.float32)
    centred = r - r.mean()
    if norm_by_std:
        centred = centred / (r.std(ddof=1) + eps)
    return centred.astype(np.float32)


def batch_advantages(
    groups: Sequence[Group], *, norm_by_std: bool = True, eps: float = 1e-6
) -> list[np.ndarray]:
    """One advantage array per group (aligned with ``group.samples``)."""
    return [group_advantages(g.rewards, norm_by_std=norm_by_std, eps=eps) for g in groups]


def reward_stats(groups: Sequence[Group]) -> StepStats:
    """Reward mean/max/min and the fraction of groups whose samples all scored the same (no signal)."""
    stats = StepStats()
    rewards = [g.rewards for g in groups]
    flat = np.concatenate(rewards) if rewards else np.zeros(0, dtype=np.float32)
    stats.add_mean("reward/mean", float(flat.sum()), flat.size)
    stats.add_mean("reward/solved", float((flat > 0).sum()), flat.size)
    if flat.size:
        stats.add_max("reward/max", float(flat.max()))
        stats.add_min("reward/min", float(flat.min()))
    flat_groups = sum(1 for r in rewards if r.size and np.all(r == r[0]))
    stats.add_mean("reward/zero_variance_group_frac", flat_groups, len(groups))
    return stats
