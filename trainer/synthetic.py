"""A fixed synthetic GRPO batch and a small training driver, for parallel-equivalence tests and benchmarks.

The batch is a function of a seed only (numpy generator), identical on every rank, so any mesh trains the
same data; no broker is involved.
"""

from __future__ import annotations

import numpy as np

from tidal.broker.types import Group, Sample
from tidal.trainer.config import LossConfig
from tidal.trainer.losses import grpo_loss, sft_loss
from tidal.trainer.packing import MinibatchPlan, items_from_groups, plan_minibatch


def synthetic_groups(
    *, vocab_size: int, groups: int = 4, group_size: int = 4, prompt_len=(3, 9), response_len=(2, 10), seed=0
) -> list[Group]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        samples = []
        for _ in range(group_size):
            p = int(rng.integers(*prompt_len))
            r = int(rng.integers(*response_len))
            samples.append(
                Sample(
                    prompt_ids=rng.integers(0, vocab_size, p).astype(np.int32),
                    response_ids=rng.integers(0, vocab_size, r).astype(np.int32),
                    logprobs=(-rng.random(r) * 3 - 0.5).astype(np.float32),
                    versions=np.zeros(r, dtype=np.int32),
                    reward=float(rng.random() < 0.5),
                    finish_reason="stop",
                )
            )
        out.append(Group(group_id=f"0:{g}", samples=samples))
    return out


def plan(groups: list[Group], *, dp_size: int, max_tokens: int, pad_multiple: int) -> MinibatchPlan:
    from tidal.trainer.advantages import batch_advantages

    advantages = batch_advantages(groups, norm_by_std=True)
    items = items_from_groups(groups, advantages)
    return plan_minibatch(items, dp_size=dp_size, max_tokens=max_tokens, pad_multiple=pad_multiple)


def make_loss(kind: str, config: LossConfig, normalizer, current_version: int = 0):
    """A :data:`tidal.trainer.step.LossFn` for the GRPO or SFT loss."""

    def grpo(logprobs, entropy, mb, seq_reduce):
        return grpo_loss(
            logprobs,
            mb.behaviour_logprobs,
            mb.advantages,
            mb.loss_mask,
            mb.cu_seqlens_padded,
            normalizer,
            config,
            proximal_logprobs=mb.proximal_logprobs,
            ref_logprobs=mb.ref_logprobs,
            entropy=entropy,
            versions=mb.versions,
            current_version=current_version,
            seq_reduce=seq_reduce,
        )

    def sft(logprobs, entropy, mb, seq_reduce):
        return sft_loss(
            logprobs, mb.loss_mask, mb.cu_seqlens_padded, normalizer, config.agg, seq_reduce=seq_reduce
        )

    if kind not in ("grpo", "sft"):
        raise ValueError(f"unknown loss kind {kind!r}; use grpo or sft")
    return grpo if kind == "grpo" else sft
