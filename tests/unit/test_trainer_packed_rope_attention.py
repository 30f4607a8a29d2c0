"""The vectorised THD rotary embedding and the length-bucketed packed attention against references."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from tidal.trainer.attention import PackedCoreAttention
from tidal.trainer.rope import make_apply_rotary_pos_emb, thd_positions


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)


def test_thd_positions_restart_per_sequence_and_follow_the_cp_chunk_layout():
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    assert thd_positions(cu, 9, 1, 0).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # cp=2: chunks of 2 and 1 tokens
    assert thd_positions(cu, 6, 2, 0).tolist() == [0, 1, 6, 7, 0, 3]
    assert thd_positions(cu, 6, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]


@pytest.mark.parametrize("cp_size", [1, 2])
def test_vectorised_thd_rope_equals_megatrons_per_sequence_loop(cp_size):
    torch.manual_seed(0)
    config = _config()
    freqs = torch.randn(64, 1, 1, 8)
    cu = torch.tensor([0, 4, 12, 16, 36], dtype=torch.int32)
    apply = make_apply_rotary_pos_emb(original=None)
    for rank in range(cp_size):
        group = _Group(cp_size, rank)
        t = torch.randn(int(cu[-1]) // cp_size, 3, 8)
        expected = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group)
        got = apply(t, freqs, config, cu_seqlens=cu, cp_group=group)
        assert torch.equal(got, expected)


def test_length_bucketed_packed_attention_equals_one_sdpa_call_per_sequence():
    torch.manual_seed(0)
    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self").eval()  # no dropout
    lengths = [3, 5, 3, 1, 5, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(sum(lengths), 4, 8, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 8, requires_grad=True)
    v = torch.randn(sum(lengths), 2, 8, requires_grad=True)
    got = attn._per_sequence(q, k, v, cu)
    expected = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        ks, vs = ks.repeat_interleave(2, dim=1), vs.repeat_interleave(2, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
        )
        expected.append(out.transpose(0, 1).reshape(qs.shape[0], -1))
    expected = torch.cat(expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rot_dim", [8, 4])  # whole head, and a partial rotary with a pass-through part
def test_cached_cos_sin_follow_the_batch_and_equal_megatrons_rotation(rot_dim):
    torch.manual_seed(1)
    config = _config()
    apply = make_apply_rotary_pos_emb(original=None)
    freqs = torch.randn(64, 1, 1, rot_dim)
    group = _Group(1, 0)
    first = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    second = torch.tensor([0, 10, 16], dtype=torch.int32)  # another batch: other positions, same table
    for cu in (first, first, second, first.clone()):
        for heads in (3, 1):  # queries and keys of one layer share the cached cos/sin
            t = torch.randn(16, heads, 8)
            expected = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group)
            assert torch.equal(apply(t, freqs, config, cu_seqlens=cu, cp_group=group), expected)


def test_equal_length_packed_attention_equals_one_sdpa_call_per_sequence():
    """Fixed-length batches take the no-gather path (the packed tensors viewed as [n, L, ...])."""
    torch.manual_seed(2)
    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self").eval()
    cu = torch.tensor([0, 6, 12, 18])
    q = torch.randn(18, 4, 8, requires_grad=True)
    k = torch.randn(18, 2, 8, requires_grad=True)
    v = torch.randn(18, 2, 8, requires_grad=True)
    got = attn._per_sequence(q, k, v, cu)
    expected = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1),
                ks.repeat_interleave(2, dim=1).transpose(0, 1),
                vs.repeat_interleave(2, dim=1).transpose(0, 1),
                is_causal=True,
            )
            .transpose(0, 1)
            .reshape(6, -1)
            for qs, ks, vs in zip(q.split(6), k.split(6), v.split(6), strict=True)
        ]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)
