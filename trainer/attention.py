"""A core attention in plain PyTorch for packed (THD) sequences and context parallelism.

Used where Transformer Engine is not installed (always on CPU): megatron-core's local
``DotProductAttention`` supports neither packed sequences nor context parallel, and TE's ring attention is
CUDA only. Same constructor and forward signature as megatron's core attentions.

Context parallel follows TE's load-balanced THD layout, which megatron's rotary embedding also assumes:
every packed sequence is padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` chunks; CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` of every sequence. K and V are all-gathered over the CP group
(the backward all-reduces their gradient and keeps the local part), then each local query attends
causally to its own sequence's keys at positions up to its own.
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


class PackedCoreAttention(MegatronModule):
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
        **unused,
    ):
        super().__init__(config=config)
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
            k, v = self._expand_groups(q, k, v, head_dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
                scale=self._scale(query.shape[-1]),
            )
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self._forward_thd(query, key, value, packed_seq_params)

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
            k, v = self._expand_groups(q, k, v, head_dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=scale
            )
            outs.append(out.transpose(1, 2).reshape(index.numel(), -1))
            token_order.append(index)
        out = torch.cat(outs)
        if len(outs) == 1 and len(lengths) == 1:
            return out
        order = torch.cat(token_order)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out.index_select(0, inverse)

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
        k, v = self._expand_groups(q, k, v, head_dim=0)
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask.to(q.device),
            dropout_p=self.dropout if self.training else 0.0,
            scale=self._scale(query.shape[-1]),
        )
        return out.transpose(0, 1).reshape(query.shape[0], -1)
