"""THD packing: round trips, the token budget, balanced data-parallel splits, padding and the normaliser."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.broker.types import Group, Sample
from tidal.trainer.advantages import group_advantages
from tidal.trainer.config import LossConfig
from tidal.trainer.losses import Normalizer, grpo_loss
from tidal.trainer.packing import (
    SequenceItem,
    build_micro_batch,
    items_from_groups,
    plan_assignment,
    plan_batch,
    plan_minibatch,
    split_minibatches,
)


def make_sample(
    rng: np.random.Generator, prompt_len: int, response_len: int, version: int, finish="stop"
) -> Sample:
    return Sample(
        prompt_ids=rng.integers(1, 100, prompt_len).astype(np.int32),
        response_ids=rng.integers(1, 100, response_len).astype(np.int32),
        logprobs=-rng.random(response_len).astype(np.float32),
        versions=np.full(response_len, version, dtype=np.int32),
        reward=float(rng.random()),
        finish_reason=finish,
    )


def make_groups(seed: int = 0, groups: int = 6, n: int = 4) -> list[Group]:
    rng = np.random.default_rng(seed)
    return [
        Group(
            f"0:{g}",
            [
                make_sample(rng, int(rng.integers(2, 12)), int(rng.integers(1, 20)), version=g % 3)
                for _ in range(n)
            ],
        )
        for g in range(groups)
    ]


def advantages_for(groups: list[Group]) -> list[np.ndarray]:
    return [np.arange(len(g.samples), dtype=np.float32) - 1.5 for g in groups]


def test_round_trip_every_sample_exactly_once_with_aligned_fields():
    groups = make_groups()
    items = items_from_groups(groups, advantages_for(groups))
    plan = plan_minibatch(items, dp_size=2, max_tokens=40)
    seen = []
    for rank in range(2):
        for mb in plan.micro_batches(rank):
            assert mb.cu_seqlens_padded[-1] == mb.num_tokens
            for s, idx in enumerate(mb.item_index):
                seen.append(idx)
                item = plan.items[idx]
                sample, p = item.sample, len(item.sample.prompt_ids)
                lo, hi = int(mb.cu_seqlens_padded[s]), int(mb.cu_seqlens_padded[s + 1])
                seq = np.concatenate([sample.prompt_ids, sample.response_ids])
                np.testing.assert_array_equal(mb.tokens[lo:hi].numpy(), seq)
                np.testing.assert_array_equal(mb.position_ids[lo:hi].numpy(), np.arange(hi - lo))
                np.testing.assert_array_equal(mb.labels[lo : hi - 1].numpy(), seq[1:])
                # Position t predicts token t+1: the response tokens are predicted at p-1 .. L-2.
                mask = mb.loss_mask[lo:hi].numpy()
                expected_mask = np.zeros(hi - lo)
                expected_mask[p - 1 : hi - lo - 1] = 1
                np.testing.assert_array_equal(mask, expected_mask)
                trained = mask == 1
                np.testing.assert_array_equal(mb.labels[lo:hi].numpy()[trained], sample.response_ids)
                np.testing.assert_array_equal(mb.behaviour_logprobs[lo:hi].numpy()[trained], sample.logprobs)
                np.testing.assert_array_equal(mb.versions[lo:hi].numpy()[trained], sample.versions)
                np.testing.assert_array_equal(mb.advantages[lo:hi].numpy()[trained], item.advantage)
                assert not mb.advantages[lo:hi].numpy()[~trained].any()
    assert sorted(seen) == list(range(len(items)))


def test_budget_respected_and_ranks_balanced_with_equal_micro_batch_counts():
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(5, 300, 200)]
    budget = 1024
    assignment = plan_assignment(lengths, dp_size=4, max_tokens=budget)
    rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in assignment]
    # LPT keeps ranks within one sequence's length of each other.
    assert max(rank_tokens) - min(rank_tokens) <= max(lengths)
    assert len({len(rank) for rank in assignment}) == 1
    for rank in assignment:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= budget
    # Near the lower bound on the number of micro-batches.
    k = len(assignment[0])
    assert k <= -(-max(rank_tokens) // budget) + 1
    assert sorted(i for rank in assignment for mb in rank for i in mb) == list(range(len(lengths)))


def test_padding_to_a_multiple_is_masked():
    groups = make_groups(seed=2, groups=3, n=2)
    items = items_from_groups(groups, advantages_for(groups))
    plan = plan_minibatch(items, dp_size=1, max_tokens=64, pad_multiple=8)
    for mb in plan.micro_batches(0):
        lengths = torch.diff(mb.cu_seqlens_padded)
        assert bool((lengths % 8 == 0).all())
        real = torch.diff(mb.cu_seqlens)
        assert bool((real <= lengths).all()) and bool((lengths - real < 8).all())
        for s in range(len(mb.item_index)):
            pad = slice(int(mb.cu_seqlens_padded[s]) + int(real[s]), int(mb.cu_seqlens_padded[s + 1]))
            assert not mb.loss_mask[pad].any()
            assert not mb.labels[pad].any()


def test_over_budget_sequence_names_the_fix():
    with pytest.raises(
        ValueError, match="over the micro-batch budget of 16; raise trainer.micro_batch_tokens"
    ):
        plan_assignment([10, 17], dp_size=1, max_tokens=16)
    with pytest.raises(ValueError, match="not a multiple of pad_multiple"):
        plan_assignment([10], dp_size=1, max_tokens=20, pad_multiple=8)


def test_ranks_without_enough_sequences_get_a_masked_filler():
    groups = make_groups(seed=3, groups=1, n=1)
    plan = plan_minibatch(
        items_from_groups(groups, [np.zeros(1, np.float32)]), dp_size=2, max_tokens=64, pad_multiple=4
    )
    (filler,) = plan.micro_batches(1)
    assert filler.item_index == [-1]
    assert filler.num_tokens == 4 and not filler.loss_mask.any()


def test_truncated_responses_masked_and_left_out_of_the_normaliser():
    rng = np.random.default_rng(4)
    items = [
        SequenceItem(make_sample(rng, 3, 5, 0)),
        SequenceItem(make_sample(rng, 3, 7, 0, finish="length")),
    ]
    plan = plan_minibatch(items, dp_size=1, max_tokens=64, mask_truncated=True)
    assert plan.normalizer == Normalizer(tokens=5, sequences=1)
    (mb,) = plan.micro_batches(0)
    assert mb.loss_mask.sum() == 5
    assert plan_minibatch(items, dp_size=1, max_tokens=64).normalizer == Normalizer(tokens=12, sequences=2)


def test_sample_loss_mask_is_respected():
    rng = np.random.default_rng(5)
    sample = make_sample(rng, 2, 4, 0)
    sample.loss_mask = np.array([1, 0, 0, 1], dtype=np.uint8)  # e.g. tool output in the middle
    mb = build_micro_batch([SequenceItem(sample)], [0])
    np.testing.assert_array_equal(mb.loss_mask.numpy(), [0, 1, 0, 0, 1, 0])


def test_plan_normaliser_equals_the_sum_over_micro_batches():
    groups = make_groups(seed=6)
    plan = plan_minibatch(
        items_from_groups(groups, advantages_for(groups)), dp_size=3, max_tokens=48, pad_multiple=2
    )
    total = Normalizer(0, 0)
    for rank in range(3):
        for mb in plan.micro_batches(rank):
            total = total + Normalizer.of(mb.loss_mask, mb.cu_seqlens_padded)
    assert total == plan.normalizer


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_loss_is_the_same_for_any_packing(agg):
    """Sum of micro-batch losses over 3 ranks x budget 48 == one micro-batch holding everything."""
    groups = make_groups(seed=7)
    items = items_from_groups(groups, advantages_for(groups))
    config = LossConfig(agg=agg, tis="token")
    gen = torch.Generator().manual_seed(0)
    noise = {i: 0.2 * torch.randn(len(it.sample.response_ids), generator=gen) for i, it in enumerate(items)}

    def total_loss(dp_size: int, budget: int, pad: int) -> float:
        plan = plan_minibatch(items, dp_size=dp_size, max_tokens=budget, pad_multiple=pad)
        total = 0.0
        for rank in range(dp_size):
            for mb in plan.micro_batches(rank):
                logprobs = mb.behaviour_logprobs.double().clone()
                for s, idx in enumerate(mb.item_index):
                    if idx >= 0:  # a made-up current policy: behaviour plus per-token noise
                        p = len(items[idx].sample.prompt_ids)
                        lo = int(mb.cu_seqlens_padded[s]) + p - 1
                        logprobs[lo : lo + len(noise[idx])] += noise[idx].double()
                out = grpo_loss(
                    logprobs,
                    mb.behaviour_logprobs.double(),
                    mb.advantages.double(),
                    mb.loss_mask,
                    mb.cu_seqlens_padded,
                    plan.normalizer,
                    config,
                )
                total += out.loss.item()
        return total

    whole = total_loss(1, 4096, 1)
    assert total_loss(3, 48, 2) == pytest.approx(whole, rel=1e-12)
    assert total_loss(2, 64, 8) == pytest.approx(whole, rel=1e-12)


def test_split_minibatches_keeps_whole_groups_in_order():
    groups = make_groups(groups=7, n=1)
    parts = split_minibatches(groups, 3)
    assert [len(p) for p in parts] == [2, 3, 2]
    assert [g for p in parts for g in p] == groups
    with pytest.raises(ValueError, match="minibatches_per_batch"):
        split_minibatches(groups, 8)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=60),
    dp_size=st.integers(1, 5),
    pad_multiple=st.sampled_from([1, 2, 4]),
    extra_budget=st.integers(0, 3),
)
def test_assignment_properties(lengths, dp_size, pad_multiple, extra_budget):
    budget = 64 * (1 + extra_budget)
    assignment = plan_assignment(lengths, dp_size=dp_size, max_tokens=budget, pad_multiple=pad_multiple)
    padded = [-(-n // pad_multiple) * pad_multiple for n in lengths]
    assert len(assignment) == dp_size
    assert len({len(rank) for rank in assignment}) == 1  # equal micro-batch counts
    assert sorted(i for rank in assignment for mb in rank for i in mb) == list(range(len(lengths)))
    for rank in assignment:
        for mb in rank:
            assert sum(padded[i] for i in mb) <= budget
    rank_tokens = [sum(padded[i] for mb in rank for i in mb) for rank in assignment]
    assert max(rank_tokens) - min(rank_tokens) <= max(padded, default=0)


def test_plan_batch_splits_groups_into_minibatches_with_their_advantages():
    groups = make_groups(seed=8, groups=5, n=4)
    groups[0].samples[0].finish_reason = "length"
    plans = plan_batch(groups, LossConfig(mask_truncated=True), minibatches=2, dp_size=2, max_tokens=64)
    assert [len(p.items) for p in plans] == [8, 12]  # groups 0-1 and 2-4, whole groups each
    # advantages are each group's own (std-normalised), in sample order
    expected = np.concatenate([group_advantages(g.rewards) for g in groups[:2]])
    np.testing.assert_allclose([it.advantage for it in plans[0].items], expected)
    truncated = len(groups[0].samples[0].response_ids)
    total = sum(len(s.response_ids) for g in groups[:2] for s in g.samples)
    assert plans[0].normalizer == Normalizer(tokens=total - truncated, sequences=7)
