"""Off-policy correction against hand-computed values, and eta = 0 without correction == on-policy GRPO.

The fixture: two packed sequences of two loss tokens each, cu_seqlens [0, 2, 4]; advantages +1 on sequence
0 and -1 on sequence 1. The trainer's (proximal) policy differs from the behaviour policy mu by the
importance weights w = pi_prox / mu = [3, 0.5, 1, 4]. The current policy equals the proximal one, so the
PPO ratio is 1 and each token's surrogate is -A * w_t (times whatever the correction does to w):

    decoupled PPO (w as is):  (-3 - 0.5 + 1 + 4) / 4             = 0.375
    TIS token, cap 2:         (-2 - 0.5 + 1 + 2) / 4             = 0.125
    TIS sequence, cap 2:      w_seq = (3 * 0.5, min(1 * 4, 2)) = (1.5, 2); (-1.5*2 + 2*2) / 4 = 0.25
    TIS geometric, cap 1.5:   w_seq = (sqrt 1.5, min(sqrt 4, 1.5)); (-2 sqrt 1.5 + 2 * 1.5) / 4
    IcePop [0.5, 2]:          tokens with w = 3 and w = 4 masked: (-0.5 + 1) / 4 = 0.125
"""

import math

import pytest
import torch

from tidal.trainer.config import LossConfig
from tidal.trainer.losses import Normalizer, check_loss_setup, grpo_loss

CU = torch.tensor([0, 2, 4], dtype=torch.int32)
MASK = torch.ones(4)
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
BEHAVIOUR = torch.tensor([-1.2, -0.4, -2.0, -3.1], dtype=torch.float64)
WEIGHTS = torch.tensor([3.0, 0.5, 1.0, 4.0], dtype=torch.float64)
PROXIMAL = BEHAVIOUR + torch.log(WEIGHTS)
NORM = Normalizer(tokens=4, sequences=2)


def loss_with(config: LossConfig, proximal=PROXIMAL, logprobs=None, **kwargs):
    logprobs = PROXIMAL.clone().requires_grad_(True) if logprobs is None else logprobs
    result = grpo_loss(logprobs, BEHAVIOUR, ADV, MASK, CU, NORM, config, proximal_logprobs=proximal, **kwargs)
    return logprobs, result


G = math.sqrt(1.5)


@pytest.mark.parametrize(
    ("config", "expected", "weights"),
    [
        (LossConfig(), 0.375, [3.0, 0.5, 1.0, 4.0]),
        (LossConfig(tis="token", tis_cap=2.0), 0.125, [2.0, 0.5, 1.0, 2.0]),
        (LossConfig(tis="sequence", tis_cap=2.0), 0.25, [1.5, 1.5, 2.0, 2.0]),
        (LossConfig(tis="geometric", tis_cap=1.5), (-2 * G + 2 * 1.5) / 4, [G, G, 1.5, 1.5]),
        (LossConfig(icepop=(0.5, 2.0)), 0.125, [0.0, 0.5, 1.0, 0.0]),
    ],
    ids=["decoupled", "tis-token", "tis-sequence", "tis-geometric", "icepop"],
)
def test_correction_modes_by_hand(config, expected, weights):
    logprobs, result = loss_with(config)
    assert result.loss.item() == pytest.approx(expected, rel=1e-12)
    # The weights are constants: d/d log pi of -A * w * exp(log pi - log pi_prox) at pi = pi_prox is -A * w.
    result.loss.backward()
    expected_grad = -ADV * torch.tensor(weights, dtype=torch.float64) / 4
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_correction_statistics_by_hand():
    _, result = loss_with(LossConfig(tis="token", tis_cap=2.0))
    stats = result.stats.summary()
    w = [3.0, 0.5, 1.0, 4.0]
    assert stats["offpolicy/mismatch_kl_k1"] == pytest.approx(-sum(math.log(x) for x in w) / 4)
    assert stats["offpolicy/mismatch_kl_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 4)
    assert stats["offpolicy/is_weight_max"] == pytest.approx(2.0)  # after truncation
    assert stats["offpolicy/is_weight_min"] == pytest.approx(0.5)
    assert stats["offpolicy/is_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 2) / 4)
    assert stats["offpolicy/tis_truncated_frac"] == pytest.approx(2 / 4)
    _, result = loss_with(LossConfig(icepop=(0.5, 2.0)))
    assert result.stats.summary()["offpolicy/icepop_masked_frac"] == pytest.approx(2 / 4)


def test_tis_without_recompute_uses_the_current_policy_as_proximal():
    # No proximal logprobs: the detached current logprobs stand in (exact on a batch's first step).
    logprobs = PROXIMAL.clone().requires_grad_(True)
    _, result = loss_with(LossConfig(tis="token", tis_cap=2.0), proximal=None, logprobs=logprobs)
    assert result.loss.item() == pytest.approx(0.125, rel=1e-12)
    result.loss.backward()
    # d/d log pi of -A * exp(log pi - sg(log pi)) * min(w, 2) = -A * min(w, 2); divided by 4 tokens.
    expected = torch.tensor([-2.0, -0.5, 1.0, 2.0], dtype=torch.float64) / 4
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-15)


def test_staleness_mask_and_statistics():
    versions = torch.tensor([5, 5, 3, 4])
    config = LossConfig(offpolicy_max_staleness=1)
    # Plain GRPO (no proximal, current == behaviour: ratio 1), sequence 1 is 2 versions old: dropped.
    _, result = loss_with(
        config, proximal=None, logprobs=BEHAVIOUR.clone(), versions=versions, current_version=5
    )
    assert result.loss.item() == pytest.approx((-1 - 1) / 4)
    stats = result.stats.summary()
    assert stats["offpolicy/seq_masked_frac"] == pytest.approx(2 / 4)
    assert stats["offpolicy/staleness_mean"] == pytest.approx((0 + 0 + 2 + 1) / 4)
    assert stats["offpolicy/staleness_max"] == 2


def test_negative_only_mask_keeps_positive_advantage_sequences():
    versions = torch.tensor([1, 1, 5, 5])  # sequence 0 (A = +1) is stale
    config = LossConfig(offpolicy_max_staleness=1, offpolicy_mask_negative_only=True)
    kw = {"proximal": None, "logprobs": BEHAVIOUR.clone(), "versions": versions, "current_version": 5}
    _, result = loss_with(config, **kw)
    assert result.loss.item() == pytest.approx((-1 - 1 + 1 + 1) / 4)  # nothing dropped
    _, result = loss_with(LossConfig(offpolicy_max_staleness=1), **kw)
    assert result.loss.item() == pytest.approx((1 + 1) / 4)  # sequence 0 dropped


def test_mismatch_kl_mask_by_hand():
    # Mean k3 = w - 1 - ln w per sequence: seq 0 (0.901 + 0.193) / 2 = 0.547, seq 1 (0 + 1.614) / 2 = 0.807.
    k3 = [x - 1 - math.log(x) for x in (3.0, 0.5, 1.0, 4.0)]
    assert (k3[0] + k3[1]) / 2 < 0.7 < (k3[2] + k3[3]) / 2
    _, result = loss_with(LossConfig(offpolicy_max_kl=0.7))
    assert result.loss.item() == pytest.approx((-3 - 0.5) / 4, rel=1e-12)  # sequence 1 dropped


def test_missing_versions_for_staleness_mask_is_a_clear_error():
    with pytest.raises(ValueError, match="offpolicy_max_staleness needs versions"):
        loss_with(LossConfig(offpolicy_max_staleness=1))


def reference_grpo(logprobs, behaviour, adv, mask, low, high):
    """On-policy GRPO as written in the DeepSeekMath / DAPO papers, token-mean aggregation."""
    ratio = torch.exp(logprobs - behaviour)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)
    return -(surrogate * mask).sum() / mask.sum()


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(),
        # every correction on, but with no mismatch (eta = 0, trainer == engine) they must all be inert
        LossConfig(tis="token", icepop=(0.5, 2.0), offpolicy_max_staleness=0, offpolicy_max_kl=0.1),
    ],
    ids=["no-correction", "corrections-without-mismatch"],
)
def test_eta_zero_reduces_exactly_to_on_policy_grpo(config):
    gen = torch.Generator().manual_seed(0)
    n = 64
    behaviour = -torch.rand(n, generator=gen) * 3
    logprobs = (behaviour + 0.3 * torch.randn(n, generator=gen)).requires_grad_(True)
    adv = torch.randn(n, generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.2).float()
    cu = torch.tensor([0, 10, 33, 50, 64], dtype=torch.int32)
    versions = torch.full((n,), 7)  # eta = 0: every token from the current version
    proximal = behaviour if config.tis != "off" else None  # trainer recomputes exactly mu
    result = grpo_loss(
        logprobs,
        behaviour,
        adv,
        mask,
        cu,
        Normalizer.of(mask, cu),
        config,
        proximal_logprobs=proximal,
        versions=versions,
        current_version=7,
    )
    (grad,) = torch.autograd.grad(result.loss, logprobs)
    ref_logprobs = logprobs.detach().clone().requires_grad_(True)
    expected = reference_grpo(ref_logprobs, behaviour, adv, mask, 0.2, 0.2)
    (expected_grad,) = torch.autograd.grad(expected, ref_logprobs)
    # float32 summation order is the same, so the match is exact, not approximate.
    assert torch.equal(result.loss.detach(), expected.detach())
    assert torch.equal(grad, expected_grad)


def test_mismatch_kl_is_reported_without_any_correction():
    # Plain GRPO: the current policy (= PROXIMAL here) against the behaviour policy, a statistic only.
    _, result = loss_with(LossConfig(), proximal=None)
    w = [3.0, 0.5, 1.0, 4.0]
    stats = result.stats.summary()
    assert stats["offpolicy/mismatch_kl_k1"] == pytest.approx(-sum(math.log(x) for x in w) / 4)
    assert stats["offpolicy/mismatch_kl_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 4)
    assert "offpolicy/is_weight_mean" not in stats
    # and the loss is plain GRPO with ratio pi / mu = w: max(-A r, -A clip(r, 0.8, 1.2)) per token
    #   A=+1, r=3: max(-3, -1.2) = -1.2    A=+1, r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1, r=1: 1                       A=-1, r=4:   max(4, 1.2) = 4
    assert result.loss.item() == pytest.approx((-1.2 - 0.5 + 1.0 + 4.0) / 4, rel=1e-12)


def test_corrections_over_several_minibatches_need_recomputed_proximal_logprobs():
    check_loss_setup(LossConfig(tis="token"), minibatches_per_batch=1)
    check_loss_setup(LossConfig(tis="token", recompute_proximal_logprobs=True), minibatches_per_batch=4)
    check_loss_setup(LossConfig(), minibatches_per_batch=4)  # plain GRPO anchors on mu: fine
    with pytest.raises(ValueError, match="set trainer.loss.recompute_proximal_logprobs=true"):
        check_loss_setup(LossConfig(icepop=(0.5, 5.0)), minibatches_per_batch=2)
