"""Pack samples into padding-free (THD) micro-batches under a token budget, balanced over data-parallel ranks.

A sequence is ``prompt_ids + response_ids``. Packed tensors hold sequences back to back; at position t of a
sequence the model predicts ``labels[t] = tokens[t + 1]``, so everything about the response token that
position t predicts (behaviour logprob, version, advantage, loss mask) sits at t. The last position of a
sequence predicts nothing (loss mask 0).

Planning (identical on every rank, since every rank sees the whole batch):

1. **Data-parallel split**: sequences, longest first, go to the rank with the fewest tokens so far (LPT),
   which keeps ranks' token counts within one sequence of each other.
2. **Micro-batches per rank**: the fewest micro-batches ``k`` (from ceil(tokens / budget) up) into which
   LPT with capacity -- longest first, each into the least-loaded micro-batch that still fits -- places
   every sequence. Least-loaded rather than first-fit keeps micro-batches even, which pipeline stages like.
   With ``equal_counts`` every rank uses the same ``k`` (pipeline schedules and gradient sync expect it); a
   micro-batch left empty gets one fully masked filler sequence.
3. **Padding**: with ``pad_multiple`` > 1 each sequence is padded to a multiple of it (context parallel
   needs 2 * cp per sequence, sequence parallel tp per micro-batch: use 2 * cp * tp). Padding tokens are
   masked; ``cu_seqlens`` keeps the real lengths, ``cu_seqlens_padded`` the positions in the tensors
   (megatron-core's PackedSeqParams names).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tidal.broker.types import Group, Sample
from tidal.trainer.advantages import batch_advantages
from tidal.trainer.config import LossConfig
from tidal.trainer.losses import Normalizer


@dataclass
class SequenceItem:
    """One sample to train on, with its scalar advantage (0 for SFT)."""

    sample: Sample
    advantage: float = 0.0

    @property
    def length(self) -> int:
        return len(self.sample.prompt_ids) + len(self.sample.response_ids)

    def response_loss_mask(self, mask_truncated: bool) -> np.ndarray:
        """uint8 ``[R]``: which response tokens are trained on."""
        s = self.sample
        n = len(s.response_ids)
        if mask_truncated and s.finish_reason == "length":
            return np.zeros(n, dtype=np.uint8)
        if s.loss_mask is None:
            return np.ones(n, dtype=np.uint8)
        if len(s.loss_mask) != n:
            raise ValueError(f"sample loss_mask has {len(s.loss_mask)} entries for {n} response tokens")
        return (np.asarray(s.loss_mask) != 0).astype(np.uint8)


@dataclass
class MicroBatch:
    """One packed micro-batch; all per-token tensors are ``[T]`` (T includes padding)."""

    tokens: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64, restarting at 0 for each sequence
    labels: torch.Tensor  # int64, the next token; pad_token_id where nothing is predicted
    loss_mask: torch.Tensor  # float32, 1 where the label is a trained response token
    behaviour_logprobs: torch.Tensor  # float32, the rollout engine's logprob of the label
    advantages: torch.Tensor  # float32
    versions: torch.Tensor  # int64, policy version that generated the label (0 where masked)
    cu_seqlens: torch.Tensor  # int32 [S+1], real sequence lengths
    cu_seqlens_padded: torch.Tensor  # int32 [S+1], sequence positions in the tensors
    max_seqlen: int  # longest padded sequence
    item_index: list[int] = field(default_factory=list)  # index into the plan's items; -1 for filler
    # Set by the step on this rank's prepared (padded, context-parallel-local) micro-batch, never packed:
    proximal_logprobs: torch.Tensor | None = None  # float32, the batch's starting policy (no grad)
    ref_logprobs: torch.Tensor | None = None  # float32, the frozen reference model (no grad)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


@dataclass
class MinibatchPlan:
    """Which items each data-parallel rank trains, in which micro-batches, and the global normaliser."""

    items: list[SequenceItem]
    assignment: list[list[list[int]]]  # [rank][micro-batch] -> item indices
    normalizer: Normalizer
    pad_multiple: int = 1
    mask_truncated: bool = False
    pad_token_id: int = 0

    @property
    def dp_size(self) -> int:
        return len(self.assignment)

    def rank_tokens(self, rank: int) -> int:
        return sum(
            padded_length(self.items[i].length, self.pad_multiple) for mb in self.assignment[rank] for i in mb
        )

    def micro_batches(self, rank: int) -> list[MicroBatch]:
        """The packed micro-batches of one data-parallel rank."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"data-parallel rank {rank} is out of range for dp size {self.dp_size}")
        return [
            build_micro_batch(
                [self.items[i] for i in mb],
                mb,
                pad_multiple=self.pad_multiple,
                mask_truncated=self.mask_truncated,
                pad_token_id=self.pad_token_id,
            )
            for mb in self.assignment[rank]
        ]


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def items_from_groups(groups: Sequence[Group], advantages: Sequence[np.ndarray]) -> list[SequenceItem]:
    """Flatten groups into items, each sample with its advantage (``advantages[g][i]``)."""
    if len(groups) != len(advantages):
        raise ValueError(f"{len(groups)} groups but {len(advantages)} advantage arrays")
    items = []
    for group, adv in zip(groups, advantages, strict=True):
        if len(adv) != len(group.samples):
            raise ValueError(
                f"group {group.group_id}: {len(group.samples)} samples but {len(adv)} advantages"
            )
        items.extend(SequenceItem(s, float(a)) for s, a in zip(group.samples, adv, strict=True))
    return items


def split_minibatches(groups: Sequence[Group], count: int) -> list[list[Group]]:
    """Split a batch's groups into ``count`` contiguous minibatches of near-equal size (whole groups)."""
    if not 1 <= count <= len(groups):
        raise ValueError(
            f"cannot split {len(groups)} groups into {count} minibatches; "
            "trainer.minibatches_per_batch must be between 1 and the batch's group count"
        )
    bounds = [round(i * len(groups) / count) for i in range(count + 1)]
    return [list(groups[bounds[i] : bounds[i + 1]]) for i in range(count)]


def _lpt(sizes: Sequence[int], order: Sequence[int], bins: int, capacity: float) -> list[list[int]] | None:
    """Longest first into the least-loaded bin that fits; None when some item fits nowhere."""
    loads = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0, b) for b in range(bins)]  # (load, bin): the least-loaded bin first
    for i in order:
        load, b = heapq.heappop(heap)
        if load + sizes[i] > capacity:
            # The least-loaded bin cannot take it, so no bin can.
            return None
        loads[b] = load + sizes[i]
        out[b].append(i)
        heapq.heappush(heap, (loads[b], b))
    return out


def plan_assignment(
    lengths: Sequence[int],
    *,
    dp_size: int,
    max_tokens: int,
    pad_multiple: int = 1,
    equal_counts: bool = True,
) -> list[list[list[int]]]:
    """Assign sequences (by index) to data-parallel ranks and micro-batches; see the module docstring."""
    if dp_size < 1 or max_tokens < 1 or pad_multiple < 1:
        raise ValueError(
            f"dp_size, max_tokens and pad_multiple must be >= 1, got {dp_size}, {max_tokens}, {pad_multiple}"
        )
    if max_tokens % pad_multiple:
        raise ValueError(
            f"micro-batch token budget {max_tokens} is not a multiple of pad_multiple {pad_multiple}"
        )
    sizes = [padded_length(n, pad_multiple) for n in lengths]
    for i, n in enumerate(sizes):
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {lengths[i]} tokens ({n} padded), over the micro-batch budget of "
                f"{max_tokens}; raise trainer.micro_batch_tokens or lower the rollout's max length"
            )
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    by_rank = _lpt(sizes, order, dp_size, math.inf)
    assert by_rank is not None

    def pack_rank(indices: list[int], k: int) -> list[list[int]] | None:
        return _lpt(sizes, sorted(indices, key=lambda i: (-sizes[i], i)), k, max_tokens)

    def fewest(indices: list[int], start: int) -> int:
        k = max(start, 1, -(-sum(sizes[i] for i in indices) // max_tokens))
        while pack_rank(indices, k) is None:
            k += 1
        return k

    counts = [fewest(r, 1) for r in by_rank]
    if equal_counts:
        k = max(counts)
        # More bins never hurt LPT-with-capacity for one rank in practice, but check rather than assume.
        while any(pack_rank(r, k) is None for r in by_rank):
            k += 1
        counts = [k] * dp_size
    plan = [pack_rank(r, k) for r, k in zip(by_rank, counts, strict=True)]
    # Inside a micro-batch keep the batch order (stable, easier to read and to debug).
    return [[sorted(mb) for mb in rank] for rank in plan]  # type: ignore[union-attr]


def plan_minibatch(
    items: Sequence[SequenceItem],
    *,
    dp_size: int,
    max_tokens: int,
    pad_multiple: int = 1,
    mask_truncated: bool = False,
    equal_counts: bool = True,
    pad_token_id: int = 0,
) -> MinibatchPlan:
    """Plan a minibatch: rank / micro-batch assignment and the global loss normaliser."""
    items = list(items)
    assignment = plan_assignment(
        [it.length for it in items],
        dp_size=dp_size,
        max_tokens=max_tokens,
        pad_multiple=pad_multiple,
        equal_counts=equal_counts,
    )
    tokens = sequences = 0
    for it in items:
        n = int(_label_mask(it, mask_truncated).sum())
        tokens += n
        sequences += n > 0
    return MinibatchPlan(
        items=items,
        assignment=assignment,
        normalizer=Normalizer(tokens=float(tokens), sequences=float(sequences)),
        pad_multiple=pad_multiple,
        mask_truncated=mask_truncated,
        pad_token_id=pad_token_id,
    )


def _label_mask(item: SequenceItem, mask_truncated: bool) -> np.ndarray:
    """uint8 ``[L]``: position t is trained when it predicts a trained response token."""
    p = len(item.sample.prompt_ids)
    mask = np.zeros(item.length, dtype=np.uint8)
    response = item.response_loss_mask(mask_truncated)
    if len(response):
        mask[p - 1 : p - 1 + len(response)] = response
    return mask


def build_micro_batch(
    items: Sequence[SequenceItem],
    item_index: Sequence[int],
    *,
    pad_multiple: int = 1,
    mask_truncated: bool = False,
    pad_token_id: int = 0,
) -> MicroBatch:
    """Pack ``items`` back to back; an empty list gives one fully masked filler sequence."""
    item_index = list(item_index)
    if not items:
        return _filler(pad_multiple, pad_token_id)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("tok", "pos", "lab", "mask", "lp", "adv", "ver")}
    real, padded = [0], [0]
    for it in items:
        s = it.sample
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError("a sample has no prompt tokens; the first response token would have no context")
        if len(s.logprobs) != r or len(s.versions) != r:
            raise ValueError(
                f"sample has {r} response tokens but {len(s.logprobs)} logprobs and {len(s.versions)} versions"
            )
        n = p + r
        n_pad = padded_length(n, pad_multiple)
        tokens = np.full(n_pad, pad_token_id, dtype=np.int64)
        tokens[:p] = s.prompt_ids
        tokens[p:n] = s.response_ids
        labels = np.full(n_pad, pad_token_id, dtype=np.int64)
        labels[: n - 1] = tokens[1:n]
        mask = np.zeros(n_pad, dtype=np.float32)
        mask[:n] = _label_mask(it, mask_truncated)
        logprobs = np.zeros(n_pad, dtype=np.float32)
        logprobs[p - 1 : n - 1] = s.logprobs
        versions = np.zeros(n_pad, dtype=np.int64)
        versions[p - 1 : n - 1] = s.versions
        advantages = np.zeros(n_pad, dtype=np.float32)
        advantages[p - 1 : n - 1] = it.advantage
        parts["tok"].append(tokens)
        parts["pos"].append(np.arange(n_pad, dtype=np.int64))
        parts["lab"].append(labels)
        parts["mask"].append(mask)
        parts["lp"].append(logprobs)
        parts["adv"].append(advantages * mask)
        parts["ver"].append(versions)
        real.append(real[-1] + n)
        padded.append(padded[-1] + n_pad)

    def cat(key: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts[key]))

    return MicroBatch(
        tokens=cat("tok"),
        position_ids=cat("pos"),
        labels=cat("lab"),
        loss_mask=cat("mask"),
        behaviour_logprobs=cat("lp"),
        advantages=cat("adv"),
        versions=cat("ver"),
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(padded, dtype=torch.int32),
        max_seqlen=int(np.diff(padded).max()),
        item_index=item_index,
    )


def _filler(pad_multiple: int, pad_token_id: int) -> MicroBatch:
    n = pad_multiple
    zeros = torch.zeros(n, dtype=torch.float32)
    return MicroBatch(
        tokens=torch.full((n,), pad_token_id, dtype=torch.int64),
        position_ids=torch.arange(n, dtype=torch.int64),
        labels=torch.full((n,), pad_token_id, dtype=torch.int64),
        loss_mask=zeros,
        behaviour_logprobs=zeros.clone(),
        advantages=zeros.clone(),
        versions=torch.zeros(n, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, n], dtype=torch.int32),
        max_seqlen=n,
        item_index=[-1],
    )


def plan_batch(
    groups: Sequence[Group],
    config: LossConfig,
    *,
    minibatches: int,
    dp_size: int,
    max_tokens: int,
    pad_multiple: int = 1,
    pad_token_id: int = 0,
) -> list[MinibatchPlan]:
    """A broker batch to one plan per minibatch: group advantages, whole groups per minibatch, packing."""
    plans = []
    for part in split_minibatches(groups, minibatches):
        advantages = batch_advantages(part, norm_by_std=config.norm_adv_by_std, eps=config.adv_epsilon)
        plans.append(
            plan_minibatch(
                items_from_groups(part, advantages),
                dp_size=dp_size,
                max_tokens=max_tokens,
                pad_multiple=pad_multiple,
                mask_truncated=config.mask_truncated,
                pad_token_id=pad_token_id,
            )
        )
    return plans
