"""Rotary embedding of packed (THD) sequences in one vectorised pass.

megatron-core's unfused THD path (``rope_utils._apply_rotary_pos_emb_thd``) applies the rotation one
packed sequence at a time: with many short sequences (the default job packs 256 answers of ~10 tokens
per step) that loop was a quarter of the trainer's step on CPU. Here every token's position inside its
own sequence is computed with a few tensor ops (context-parallel layout included: rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r`` of each sequence), the frequencies are gathered per token, and megatron's own
BSHD rotation is applied once. The result is the same arithmetic on the same values.

:func:`install` swaps this in for the attention modules' ``apply_rotary_pos_emb`` when Transformer Engine's
fused RoPE is not in use; everything else (fused kernels, BSHD, packed-offset frequencies) goes to
megatron's function unchanged. The per-token cos/sin of a packed batch are computed once and reused by every
layer's queries and keys (:class:`_CosSinCache`).
"""

from __future__ import annotations

import weakref

import torch


def thd_positions(cu_seqlens: torch.Tensor, num_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Position inside its own sequence of each of this CP rank's ``num_tokens`` packed tokens."""
    cu = cu_seqlens.to(torch.long)
    full_lengths = cu[1:] - cu[:-1]
    local_lengths = full_lengths // cp_size
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    token_seq = torch.repeat_interleave(
        torch.arange(local_lengths.numel(), device=cu.device), local_lengths, output_size=num_tokens
    )
    offset = torch.arange(num_tokens, device=cu.device) - local_starts[token_seq]
    if cp_size == 1:
        return offset
    chunk = (local_lengths // 2)[token_seq]
    first_half = offset < chunk
    return torch.where(
        first_half, cp_rank * chunk + offset, (2 * cp_size - 1 - cp_rank) * chunk + (offset - chunk)
    )


class _CosSinCache:
    """The last packed batch's per-token cos/sin: every layer (queries and keys) rotates by the same ones.

    Keyed by the identity of the frequency table and the ``cu_seqlens`` tensor (held weakly, so a dead
    tensor's recycled address cannot match) plus everything else the values depend on.
    """

    def __init__(self) -> None:
        self._refs: tuple | None = None
        self._rest: tuple | None = None
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, freqs, cu_seqlens, rest: tuple, compute):
        if self._refs is not None and self._rest == rest:
            f, c = (ref() for ref in self._refs)
            if f is freqs and c is cu_seqlens:
                return self._value
        self._value = compute()
        self._refs = (weakref.ref(freqs), weakref.ref(cu_seqlens))
        self._rest = rest
        return self._value


def rotate(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    """megatron's BSHD rotation with precomputed ``cos_``/``sin_`` (same operations, same values), without
    its trailing copy (``cat`` with an empty pass-through part) when the whole head is rotated."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    from tidal.trainer import pointwise

    rot_dim = cos_.shape[-1]
    if rot_dim == t.shape[-1]:
        return pointwise.rotate(t, cos_, sin_, rotary_interleaved)  # one kernel on CUDA when large
    head, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat(((head * cos_) + (_rotate_half(head, rotary_interleaved) * sin_), t_pass), dim=-1)


def make_apply_rotary_pos_emb(original):
    """``apply_rotary_pos_emb`` with the THD case vectorised; other cases call ``original``."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    cache = _CosSinCache()

    def apply_rotary_pos_emb(
        t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, mla_rotary_interleaved=False
    ):
        packed_offset_freqs = cu_seqlens is not None and freqs.size(0) == t.size(0) * (
            cp_group.size() if cp_group is not None else 1
        )
        if cu_seqlens is None or config.apply_rope_fusion or packed_offset_freqs:
            return original(t, freqs, config, cu_seqlens, mscale, cp_group, mla_rotary_interleaved)
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group()
        if mla_rotary_interleaved is None:
            mla_rotary_interleaved = config.multi_latent_attention
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        if mla_rotary_interleaved:
            positions = thd_positions(cu_seqlens, t.size(0), cp_size, cp_rank)
            return _apply_rotary_pos_emb_bshd(
                t.unsqueeze(1),
                freqs.index_select(0, positions.to(freqs.device)),
                rotary_interleaved=config.rotary_interleaved,
                mla_rotary_interleaved=mla_rotary_interleaved,
                mscale=mscale,
            ).squeeze(1)

        def cos_sin():
            positions = thd_positions(cu_seqlens, t.size(0), cp_size, cp_rank)
            picked = freqs.index_select(0, positions.to(freqs.device))
            return (torch.cos(picked) * mscale).to(t.dtype), (torch.sin(picked) * mscale).to(t.dtype)

        rest = (t.size(0), cp_size, cp_rank, t.dtype, float(mscale))
        cos_, sin_ = cache.get(freqs, cu_seqlens, rest, cos_sin)
        return rotate(t.unsqueeze(1), cos_, sin_, config.rotary_interleaved).squeeze(1)

    apply_rotary_pos_emb.tidal_vectorised = True
    return apply_rotary_pos_emb


def install() -> None:
    """Use the vectorised THD rotation in megatron's attention modules (idempotent)."""
    from megatron.core.transformer import attention, multi_latent_attention

    for module in (attention, multi_latent_attention):
        if not getattr(module.apply_rotary_pos_emb, "tidal_vectorised", False):
            module.apply_rotary_pos_emb = make_apply_rotary_pos_emb(module.apply_rotary_pos_emb)
