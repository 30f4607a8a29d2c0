"""One optimizer step: forward-backward over packed micro-batches through megatron's pipeline schedules.

Every rank gets the same list of this data-parallel rank's packed micro-batches (:mod:`tidal.trainer.packing`);
a context-parallel rank keeps its two load-balanced chunks of every sequence (:func:`cp_local`). The loss
functions (:mod:`tidal.trainer.losses`) return each micro-batch's share of the minibatch loss, normalised by
minibatch-wide counts, so the gradient we want is the plain SUM over micro-batches and ranks. megatron's
per-token-loss mode sums gradients over dp x cp and divides by the summed token counts; each micro-batch
reports a count of 1 and multiplies its share by (micro-batches x dp x cp), which cancels that division
exactly whatever the loss aggregation mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist

from tidal.trainer.attention import cp_token_positions
from tidal.trainer.device_step import device_step
from tidal.trainer.losses import LossResult
from tidal.trainer.metrics import StepStats
from tidal.trainer.packing import MicroBatch

# (logprobs [T], entropy [T] or None, the local micro-batch, seq_reduce) -> this micro-batch's loss share
LossFn = Callable[[torch.Tensor, torch.Tensor | None, MicroBatch, Callable], LossResult]

_PER_TOKEN = ("tokens", "position_ids", "labels", "loss_mask", "behaviour_logprobs", "advantages", "versions")


@dataclass
class StepResult:
    loss: float  # the minibatch loss (sum of the shares)
    grad_norm: float
    update_successful: bool
    tokens: int  # tokens processed by all data-parallel ranks (padding included)
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)


def cp_local(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This context-parallel rank's share of a packed micro-batch (cu_seqlens stay global)."""
    if cp_size == 1:
        return mb
    index = cp_token_positions(mb.cu_seqlens_padded.long(), cp_size, cp_rank)
    return replace(mb, **{name: getattr(mb, name).index_select(0, index) for name in _PER_TOKEN})


def pad_micro_batch(mb: MicroBatch, length: int, pad_token_id: int = 0) -> MicroBatch:
    """``mb`` extended to ``length`` tokens by one fully masked filler sequence."""
    extra = length - mb.num_tokens
    if extra < 0:
        raise ValueError(f"cannot pad a micro-batch of {mb.num_tokens} tokens down to {length}")
    if extra == 0:
        return mb
    zeros = torch.zeros(extra, dtype=torch.float32)
    fill = dict(
        tokens=torch.full((extra,), pad_token_id, dtype=torch.int64),
        position_ids=torch.arange(extra, dtype=torch.int64),
        labels=torch.full((extra,), pad_token_id, dtype=torch.int64),
        loss_mask=zeros,
        behaviour_logprobs=zeros,
        advantages=zeros,
        versions=torch.zeros(extra, dtype=torch.int64),
    )
    end = torch.tensor([length], dtype=torch.int32)
    return replace(
        mb,
        **{
            name: torch.cat([getattr(mb, name), fill[name].to(getattr(mb, name).dtype)])
            for name in _PER_TOKEN
        },
        cu_seqlens=torch.cat([mb.cu_seqlens, end]),
        cu_seqlens_padded=torch.cat([mb.cu_seqlens_padded, end]),
        max_seqlen=max(mb.max_seqlen, extra),
    )


def equalize_lengths(micro_batches: list[MicroBatch], group=None, device=None) -> list[MicroBatch]:
    """Pad the i-th micro-batch of every rank to the same length.

    megatron's allgather MoE dispatcher gathers tokens over tp x ep with equal sizes only.
    """
    lengths = torch.tensor([mb.num_tokens for mb in micro_batches], dtype=torch.int64, device=device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    return [pad_micro_batch(mb, int(n)) for mb, n in zip(micro_batches, lengths.tolist(), strict=True)]


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if mb.tokens.device == device:
        return mb
    moved = {
        name: getattr(mb, name).to(device, non_blocking=True)
        for name in (*_PER_TOKEN, "proximal_logprobs", "ref_logprobs")
        if getattr(mb, name) is not None
    }
    return replace(
        mb, **moved, cu_seqlens=mb.cu_seqlens.to(device), cu_seqlens_padded=mb.cu_seqlens_padded.to(device)
    )


def local_cu_seqlens(mb: MicroBatch, cp_size: int) -> torch.Tensor:
    """Sequence boundaries within this rank's tokens (each sequence holds 1/cp of its padded length)."""
    return (mb.cu_seqlens_padded // cp_size).to(torch.int32)


class _VocabParallel:
    """Per-token log-probabilities and entropy from vocabulary-sharded logits (TP): the plain fp32 formula.

    ``trainer.kernels.logprobs=reference``; the default is :class:`_FusedVocabParallel`.
    """

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.group = ps.get_tensor_model_parallel_group()
        self.size = ps.get_tensor_model_parallel_world_size()
        self.rank = ps.get_tensor_model_parallel_rank()

    def logprobs(self, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, temperature: float):
        if temperature != 1.0:
            logits = logits / temperature
        return self(logits, labels, with_entropy)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x) if self.size > 1 else x

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
        logits = logits.float()
        shard = logits.shape[-1]
        start = self.rank * shard
        peak = logits.detach().max(dim=-1).values
        if self.size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        shifted = logits - peak[:, None]
        exp = shifted.exp()
        sum_exp = self._sum(exp.sum(dim=-1))
        log_z = sum_exp.log()
        local = labels - start
        in_shard = (local >= 0) & (local < shard)
        picked = shifted.gather(-1, local.clamp(0, shard - 1)[:, None]).squeeze(-1) * in_shard
        logprobs = self._sum(picked) - log_z
        entropy = None
        if with_entropy:
            entropy = log_z - self._sum((exp * shifted).sum(dim=-1)) / sum_exp
        return logprobs, entropy


class _FusedVocabParallel(_VocabParallel):
    """The same values through :func:`~tidal.trainer.fused_logprobs.vocab_parallel_logprobs` (row chunks,
    no fp32 copy of the logits kept for the backward)."""

    def __init__(self, chunk_tokens: int, impl: str = "fused"):
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.impl = impl

    def logprobs(self, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, temperature: float):
        from tidal.trainer.fused_logprobs import vocab_parallel_logprobs

        return vocab_parallel_logprobs(
            logits,
            labels,
            with_entropy=with_entropy,
            temperature=temperature,
            chunk_tokens=self.chunk_tokens,
            group=self.group if self.size > 1 else None,
            vocab_start=self.rank * logits.shape[-1],
            impl=self.impl,
        )


def _kernels(chunks):
    """``trainer.kernels`` as ``build_model`` recorded it on the model (defaults when absent)."""
    from tidal.trainer.config import KernelConfig
    from tidal.trainer.models import unwrap

    return getattr(unwrap(chunks[0]), "tidal_kernels", None) or KernelConfig()


def _prepare_optimizer(state) -> None:
    """The optimizer helpers and Adam kernel ``trainer.kernels`` asks for (before the first step)."""
    from tidal.trainer import fused_optim

    kernels = _kernels(state.chunks)
    fused_optim.install(kernels.multi_tensor == "foreach")
    if kernels.multi_tensor == "foreach":
        fused_optim.batch_shard_copies(state.optimizer)  # once per optimizer; no-op after
    if kernels.adam != "foreach" and not getattr(state, "_tidal_adam_checked", False):
        switched = fused_optim.use_fused_adam(state.optimizer)
        if kernels.adam == "fused" and not switched:
            raise ValueError(
                "trainer.kernels.adam=fused: no torch Adam with CUDA parameters and no state yet in this "
                "optimizer (CPU run, Apex/TE optimizer, or already stepped); use auto or foreach"
            )
        state._tidal_adam_checked = True


def _logprob_impl(chunks) -> _VocabParallel:
    """The logprob implementation ``trainer.kernels`` asks for (kept on the model by ``build_model``)."""
    kernels = _kernels(chunks)
    if kernels.logprobs == "reference":
        return _VocabParallel()
    return _FusedVocabParallel(kernels.logprobs_chunk_tokens, kernels.logprobs)


def _cp_seq_reduce(cp_group, cp_size: int):
    if cp_size == 1:
        return lambda t: t

    def reduce(t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t, group=cp_group)

    return reduce


def prepare_micro_batches(chunks, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """This rank's micro-batches as the schedule consumes them: padded where megatron needs equal
    lengths, cut to this context-parallel rank's tokens. Deterministic, so every pass over the same
    minibatch (proximal, reference, training) sees the same tokens in the same places."""
    from megatron.core import parallel_state as ps

    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch (plan with equal_counts=True)")
    tconfig = chunks[0].config
    device = next(chunks[0].parameters()).device
    if tconfig.num_moe_experts and (
        tconfig.moe_token_dispatcher_type == "allgather" or tconfig.expert_tensor_parallel_size > 1
    ):
        # megatron's allgather MoE dispatcher gathers tokens over tp x ep with equal sizes only, and both
        # dispatchers all-gather over the expert-TP group, whose ranks may hold different DP shards
        micro_batches = equalize_lengths(micro_batches, device=device)
    if len(chunks) > 1:
        # the interleaved schedule sizes its receive buffers from seq_length, not per micro-batch
        longest = max(mb.num_tokens for mb in micro_batches)
        micro_batches = [pad_micro_batch(mb, longest) for mb in micro_batches]
    cp_size = ps.get_context_parallel_world_size()
    cp_rank = ps.get_context_parallel_rank()
    return [cp_local(mb, cp_size, cp_rank) for mb in micro_batches]


def _run_schedule(
    chunks, local: list[MicroBatch], loss_fn: LossFn, *, with_entropy, forward_only, temperature
):
    """One pass of megatron's pipeline schedule over prepared micro-batches; returns the loss outputs."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts train at temperature 1)")
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tconfig = chunks[0].config
    device = next(chunks[0].parameters()).device  # collectives on NCCL need tensors on the GPU
    cp_size = ps.get_context_parallel_world_size()
    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    scale = float(len(local) * dp_cp)
    vocab = _logprob_impl(chunks)
    seq_reduce = _cp_seq_reduce(ps.get_context_parallel_group() if cp_size > 1 else None, cp_size)
    tconfig.variable_seq_lengths = len(chunks) == 1

    def loss_func(mb: MicroBatch, output: torch.Tensor):
        logits = output.reshape(-1, output.shape[-1])  # [1, T, V/tp] -> [T, V/tp]
        logprobs, entropy = vocab.logprobs(logits, mb.labels, with_entropy, temperature)
        result = loss_fn(
            logprobs, entropy, replace(mb, cu_seqlens_padded=local_cu_seqlens(mb, cp_size)), seq_reduce
        )
        return result.loss * scale, torch.tensor(1, dtype=torch.int), {"stats": result.stats}

    def forward_step(data_iterator, model):
        mb = _to_device(next(data_iterator), device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seqlens,
            cu_seqlens_kv=mb.cu_seqlens,
            cu_seqlens_q_padded=mb.cu_seqlens_padded,
            cu_seqlens_kv_padded=mb.cu_seqlens_padded,
            max_seqlen_q=mb.max_seqlen,
            max_seqlen_kv=mb.max_seqlen,
        )
        output = model(mb.tokens[None], mb.position_ids[None], None, packed_seq_params=params)
        return output, partial(loss_func, mb)

    iterators = [iter(local) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(local),
        seq_length=max(mb.tokens.numel() for mb in local),
        micro_batch_size=1,
        forward_only=forward_only,
    )


@torch.no_grad()
def forward_logprobs(chunks, local: list[MicroBatch], temperature: float = 1.0) -> list[torch.Tensor | None]:
    """Per-token logprobs of the labels of each prepared micro-batch under ``chunks``' current weights,
    without gradients (proximal policy, reference model). Entries are None off the last pipeline stage,
    which is the only one that computes a loss."""
    from megatron.core import parallel_state as ps

    captured: list[torch.Tensor] = []

    def capture(logprobs, entropy, mb, seq_reduce) -> LossResult:
        captured.append(logprobs.detach().float())
        return LossResult(loss=logprobs.new_zeros(()), stats=StepStats())

    # no_grad (the decorator) also keeps a router with an expert bias from counting these tokens towards
    # its bias update (megatron counts only while grad is enabled)
    _run_schedule(chunks, local, capture, with_entropy=False, forward_only=True, temperature=temperature)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return [None] * len(local)
    if len(captured) != len(local):
        raise RuntimeError(f"forward_logprobs: {len(captured)} results for {len(local)} micro-batches")
    return [lp.to(mb.tokens.device) for lp, mb in zip(captured, local, strict=True)]


def policy_logprobs(state, micro_batches: list[MicroBatch], temperature: float = 1.0):
    """The current policy's logprobs of this DP rank's ``micro_batches``, without gradients: the proximal
    policy when called before a batch's first update. Pass the result to :func:`train_step`."""
    return forward_logprobs(state.chunks, prepare_micro_batches(state.chunks, micro_batches), temperature)


def train_step(
    state,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    *,
    with_entropy: bool = False,
    forward_only: bool = False,
    temperature: float = 1.0,
    proximal_logprobs: list[torch.Tensor | None] | None = None,
    reference_chunks: list[torch.nn.Module] | None = None,
) -> StepResult:
    """Forward-backward over ``micro_batches`` (this DP rank's), then one optimizer step.

    ``temperature`` divides the logits before log-probabilities are taken: the engines report the
    logprobs of the temperature-scaled distribution they sampled from, and the importance ratio must
    compare like with like. ``proximal_logprobs``: what :func:`policy_logprobs` returned for these
    micro-batches before the batch's first update (AReaL's decoupled PPO); they reach the loss as
    ``mb.proximal_logprobs``. ``reference_chunks``: a frozen model whose logprobs (a pass without grad
    before the update) reach the loss as ``mb.ref_logprobs`` (KL).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    started = time.perf_counter()
    chunks = state.chunks
    tconfig = chunks[0].config
    device = next(chunks[0].parameters()).device
    local = prepare_micro_batches(chunks, micro_batches)
    if proximal_logprobs is not None:
        if len(proximal_logprobs) != len(local):
            raise ValueError(
                f"{len(proximal_logprobs)} proximal logprob tensors for {len(local)} micro-batches: "
                "pass what policy_logprobs returned for the same micro-batches"
            )
        local = [replace(mb, proximal_logprobs=p) for mb, p in zip(local, proximal_logprobs, strict=True)]
    if reference_chunks is not None:
        reference = forward_logprobs(reference_chunks, local, temperature)
        local = [replace(mb, ref_logprobs=r) for mb, r in zip(local, reference, strict=True)]

    if not forward_only:
        _prepare_optimizer(state)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    fast_step = None
    if not forward_only:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        fast_step = device_step(state, _kernels(chunks))
        if fast_step is not None:
            fast_step.arm()  # finalize_model_grads' 1 / tokens is kept for Adam, not multiplied in
    outputs = _run_schedule(
        chunks, local, loss_fn, with_entropy=with_entropy, forward_only=forward_only, temperature=temperature
    )
    grad_norm, ok = float("nan"), True
    if not forward_only:
        if fast_step is not None:
            ok, grad_norm = fast_step.step()
        else:
            ok, grad_norm, _ = state.optimizer.step()
        state.scheduler.step(increment=1)
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    stats = _reduce_stats(outputs, device)
    cp_size = ps.get_context_parallel_world_size()
    tokens = torch.tensor(sum(mb.num_tokens for mb in local) * cp_size, dtype=torch.float64, device=device)
    dist.all_reduce(tokens, group=ps.get_data_parallel_group())
    return StepResult(
        loss=stats.get("loss/total", float("nan")),
        grad_norm=grad_norm,
        update_successful=bool(ok),
        tokens=int(tokens.item()),
        seconds=time.perf_counter() - started,
        stats=stats,
    )


def _reduce_stats(outputs: list[dict], device: torch.device) -> dict[str, float]:
    """Statistics of the whole minibatch, on every rank (the last pipeline stage computes them)."""
    from megatron.core import parallel_state as ps

    summary: dict[str, float] | None = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        stats = StepStats()
        for out in outputs:
            stats = stats.merge(out["stats"])
        group = ps.get_data_parallel_group(with_context_parallel=True)
        summary = stats.all_reduce(group=group, device=device).summary()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [summary]
        last = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
        summary = box[0]
    return summary or {}
