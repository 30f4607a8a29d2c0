"""A core attention in plain PyTorch for packed (THD) sequences and context parallelism.

Used where Transformer Engine is not installed (always on CPU): megatron-core's local
``DotProductAttention`` supports neither packed sequences nor context parallel, and TE's ring attention is
CUDA only. Same constructor and forward signature as megatron's core attentions.

Context parallel follows TE's load-balanced THD layout, which megatron's rotary embedding also assumes:
every packed sequence is padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` chunks; CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` of every sequence. K and V are all-gathered over the CP group
(the backward all-reduces their gradient and keeps the local part), then each local query attends
causally to its own sequence's keys at positions up to its own.

Two kernels run the packed case (``trainer.kernels.attention``):

- ``flash_varlen`` (CUDA, bf16/fp16): torch's variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``) over ``cu_seqlens``, with grouped-query attention native
  (no K/V repeat) and no mask tensor. Under context parallelism every local query chunk becomes its own
  "sequence" whose keys are its sequence's prefix up to the chunk's end; flash aligns the causal diagonal
  to the bottom right when a sequence has more keys than queries, which is exactly that prefix rule.
- ``sdpa`` (any device, the reference): SDPA per group of equal-length sequences (no CP), or one masked
  SDPA over the gathered keys (CP).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward sums gradients and returns this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size = dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank].contiguous(), None


def cp_token_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices (into the packed full batch) held by ``cp_rank``, in local order."""
    pieces = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"context parallel: packed sequence length {length} is not a multiple of 2*cp={2 * cp_size}; "
                "pad every sequence to a multiple of 2*cp (cu_seqlens_q_padded)"
            )
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


ATTENTION_KERNELS = ("auto", "flash_varlen", "sdpa")


def flash_varlen_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why torch's varlen flash kernel cannot run on these tensors, or None when it can."""
    if not query.is_cuda:
        return f"tensors are on {query.device.type}, the flash kernel needs CUDA"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {query.dtype}; the flash kernel takes bfloat16 or float16"
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return "the flash kernel needs compute capability 8.0 or newer"
    head_dim = max(query.shape[-1], value.shape[-1])
    if key.shape[-1] != query.shape[-1] or head_dim > 256 or head_dim % 8:
        return f"head sizes q={query.shape[-1]} k={key.shape[-1]} v={value.shape[-1]} (flash: equal q/k, <= 256, x8)"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key heads"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal (bottom-right aligned) attention of packed sequences with torch's varlen flash kernel."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))


def varlen_reference(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """What :func:`flash_varlen` computes, with SDPA one sequence at a time (any device, any dtype).

    Query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``.
    """
    outs = []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        ki, vi = PackedCoreAttention._expand_groups(qi, ki, vi, head_dim=0)
        lq, lk = qe - qs, ke - ks
        keep = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (
            lk - lq
        )
        out = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


def cp_varlen_layout(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int):
    """The varlen problem of one context-parallel rank: each local query chunk against its keys.

    Returns ``(cu_q, key_positions, cu_k, max_q, max_k)``: the local queries (in :func:`cp_token_positions`
    order) cut into one sequence per chunk; the global packed positions of the keys of each chunk (its
    sequence's tokens from the start up to the chunk's end), concatenated; their boundaries; the longest
    query and key runs.
    """
    q_lengths, k_lengths, key_pieces = [], [], []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"context parallel: packed sequence length {length} is not a multiple of 2*cp={2 * cp_size}; "
                "pad every sequence to a multiple of 2*cp (cu_seqlens_q_padded)"
            )
        chunk = length // (2 * cp_size)
        if chunk == 0:
            continue
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            q_lengths.append(chunk)
            k_lengths.append((c + 1) * chunk)
            key_pieces.append(torch.arange(start, start + (c + 1) * chunk))
    zero = torch.zeros(1, dtype=torch.int32)
    cu_q = torch.cat([zero, torch.tensor(q_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, torch.tensor(k_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    keys = torch.cat(key_pieces) if key_pieces else torch.zeros(0, dtype=torch.long)
    return cu_q, keys, cu_k, max(q_lengths, default=0), max(k_lengths, default=0)


class PackedCoreAttention(MegatronModule):
    default_kernel = "auto"  # see :func:`core_attention_with_kernel`

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        kernel: str | None = None,
        **unused,
    ):
        super().__init__(config=config)
        kernel = kernel or self.default_kernel
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"trainer.kernels.attention={kernel!r}; choose one of {', '.join(ATTENTION_KERNELS)}"
            )
        self.kernel = kernel
        # the varlen problem (kernel callable) is an attribute so CPU tests can run the flash path's
        # bookkeeping with varlen_reference standing in for the CUDA kernel
        self.varlen_kernel = flash_varlen
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCoreAttention supports causal attention only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def _scale(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not support attention_bias")
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            # [s, b, h, d]: ordinary causal attention per batch row (no context parallel here)
            if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
                raise ValueError("context parallel needs packed sequences (THD with packed_seq_params)")
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
            out = self._sdpa(
                1,
                q,
                k,
                v,
                is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
                scale=self._scale(query.shape[-1]),
            )
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        equal = self._equal_length_count(query, packed_seq_params)
        if self.kernel == "auto" and equal is not None and query.is_cuda:
            # fixed-length batches: one batched SDPA call (torch picks cuDNN or flash; cuDNN's backward
            # measured ~1.5x flash's on the H200), found without a host sync
            return self._batched_sdpa(query, key, value, equal)
        if self._use_flash(query, key, value):
            return self._forward_flash_thd(query, key, value, packed_seq_params)
        return self._forward_thd(query, key, value, packed_seq_params)

    def _equal_length_count(self, query, params: PackedSeqParams) -> int | None:
        """The number of packed sequences when all have the same length (no context parallel), else None.

        Decided from shapes and ``max_seqlen`` alone: n sequences of at most L tokens fill n * L rows only
        when every one has L."""
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            return None
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        longest, count = params.max_seqlen_q, cu.numel() - 1
        if not longest or count < 1 or count * int(longest) != query.shape[0]:
            return None
        return count

    def _batched_sdpa(self, query, key, value, count: int) -> torch.Tensor:
        """Causal SDPA of ``count`` equal-length packed sequences, viewed as ``[count, L, ...]`` (no gathers)."""
        length = query.shape[0] // count
        q, k, v = (x.unflatten(0, (count, length)).transpose(1, 2) for x in (query, key, value))
        out = self._sdpa(
            1,
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self._scale(query.shape[-1]),
        )
        return out.transpose(1, 2).reshape(query.shape[0], -1)

    def _use_flash(self, query, key, value) -> bool:
        if self.kernel == "sdpa":
            return False
        reason = flash_varlen_unsupported(query, key, value)
        if reason is None and self.training and self.dropout > 0:
            reason = f"attention dropout {self.dropout} (the varlen kernel runs without dropout)"
        if reason is None:
            return True
        if self.kernel == "flash_varlen":
            raise ValueError(
                f"trainer.kernels.attention=flash_varlen cannot run here: {reason}; use auto or sdpa"
            )
        return False

    def _forward_flash_thd(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        # query [t, np, hn], key [t, ng, hn], value [t, ng, hv]
        tokens, head_v = query.shape[0], value.shape[-1]
        scale = self._scale(query.shape[-1])
        if head_v != query.shape[-1]:  # MLA: values are narrower than queries; flash wants one head size
            value = torch.nn.functional.pad(value, (0, query.shape[-1] - head_v))
        # the kernel takes any token/head strides but a contiguous head dimension
        query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp_size == 1:
            cu_dev = cu.to(query.device, torch.int32)
            longest = params.max_seqlen_q
            if longest is None:
                longest = int((cu[1:] - cu[:-1]).max())
            out = self.varlen_kernel(query, key, value, cu_dev, cu_dev, int(longest), int(longest), scale)
        else:
            cu = cu.to("cpu", torch.long)
            cp_rank = dist.get_rank(self.cp_group)
            full_k = _GatherSeq.apply(key, self.cp_group)
            full_v = _GatherSeq.apply(value, self.cp_group)
            # gathered rows are in rank order; row order[p] holds global packed position p
            gathered_pos = torch.cat([cp_token_positions(cu, cp_size, r) for r in range(cp_size)])
            order = torch.argsort(gathered_pos)
            cu_q, key_pos, cu_k, max_q, max_k = cp_varlen_layout(cu, cp_size, cp_rank)
            rows = order[key_pos].to(query.device)
            out = self.varlen_kernel(
                query,
                full_k.index_select(0, rows),
                full_v.index_select(0, rows),
                cu_q.to(query.device),
                cu_k.to(query.device),
                max_q,
                max_k,
                scale,
            )
        return out[..., :head_v].reshape(tokens, -1)

    def _per_sequence(self, query, key, value, cu: torch.Tensor) -> torch.Tensor:
        """Causal attention within each packed sequence: sum of L_i^2 work, not (sum L_i)^2.

        Sequences of equal length go through one batched SDPA call, so a batch of many short answers
        (few distinct lengths) costs a few kernel calls instead of one per sequence.
        """
        lengths = (cu[1:] - cu[:-1]).tolist()
        if sum(lengths) != query.shape[0]:
            raise ValueError(
                f"cu_seqlens cover {sum(lengths)} tokens but the packed batch has {query.shape[0]}"
            )
        if lengths and lengths[0] > 0 and lengths.count(lengths[0]) == len(lengths):
            return self._batched_sdpa(query, key, value, len(lengths))  # fixed-length batch: no gathers
        scale = self._scale(query.shape[-1])
        dropout = self.dropout if self.training else 0.0
        starts = cu[:-1].to(torch.long)
        by_length: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            if length:
                by_length.setdefault(length, []).append(i)
        token_order, outs = [], []
        for length, seqs in by_length.items():
            first = starts[torch.tensor(seqs)]
            index = (first[:, None] + torch.arange(length)[None, :]).reshape(-1).to(query.device)
            q, k, v = (
                x.index_select(0, index).unflatten(0, (len(seqs), length)).transpose(1, 2)
                for x in (query, key, value)
            )  # [n, heads, L, d]
            out = self._sdpa(1, q, k, v, is_causal=True, dropout_p=dropout, scale=scale)
            outs.append(out.transpose(1, 2).reshape(index.numel(), -1))
            token_order.append(index)
        out = torch.cat(outs)
        if len(outs) == 1 and len(lengths) == 1:
            return out
        order = torch.cat(token_order)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out.index_select(0, inverse)

    @classmethod
    def _sdpa(cls, head_dim: int, q, k, v, **kwargs) -> torch.Tensor:
        """SDPA with fewer key/value heads than query heads (GQA): on CUDA the kernel reads each K/V head
        for its query group (``enable_gqa``; expanding K and V cost a copy forward and a sum backward, ~5 ms
        of a 1.1B model's 200 ms step on the H200); elsewhere K and V are expanded, as before."""
        if q.is_cuda and q.shape[head_dim] != k.shape[head_dim]:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        k, v = cls._expand_groups(q, k, v, head_dim=head_dim)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    @staticmethod
    def _expand_groups(q, k, v, head_dim: int):
        groups = q.shape[head_dim] // k.shape[head_dim]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=head_dim)
            v = v.repeat_interleave(groups, dim=head_dim)
        return k, v

    def _forward_thd(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        # query [t, np, hn], key [t, ng, hn], value [t, ng, hv]
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu = cu.to("cpu", torch.long)
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp_size == 1:
            return self._per_sequence(query, key, value, cu)
        seq_ids = _sequence_ids(cu)
        if cp_size > 1:
            cp_rank = dist.get_rank(self.cp_group)
            full_k = _GatherSeq.apply(key, self.cp_group)
            full_v = _GatherSeq.apply(value, self.cp_group)
            gathered_pos = torch.cat([cp_token_positions(cu, cp_size, r) for r in range(cp_size)])
            order = torch.argsort(gathered_pos)
            key, value = (
                full_k.index_select(0, order.to(key.device)),
                full_v.index_select(0, order.to(key.device)),
            )
            q_pos = cp_token_positions(cu, cp_size, cp_rank)
        else:
            q_pos = torch.arange(query.shape[0])
        k_pos = torch.arange(key.shape[0])
        mask = (seq_ids[q_pos][:, None] == seq_ids[k_pos][None, :]) & (k_pos[None, :] <= q_pos[:, None])
        q = query.transpose(0, 1)  # [np, t, hn]
        k, v = key.transpose(0, 1), value.transpose(0, 1)
        out = self._sdpa(
            0,
            q,
            k,
            v,
            attn_mask=mask.to(q.device),
            dropout_p=self.dropout if self.training else 0.0,
            scale=self._scale(query.shape[-1]),
        )
        return out.transpose(0, 1).reshape(query.shape[0], -1)


_WITH_KERNEL: dict[str, type] = {}


def core_attention_with_kernel(kernel: str) -> type:
    """:class:`PackedCoreAttention` whose kernel defaults to ``kernel`` (a class, as layer specs need: MLA
    builds its core attention through megatron's ``build_module``, which takes classes and ModuleSpecs)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(
            f"trainer.kernels.attention={kernel!r}; choose one of {', '.join(ATTENTION_KERNELS)}"
        )
    if kernel == PackedCoreAttention.default_kernel:
        return PackedCoreAttention
    if kernel not in _WITH_KERNEL:
        _WITH_KERNEL[kernel] = type(
            f"PackedCoreAttention_{kernel}", (PackedCoreAttention,), {"default_kernel": kernel}
        )
    return _WITH_KERNEL[kernel]
