"""The GRPO / DAPO loss against values worked out by hand on small packed micro-batches.

The fixture: two packed sequences, cu_seqlens [0, 3, 6]. Token 0 is a prompt token (mask 0); sequence 0
has 2 loss tokens with advantage +1, sequence 1 has 3 loss tokens with advantage -0.5. The ratio
pi/mu of each token is chosen so that each clip case happens once (clip ratios 0.2 / 0.2):

    token  A     r     -A*r   -A*clip(r, 0.8, 1.2)  max (the PPO loss)
    1      +1    1.1   -1.1   -1.1                  -1.1
    2      +1    1.5   -1.5   -1.2                  -1.2   clipped high
    3      -0.5  0.5   0.25   0.4                   0.4    clipped low
    4      -0.5  1.0   0.5    0.5                   0.5
    5      -0.5  4.0   2.0    0.6                   2.0    (dual clip c=3: min(2.0, 0.5*3) = 1.5)
"""

import math

import pytest
import torch

from tidal.trainer.config import LossConfig
from tidal.trainer.losses import (
    Normalizer,
    aggregate,
    entropy_from_logits,
    grpo_loss,
    kl_penalty,
    logprobs_from_logits,
    sft_loss,
)

CU = torch.tensor([0, 3, 6], dtype=torch.int32)
MASK = torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.float32)
ADV = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5], dtype=torch.float64)
RATIOS = torch.tensor(
    [7.0, 1.1, 1.5, 0.5, 1.0, 4.0], dtype=torch.float64
)  # token 0 is masked: its ratio must not matter
BEHAVIOUR = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7, -3.0], dtype=torch.float64)
NORM = Normalizer(tokens=5, sequences=2)


def current_logprobs(ratios: torch.Tensor = RATIOS, base: torch.Tensor = BEHAVIOUR) -> torch.Tensor:
    return (base.double() + torch.log(ratios.double())).requires_grad_(True)


def run(config: LossConfig, logprobs=None, **kwargs):
    logprobs = current_logprobs() if logprobs is None else logprobs
    result = grpo_loss(logprobs, BEHAVIOUR.double(), ADV.double(), MASK, CU, NORM, config, **kwargs)
    return logprobs, result


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", (-1.1 - 1.2 + 0.4 + 0.5 + 2.0) / 5),  # 0.6 / 5 = 0.12
        ("seq-mean-token-sum", (-1.1 - 1.2 + 0.4 + 0.5 + 2.0) / 2),  # 0.6 / 2 = 0.3
        ("seq-mean-token-mean", ((-1.1 - 1.2) / 2 + (0.4 + 0.5 + 2.0) / 3) / 2),  # -0.0916...
    ],
)
def test_clipped_surrogate_each_aggregation(agg, expected):
    logprobs, result = run(LossConfig(agg=agg))
    assert result.loss.item() == pytest.approx(expected, rel=1e-12)
    stats = result.stats.summary()
    assert stats["actor/clip_frac_high"] == pytest.approx(1 / 5)
    assert stats["actor/clip_frac_low"] == pytest.approx(1 / 5)
    assert stats["actor/clip_frac_dual"] == 0
    assert stats["actor/loss_tokens"] == 5


def test_gradient_flows_only_through_unclipped_tokens():
    logprobs, result = run(LossConfig(agg="token-mean"))
    result.loss.backward()
    # d(-A r)/d log pi = -A r on unclipped tokens, 0 on clipped and masked ones; divided by N_tokens = 5.
    expected = torch.tensor([0.0, -1.1, 0.0, 0.0, 0.5, 2.0], dtype=torch.float64) / 5
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-15)


def test_dual_clip_caps_negative_advantage_loss():
    logprobs, result = run(LossConfig(agg="token-mean", clip_ratio_c=3.0))
    # token 5: min(2.0, -A * c = 0.5 * 3 = 1.5) = 1.5
    assert result.loss.item() == pytest.approx((-1.1 - 1.2 + 0.4 + 0.5 + 1.5) / 5, rel=1e-12)
    assert result.stats.summary()["actor/clip_frac_dual"] == pytest.approx(1 / 5)
    result.loss.backward()
    assert logprobs.grad[5].item() == 0.0  # the dual-clipped branch is constant


def test_asymmetric_clip_higher():
    # DAPO clip-higher: low 0.2, high 0.6 -> token 2 (r = 1.5) is no longer clipped: -1.5 instead of -1.2.
    _, result = run(LossConfig(agg="token-mean", clip_ratio_high=0.6))
    assert result.loss.item() == pytest.approx((-1.1 - 1.5 + 0.4 + 0.5 + 2.0) / 5, rel=1e-12)
    assert result.stats.summary()["actor/clip_frac_high"] == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_splitting_the_minibatch_does_not_change_loss_or_gradient(agg):
    config = LossConfig(agg=agg, clip_ratio_c=3.0)
    whole_lp, whole = run(config)
    whole.loss.backward()
    parts_lp = current_logprobs()
    total = 0
    # The same two sequences as two micro-batches (or two data-parallel ranks), with the global normaliser.
    for lo, hi in ((0, 3), (3, 6)):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        part = grpo_loss(
            parts_lp[lo:hi], BEHAVIOUR[lo:hi].double(), ADV[lo:hi].double(), MASK[lo:hi], cu, NORM, config
        )
        total = total + part.loss
    total.backward()
    assert total.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    torch.testing.assert_close(parts_lp.grad, whole_lp.grad, rtol=1e-12, atol=1e-15)


def test_normalizer_counts_tokens_and_nonempty_sequences():
    cu = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 0])  # the third sequence has no loss token
    assert Normalizer.of(mask, cu) == Normalizer(tokens=5, sequences=2)
    assert Normalizer.of(mask, cu) + Normalizer(1, 1) == Normalizer(6, 3)


def test_kl_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25 -> r = pi_ref / pi = 0.5, log r = -ln 2
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))  # -log r
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)  # (log r)^2 / 2
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))  # r - 1 - log r
    # A wildly improbable reference token: k3 = e^20 - 21 is clamped to 10.
    assert kl_penalty(logp, logp + 20, "k3", clamp=10.0).item() == 10.0


def test_kl_and_entropy_terms_join_the_loss():
    ref = BEHAVIOUR.double() - math.log(2)  # pi_ref = pi_behaviour / 2 on every token
    entropy = torch.full((6,), 0.3, dtype=torch.float64)
    config = LossConfig(agg="token-mean", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    logprobs, result = run(config, ref_logprobs=ref, entropy=entropy)
    # k1 = log pi - log pi_ref = log r_t + ln 2 on each loss token.
    kl = sum(math.log(r) + math.log(2) for r in (1.1, 1.5, 0.5, 1.0, 4.0)) / 5
    pg = 0.6 / 5
    assert result.loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * 0.3, rel=1e-12)
    stats = result.stats.summary()
    assert stats["loss/kl"] == pytest.approx(kl)
    assert stats["loss/entropy"] == pytest.approx(0.3)
    assert stats["loss/pg"] == pytest.approx(pg)


def test_kl_without_reference_model_is_a_clear_error():
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        run(LossConfig(kl_coef=0.1))
    # kl_coef = 0: no reference model needed at all
    _, result = run(LossConfig(kl_coef=0.0))
    assert "loss/kl" not in result.stats.summary()


def test_logits_helpers():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -math.inf, -math.inf]])
    assert entropy_from_logits(logits[:1]).item() == pytest.approx(math.log(4))
    # second row: probabilities (3/4, 1/4, 0, 0)
    lp = logprobs_from_logits(logits, torch.tensor([2, 1]))
    assert lp[0].item() == pytest.approx(math.log(0.25))
    assert lp[1].item() == pytest.approx(math.log(0.25))


def test_sft_nll_by_hand():
    logprobs = torch.tensor([math.log(0.9), math.log(0.5), math.log(0.25), math.log(0.125)])
    mask = torch.tensor([0, 1, 1, 1])
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    # token-mean: (ln 2 + ln 4 + ln 8) / 3 = 2 ln 2
    result = sft_loss(logprobs, mask, cu, Normalizer.of(mask, cu))
    assert result.loss.item() == pytest.approx(2 * math.log(2))
    # seq-mean-token-mean: (ln 2 / 1 + (ln 4 + ln 8) / 2) / 2 = (1 + 2.5) ln 2 / 2
    result = sft_loss(logprobs, mask, cu, Normalizer.of(mask, cu), "seq-mean-token-mean")
    assert result.loss.item() == pytest.approx(1.75 * math.log(2))


def test_unknown_aggregation_is_named():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(torch.ones(2), torch.ones(2), torch.tensor([0, 2]), "mean", Normalizer(2, 1))


def test_extreme_logprobs_off_the_mask_do_not_poison_the_loss():
    # Prompt / padding positions (mask 0) may carry any logprob; a ratio of e^200 there must not turn into
    # inf * 0 = NaN in the loss or the gradient.
    logprobs = current_logprobs().detach().clone()
    logprobs[0] = 200.0
    logprobs.requires_grad_(True)
    proximal = BEHAVIOUR.clone()
    proximal[0] = -1e4
    ref = BEHAVIOUR.clone()
    ref[0] = -1e4
    config = LossConfig(agg="seq-mean-token-mean", tis="sequence", kl_coef=0.1)
    result = grpo_loss(
        logprobs, BEHAVIOUR, ADV, MASK, CU, NORM, config, proximal_logprobs=proximal, ref_logprobs=ref
    )
    result.loss.backward()
    assert torch.isfinite(result.loss) and bool(torch.isfinite(logprobs.grad).all())
    assert logprobs.grad[0] == 0
    sft = sft_loss(
        torch.tensor([-math.inf, -1.0]), torch.tensor([0, 1]), torch.tensor([0, 2]), Normalizer(1, 1)
    )
    assert sft.loss.item() == 1.0
