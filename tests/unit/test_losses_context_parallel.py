"""Sequence-level terms under context parallel: each CP rank holds part of every sequence.

The loss sums per-sequence quantities over the CP group through ``seq_reduce``. Here two CP ranks are
simulated in one process: a first pass records what each rank hands to ``seq_reduce`` (those inputs are
local and detached, so they do not depend on earlier reductions); the second pass answers each call with
the sum of both ranks' inputs, which is what an all-reduce returns. Megatron-core's THD layout for cp = 2:
a sequence padded to a multiple of 4 is cut into 4 chunks; rank 0 keeps chunks 0 and 3, rank 1 chunks 1, 2.
"""

import numpy as np
import pytest
import torch

from tidal.broker.types import Group, Sample
from tidal.trainer.config import LossConfig
from tidal.trainer.losses import grpo_loss
from tidal.trainer.packing import items_from_groups, plan_minibatch

PER_TOKEN = ("labels", "loss_mask", "behaviour_logprobs", "advantages", "versions")


def batch():
    rng = np.random.default_rng(0)
    groups = []
    for g in range(2):
        samples = []
        for _ in range(3):
            p, r = int(rng.integers(2, 9)), int(rng.integers(3, 15))
            samples.append(
                Sample(
                    rng.integers(1, 50, p).astype(np.int32),
                    rng.integers(1, 50, r).astype(np.int32),
                    (-rng.random(r) * 2).astype(np.float32),
                    np.full(r, rng.integers(3, 6), dtype=np.int32),
                    float(rng.random()),
                    "stop",
                )
            )
        groups.append(Group(f"0:{g}", samples))
    adv = [np.array([1.0, -0.5, -0.5], np.float32), np.array([-1.0, 0.25, 0.75], np.float32)]
    plan = plan_minibatch(items_from_groups(groups, adv), dp_size=1, max_tokens=512, pad_multiple=4)
    (mb,) = plan.micro_batches(0)
    return mb, plan.normalizer


def cp_index(cu_padded: torch.Tensor, rank: int) -> torch.Tensor:
    out = []
    for lo, hi in zip(cu_padded[:-1].tolist(), cu_padded[1:].tolist(), strict=True):
        c = (hi - lo) // 4
        chunks = (0, 3) if rank == 0 else (1, 2)
        out += [torch.arange(lo + k * c, lo + (k + 1) * c) for k in chunks]
    return torch.cat(out)


@pytest.mark.parametrize(
    ("config", "active"),
    [
        (LossConfig(agg="seq-mean-token-mean"), None),
        (LossConfig(agg="seq-mean-token-mean", tis="sequence", tis_cap=1.05), "offpolicy/tis_truncated_frac"),
        (LossConfig(agg="token-mean", tis="geometric", tis_cap=1.01), "offpolicy/tis_truncated_frac"),
        (LossConfig(agg="seq-mean-token-sum", offpolicy_max_kl=0.006), "offpolicy/seq_masked_frac"),
        (LossConfig(agg="seq-mean-token-mean", offpolicy_max_staleness=1), "offpolicy/seq_masked_frac"),
    ],
    ids=["seq-mean-token-mean", "tis-sequence", "tis-geometric", "kl-mask", "staleness-mask"],
)
def test_cp_shares_sum_to_the_whole_sequence_loss(config, active):
    mb, norm = batch()
    gen = torch.Generator().manual_seed(1)
    logprobs = (
        mb.behaviour_logprobs.double() + 0.3 * torch.randn(mb.num_tokens, generator=gen)
    ).requires_grad_(True)
    proximal = mb.behaviour_logprobs.double() + 0.1 * torch.randn(mb.num_tokens, generator=gen)

    def loss(index, seq_reduce, cu):
        def pick(t):
            return t if index is None else t.index_select(0, index)

        return grpo_loss(
            pick(logprobs),
            pick(mb.behaviour_logprobs.double()),
            pick(mb.advantages.double()),
            pick(mb.loss_mask),
            cu,
            norm,
            config,
            proximal_logprobs=pick(proximal),
            versions=pick(mb.versions),
            current_version=5,
            seq_reduce=seq_reduce,
        )

    whole = loss(None, None, mb.cu_seqlens_padded)
    (whole_grad,) = torch.autograd.grad(whole.loss, logprobs)
    if active is not None:  # the correction under test acts on some sequences, not none or all
        assert 0 < whole.stats.summary()[active] < 1

    local_cu = mb.cu_seqlens_padded // 2
    index = [cp_index(mb.cu_seqlens_padded, r) for r in range(2)]
    recorded: list[list[torch.Tensor]] = [[], []]
    for r in range(2):
        loss(index[r], lambda t, r=r: recorded[r].append(t.clone()) or t, local_cu)

    def all_reduced(r):
        calls = iter(range(len(recorded[r])))
        return lambda t: t + recorded[1 - r][next(calls)]

    total = loss(index[0], all_reduced(0), local_cu).loss + loss(index[1], all_reduced(1), local_cu).loss
    (cp_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    torch.testing.assert_close(cp_grad, whole_grad, rtol=1e-12, atol=1e-15)
    # without the reduction the per-sequence terms would be wrong: the test can tell them apart
    naive = loss(index[0], None, local_cu).loss + loss(index[1], None, local_cu).loss
    assert naive.item() != pytest.approx(whole.loss.item(), rel=1e-6)
