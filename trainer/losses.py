"""GRPO / DAPO policy loss with off-policy correction, KL, entropy and SFT NLL on packed (THD) tokens.

Pure PyTorch, no framework: every function takes flat per-token tensors of one packed micro-batch
(``[T]``, the layout of :mod:`tidal.trainer.packing`) plus ``cu_seqlens`` (``[S+1]``, the packed sequence
boundaries, padding included) and returns a scalar loss with its statistics. docs/algorithms.md gives the
formulas and where each term comes from.

How the loss is normalised (the one rule to know when calling these): the returned loss is this
micro-batch's *share* of the minibatch loss. Denominators come from :class:`Normalizer`, which holds the
counts of the WHOLE minibatch (all micro-batches, all data-parallel ranks), so that summing the returned
losses over every micro-batch and every rank gives the minibatch loss however it was split. A trainer whose
data-parallel gradient reduction averages over ranks (megatron-core DDP's default) must multiply by the
number of ranks it averages over. Denominators never depend on correction masks (IcePop, off-policy): a
masked token counts in the denominator and contributes zero, so masking shrinks the update instead of
re-weighting the surviving tokens, and no extra collective is needed.

Context parallel: a CP rank holds part of each sequence. Per-sequence quantities that need the whole
sequence (token counts for ``seq-mean-token-mean``, sequence-level IS weights, the off-policy masks) are
summed over the sequence by ``seq_reduce``: pass a function that all-reduces (SUM) a ``[S]`` tensor over
the CP group; the default (identity) is right when sequences are whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tidal.trainer.config import LossConfig
from tidal.trainer.metrics import StepStats

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
SeqReduce = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Normalizer:
    """Denominators of the whole minibatch: loss tokens and sequences with at least one loss token."""

    tokens: float
    sequences: float

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 0:
            raise ValueError(
                f"Normalizer counts must be >= 0, got tokens={self.tokens} sequences={self.sequences}"
            )

    @staticmethod
    def of(loss_mask: Tensor, cu_seqlens: Tensor) -> Normalizer:
        """The counts of one packed micro-batch; add several with ``+`` to get a minibatch's."""
        per_seq = sequence_sums(loss_mask.float(), cu_seqlens)
        return Normalizer(tokens=float(loss_mask.float().sum()), sequences=float((per_seq > 0).sum()))

    def __add__(self, other: Normalizer) -> Normalizer:
        return Normalizer(self.tokens + other.tokens, self.sequences + other.sequences)


@dataclass
class LossResult:
    loss: Tensor  # scalar; this micro-batch's share of the minibatch loss
    stats: StepStats


# ----------------------------------------------------------------------------------------------- helpers


def segment_ids(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """Index of the sequence each token belongs to, ``[T]``, from boundaries ``[S+1]``."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    if total is not None and int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the micro-batch has {total} tokens")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)


def sequence_sums(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence sums ``[S]`` of per-token ``values`` ``[T]``; differentiable."""
    seg = segment_ids(cu_seqlens, values.numel()).to(values.device)
    out = torch.zeros(cu_seqlens.numel() - 1, dtype=values.dtype, device=values.device)
    return out.index_add(0, seg, values)


def _identity(t: Tensor) -> Tensor:
    return t


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    cu_seqlens: Tensor,
    mode: Aggregation,
    normalizer: Normalizer,
    *,
    seq_token_counts: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss to this micro-batch's share of the minibatch loss.

    - ``token-mean``: sum_t m_t l_t / N_tokens (every token of the minibatch weighs the same);
    - ``seq-mean-token-sum``: sum_t m_t l_t / N_seqs (each sequence's token sum, averaged over sequences);
    - ``seq-mean-token-mean``: sum_s (sum_{t in s} m_t l_t / n_s) / N_seqs, with n_s the sequence's loss
      tokens (``seq_token_counts``, whole-sequence counts under CP; defaults to the sums of ``mask``).
    """
    masked = torch.where(mask > 0, per_token, 0.0) * mask  # an inf off the mask must not become NaN
    if mode == "token-mean":
        return masked.sum() / max(normalizer.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(normalizer.sequences, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = sequence_sums(masked, cu_seqlens)
        counts = sequence_sums(mask.detach(), cu_seqlens) if seq_token_counts is None else seq_token_counts
        per_seq_mean = per_seq / counts.clamp(min=1.0)
        return per_seq_mean.sum() / max(normalizer.sequences, 1.0)
    raise ValueError(
        f"unknown loss aggregation {mode!r}; use token-mean, seq-mean-token-sum or seq-mean-token-mean"
    )


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: Literal["k1", "k2", "k3"],
    clamp: float | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

    With log r = log pi_ref - log pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r.
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.exp(log_r) - 1.0 - log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] per token, ``[T, V] -> [T]`` (unsharded vocabulary)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per token, ``[T, V] -> [T]`` (unsharded vocabulary)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def needs_trainer_logprobs(config: LossConfig) -> bool:
    """Whether the loss compares the behaviour policy with the trainer's (proximal) policy."""
    return config.tis != "off" or config.icepop is not None or config.offpolicy_max_kl is not None


def check_loss_setup(config: LossConfig, minibatches_per_batch: int) -> None:
    """Fail early on a combination the loss cannot honour exactly; call before training starts.

    Without recomputed proximal logprobs the corrections use the current policy as pi_prox, which is only
    the batch's starting policy on its first minibatch step.
    """
    if (
        needs_trainer_logprobs(config)
        and minibatches_per_batch > 1
        and not config.recompute_proximal_logprobs
    ):
        raise ValueError(
            f"trainer.loss: tis={config.tis!r} / icepop / offpolicy_max_kl with "
            f"trainer.minibatches_per_batch={minibatches_per_batch} need the batch's proximal logprobs; "
            "set trainer.loss.recompute_proximal_logprobs=true (or minibatches_per_batch=1)"
        )


# ----------------------------------------------------------------------------------------------- losses


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    normalizer: Normalizer,
    config: LossConfig,
    *,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    seq_reduce: SeqReduce | None = None,
) -> LossResult:
    """Clipped-surrogate policy loss with off-policy correction, KL to a reference and an entropy bonus.

    Args:
        logprobs: ``[T]`` log pi_theta(label_t) of the policy being trained (carries the gradient).
        behaviour_logprobs: ``[T]`` log mu(label_t) reported by the rollout engine (behaviour policy).
        advantages: ``[T]`` per-token advantages (a sample's group-normalised advantage on its tokens).
        loss_mask: ``[T]`` 1 on tokens that are trained on (response tokens), 0 elsewhere.
        cu_seqlens: ``[S+1]`` packed sequence boundaries (padding included), ending at ``T``.
        normalizer: the minibatch's denominators (see the module docstring).
        config: the loss options.
        proximal_logprobs: ``[T]`` log pi_prox(label_t) recomputed by the trainer with the weights the batch
            started from (AReaL's decoupled PPO). When given, the PPO ratio is pi_theta / pi_prox and the
            importance weight is pi_prox / mu. When absent and a correction needs the trainer's view
            (TIS, IcePop, KL mask), ``logprobs.detach()`` stands in for it: identical to recomputing on
            the first minibatch step of a batch, so it is exact when ``minibatches_per_batch == 1``.
            When absent and no correction is on, the ratio is pi_theta / mu: plain GRPO.
        ref_logprobs: ``[T]`` reference-policy logprobs; required when ``config.kl_coef > 0``, reported
            as a statistic otherwise.
        entropy: ``[T]`` per-token entropy of pi_theta; required when ``config.entropy_coef > 0``.
        versions: ``[T]`` policy version that generated each token; with ``current_version`` gives
            the staleness statistics and ``offpolicy_max_staleness``.
        current_version: the trainer's policy version (optimizer steps taken).
        seq_reduce: sums a ``[S]`` tensor over the context-parallel group (identity without CP).
    """
    reduce = seq_reduce or _identity
    mask = loss_mask.to(logprobs.dtype)
    behaviour = behaviour_logprobs.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    seg = segment_ids(cu_seqlens, logprobs.numel()).to(logprobs.device)
    seq_counts = reduce(sequence_sums(mask.detach(), cu_seqlens))
    stats = StepStats()
    n_tokens = mask.sum()

    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            "loss.kl_coef > 0 needs ref_logprobs from a reference model; set loss.kl_coef=0 to train without"
        )
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs the per-token entropy of the policy; pass entropy=")
    if config.offpolicy_max_staleness is not None and (versions is None or current_version is None):
        raise ValueError("loss.offpolicy_max_staleness needs versions= and current_version=")

    # The trainer-side policy that the behaviour policy is compared with (None: plain GRPO, no comparison).
    if proximal_logprobs is not None:
        proximal = proximal_logprobs.detach().to(logprobs.dtype)
    elif needs_trainer_logprobs(config):
        proximal = logprobs.detach()
    else:
        proximal = None
    anchor = behaviour if proximal is None else proximal

    # PPO clipped surrogate, DAPO's asymmetric clip, and the dual clip for negative advantages.
    # Log-ratios are zeroed off the loss mask: prompt and padding logprobs can be extreme, and an inf
    # there would turn into NaN through 0 * inf in the backward pass. On loss tokens x * 1 == x exactly.
    ratio = torch.exp((logprobs - anchor) * mask)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if config.clip_ratio_c is not None:
        dual = -adv * config.clip_ratio_c
        dual_active = (adv < 0) & (dual < per_token)
        per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)

    keep = torch.ones_like(mask)
    if proximal is not None:
        log_w = (proximal - behaviour) * mask  # log pi_prox / mu, detached
        token_w = torch.exp(log_w)
        if config.icepop is not None:
            low, high = config.icepop
            in_band = ((token_w >= low) & (token_w <= high)).to(mask.dtype)
            stats.add_mean("offpolicy/icepop_masked_frac", ((1 - in_band) * mask).sum(), n_tokens)
            keep = keep * in_band
        if config.tis == "token":
            weight = token_w.clamp(max=config.tis_cap)
            stats.add_mean(
                "offpolicy/tis_truncated_frac", ((token_w > config.tis_cap) * mask).sum(), n_tokens
            )
        elif config.tis in ("sequence", "geometric"):
            seq_log_w = reduce(sequence_sums(log_w * mask, cu_seqlens))
            if config.tis == "geometric":
                seq_log_w = seq_log_w / seq_counts.clamp(min=1.0)
            cap = math.log(config.tis_cap)
            n_seqs = (seq_counts > 0).sum()
            stats.add_mean(
                "offpolicy/tis_truncated_frac", ((seq_log_w > cap) & (seq_counts > 0)).sum(), n_seqs
            )
            weight = torch.exp(seq_log_w.clamp(max=cap))[seg]
        else:
            weight = token_w  # decoupled PPO: uncorrected behaviour -> proximal weight
        per_token = per_token * weight
        stats.add_mean("offpolicy/is_weight_mean", (weight * mask).sum(), n_tokens)
        stats.add_max("offpolicy/is_weight_max", _masked_max(weight, mask))
        stats.add_min("offpolicy/is_weight_min", -_masked_max(-weight, mask))
    else:
        # Not used by the loss, only reported: the engine/trainer mismatch against the current policy (on a
        # batch's first minibatch step that is the trainer's view of the same weights).
        log_w = (logprobs.detach() - behaviour) * mask
        token_w = torch.exp(log_w)
    stats.add_mean("offpolicy/mismatch_kl_k1", (-log_w * mask).sum(), n_tokens)
    mismatch_k3 = token_w - 1.0 - log_w
    stats.add_mean("offpolicy/mismatch_kl_k3", (mismatch_k3 * mask).sum(), n_tokens)

    # Off-policy sequence masks: too stale, or too far from the trainer's policy.
    seq_drop = torch.zeros_like(seq_counts, dtype=torch.bool)
    if config.offpolicy_max_staleness is not None:
        too_old = ((current_version - versions.to(torch.long)) > config.offpolicy_max_staleness).to(
            mask.dtype
        )
        seq_drop |= reduce(sequence_sums(too_old * mask, cu_seqlens)) > 0
    if config.offpolicy_max_kl is not None:
        seq_kl = reduce(sequence_sums(mismatch_k3 * mask, cu_seqlens)) / seq_counts.clamp(min=1.0)
        seq_drop |= seq_kl > config.offpolicy_max_kl
    if config.offpolicy_max_staleness is not None or config.offpolicy_max_kl is not None:
        token_drop = seq_drop[seg]
        if config.offpolicy_mask_negative_only:
            token_drop = token_drop & (adv < 0)
        keep = keep * (~token_drop).to(mask.dtype)
        stats.add_mean("offpolicy/seq_masked_frac", (token_drop * mask).sum(), n_tokens)

    effective = mask * keep  # exact: keep is all ones unless a mask is configured
    pg_loss = aggregate(per_token, effective, cu_seqlens, config.agg, normalizer, seq_token_counts=seq_counts)
    loss = pg_loss
    stats.add_sum("loss/pg", pg_loss)

    if ref_logprobs is not None:
        ref = torch.where(mask > 0, ref_logprobs.to(logprobs.dtype), logprobs.detach())  # finite off the mask
        kl = kl_penalty(logprobs, ref, config.kl_estimator, config.kl_clamp)
        kl_loss = aggregate(kl, effective, cu_seqlens, config.agg, normalizer, seq_token_counts=seq_counts)
        stats.add_sum("loss/kl", kl_loss)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl_loss
    if entropy is not None:
        ent = aggregate(entropy, effective, cu_seqlens, config.agg, normalizer, seq_token_counts=seq_counts)
        stats.add_sum("loss/entropy", ent)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent

    stats.add_sum("loss/total", loss)
    stats.add_mean("actor/ratio_mean", (ratio.detach() * mask).sum(), n_tokens)
    stats.add_mean("actor/clip_frac_low", ((clip_active & (adv < 0)) * mask).sum(), n_tokens)
    stats.add_mean("actor/clip_frac_high", ((clip_active & (adv > 0)) * mask).sum(), n_tokens)
    stats.add_mean("actor/clip_frac_dual", (dual_active * mask).sum(), n_tokens)
    stats.add_mean("actor/advantage_mean", (adv * mask).sum(), n_tokens)
    stats.add_sum("actor/loss_tokens", n_tokens)
    if versions is not None and current_version is not None:
        staleness = (current_version - versions.to(torch.long)).to(mask.dtype)
        stats.add_mean("offpolicy/staleness_mean", (staleness * mask).sum(), n_tokens)
        stats.add_max("offpolicy/staleness_max", _masked_max(staleness, mask))
    return LossResult(loss=loss, stats=stats)


def sft_loss(
    logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    normalizer: Normalizer,
    agg: Aggregation = "token-mean",
    *,
    seq_reduce: SeqReduce | None = None,
) -> LossResult:
    """Negative log-likelihood of the masked (response) tokens, aggregated like the RL loss."""
    reduce = seq_reduce or _identity
    mask = loss_mask.to(logprobs.dtype)
    seq_counts = reduce(sequence_sums(mask.detach(), cu_seqlens))
    nll = aggregate(-logprobs, mask, cu_seqlens, agg, normalizer, seq_token_counts=seq_counts)
    stats = StepStats()
    stats.add_sum("loss/nll", nll)
    stats.add_sum("loss/total", nll)
    stats.add_sum("actor/loss_tokens", mask.sum())
    return LossResult(loss=nll, stats=stats)


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` over tokens with ``mask`` set; -inf when none is."""
    fill = torch.full_like(values, -math.inf)
    return torch.where(mask > 0, values, fill).max() if values.numel() else torch.tensor(-math.inf)
