"""Group-normalised advantages by hand, from broker Groups."""

import math

import numpy as np
import pytest

from tidal.broker.types import Group, Sample
from tidal.trainer.advantages import batch_advantages, group_advantages, reward_stats


def sample(reward: float) -> Sample:
    one = np.ones(1, dtype=np.int32)
    return Sample(one, one, np.zeros(1, np.float32), np.zeros(1, np.int32), reward, "stop")


def test_grpo_advantages_by_hand():
    # rewards (1, 0, 0, 1): mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = group_advantages([1, 0, 0, 1], norm_by_std=True, eps=0.0)
    expected = 0.5 / math.sqrt(1 / 3)  # 0.8660...
    np.testing.assert_allclose(adv, [expected, -expected, -expected, expected], rtol=1e-6)
    # eps joins the denominator
    adv = group_advantages([1, 0, 0, 1], norm_by_std=True, eps=0.1)
    np.testing.assert_allclose(adv[0], 0.5 / (math.sqrt(1 / 3) + 0.1), rtol=1e-6)


def test_without_std_normalisation_only_the_mean_is_removed():
    np.testing.assert_allclose(group_advantages([3, 1, 2], norm_by_std=False), [1, -1, 0])


def test_degenerate_groups_give_zero_advantage():
    assert group_advantages([1, 1, 1]).tolist() == [0, 0, 0]  # no variance: no signal
    assert group_advantages([0.7]).tolist() == [0]  # one sample: no baseline


def test_bad_rewards_are_named():
    with pytest.raises(ValueError, match="must be finite"):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="non-empty"):
        group_advantages([])


def test_from_groups_with_reward_stats():
    groups = [Group("0:0", [sample(1), sample(0)]), Group("0:1", [sample(1), sample(1)])]
    adv = batch_advantages(groups, norm_by_std=False)
    assert [a.tolist() for a in adv] == [[0.5, -0.5], [0, 0]]
    stats = reward_stats(groups).summary()
    assert stats["reward/mean"] == pytest.approx(0.75)
    assert stats["reward/zero_variance_group_frac"] == pytest.approx(0.5)
    assert stats["reward/max"] == 1 and stats["reward/min"] == 0
