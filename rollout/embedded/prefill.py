"""A lean prefill for Qwen3 and Qwen3-MoE: the prompts of newly admitted requests through the lean decoder's
weights, without transformers' modules.

A prefill through transformers' modules costs a fixed ~1 ms of Python per call on the default job's tiny
model (module calls, keyword plumbing, mask and rotary builders), more than its arithmetic. This runs the
same dozen tensor ops per layer as :class:`~tidal.rollout.embedded.lean.LeanDecoder`, over tokens instead of
rows, reading the same tensors (weight loads are seen without a copy).

Contract with the scheduler: every row starts at position 0 (a prefill recomputes a request's whole prefix,
also after a retraction), rows are padded to the longest one, and each row's keys and values go to its KV
slot's positions ``0..width-1``. Padding positions come after a row's real tokens, so causal attention keeps
them out of the real tokens' outputs; the keys they leave in the cache are overwritten by decode before any
query can reach them (decode attends keys ``0..position`` and writes ``position`` first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.rollout.embedded.lean import LeanDecoder


def lean_prefill_reason(decoder: LeanDecoder) -> str | None:
    """Why the lean prefill should not run for ``decoder`` (None when it should).

    Its MoE runs the decoder's expert path; without the grouped matmul (CUDA graphs turn it off for static
    shapes) that path runs every expert on every token, which on a long prompt costs more than transformers'.
    """
    moe = any(layer.router is not None for layer in decoder.layers)
    if moe and not decoder.grouped_mm:
        return "MoE experts without the grouped matmul (CUDA): transformers' prefill routes tokens sparsely"
    return None


class LeanPrefill:
    """``logits = prefill(ids, lengths, slots)``: rows of prompt tokens from position 0 -> each row's logits
    at its last token (``[rows, vocab]``, model dtype)."""

    def __init__(self, decoder: LeanDecoder):
        self.d = decoder

    def __call__(self, ids: torch.Tensor, lengths: list[int], slots: list[int]) -> torch.Tensor:
        d = self.d
        rows, width = ids.shape
        if width > d.cos.shape[0]:
            raise ValueError(f"a prefill of {width} tokens exceeds the KV pool's {d.cos.shape[0]} positions")
        if d.native_step is not None:
            return self._native(ids, lengths, slots)
        heads, kv_heads, dim = d.heads, d.kv_heads, d.head_dim
        qk_width = d.qk_heads * dim
        cos = d.cos[:width][None, :, None, :]  # [1, width, 1, dim]: broadcasts over rows and heads
        sin = d.sin_signed[:width][None, :, None, :]
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + rows))
        slot_index = None if contiguous else torch.tensor(slots, device=d.device)
        h = F.embedding(ids.reshape(-1), d.embed)  # [tokens, hidden]
        for index, layer in enumerate(d.layers):
            qkv = F.linear(d._norm(h, layer.input_norm), layer.qkv).index_select(-1, layer.qkv_order)
            qkv = qkv.view(rows, width, -1)
            qk = d._rotated_qk(qkv, layer, cos, sin)  # [rows, width, heads + kv_heads, dim]
            q = qk[:, :, :heads].transpose(1, 2)  # [rows, heads, width, dim]
            k = qk[:, :, heads:].transpose(1, 2)  # [rows, kv_heads, width, dim]
            v = qkv[..., qk_width:].view(rows, width, kv_heads, dim).transpose(1, 2)
            k_buf, v_buf = d.pool.keys[index], d.pool.values[index]
            if contiguous:
                k_buf[lo : lo + rows, :, :width] = k
                v_buf[lo : lo + rows, :, :width] = v
            else:
                k_buf[slot_index, :, :width] = k
                v_buf[slot_index, :, :width] = v
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=d.scaling, enable_gqa=kv_heads != heads
            )
            attn = attn.transpose(1, 2).reshape(rows * width, heads * dim)
            h = torch.addmm(h, attn, layer.o_proj.t())  # h + attn @ o_proj^T: the residual in the matmul
            x = d._norm(h, layer.post_norm)
            h = h + (d._mlp(x, layer) if layer.router is None else d._moe(x, layer))
        last = torch.tensor(lengths, device=d.device) - 1 + torch.arange(rows, device=d.device) * width
        return F.linear(d._norm(h[last], d.final_norm), d.lm_head)

    def _native(self, ids: torch.Tensor, lengths: list[int], slots: list[int]) -> torch.Tensor:
        """The native step over the rows' real tokens only (no padding): token ``t`` of a row is a step row
        at position ``t`` of the row's slot, and the logits are those of each row's last token."""
        rows, width = ids.shape
        lengths_t = torch.tensor(lengths)
        real = torch.arange(width)[None, :] < lengths_t[:, None]
        positions = torch.arange(width).expand(rows, width)[real]
        token_slots = torch.tensor(slots)[:, None].expand(rows, width)[real]
        last = torch.cumsum(lengths_t, 0) - 1
        return self.d.native_step(ids.cpu()[real], positions, token_slots, last)
