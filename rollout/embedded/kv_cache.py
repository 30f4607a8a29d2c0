"""The embedded engine's KV cache: one preallocated slot per running request, written in place.

transformers' attention modules call ``cache.update(key, value, layer_idx)`` with the new tokens' keys and
values and attend over what it returns. :class:`StepCache` is that cache for one forward step of a batch
of slots: it writes each row's new keys at the row's own offset into the :class:`KVPool` and returns the
rows' keys and values up to the longest row. Rows of different lengths are masked by
:func:`paged_attention`, which reads the step's mask from the forward's keyword arguments. The pool is
shape-agnostic per layer, so DeepSeek-V3's compressed MLA latents are cached like ordinary heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_NAME = "tidal_paged"


class KVPool:
    """Per-layer key and value buffers of shape ``[slots, heads, max_seq_len, dim]``, allocated on first use."""

    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, device: torch.device | str):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                "KV pool has no free slot (the scheduler must not admit more than max_batch_size)"
            )
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def _buffers(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer], self.values[layer]
        if k is None or k.shape[1] != key.shape[1] or k.shape[3] != key.shape[3] or k.dtype != key.dtype:
            shape = (self.num_slots, key.shape[1], self.max_seq_len)
            k = torch.zeros(*shape, key.shape[3], dtype=key.dtype, device=self.device)
            v = torch.zeros(*shape, value.shape[3], dtype=value.dtype, device=self.device)
            self.keys[layer], self.values[layer] = k, v
        return k, v


@dataclass
class StepBatch:
    """Where each row of one forward step lives: its slot, its cached length, its number of new tokens."""

    slots: list[int]
    starts: list[int]
    new_lens: list[int]
    device: torch.device

    def __post_init__(self) -> None:
        self.rows = len(self.slots)
        self.q_len = max(self.new_lens)
        self.kv_len = max(s + self.q_len for s in self.starts)
        self._contiguous = self.slots == list(range(self.slots[0], self.slots[0] + self.rows))
        self._uniform_start = len(set(self.starts)) == 1
        self.slot_index = torch.tensor(self.slots, device=self.device)
        starts = torch.tensor(self.starts, device=self.device)
        self.position_ids = starts[:, None] + torch.arange(self.q_len, device=self.device)[None, :]
        # query i of a row sees keys 0..start+i; padded queries past new_len see garbage but are discarded
        key_pos = torch.arange(self.kv_len, device=self.device)
        self.mask = (key_pos[None, None, :] <= self.position_ids[:, :, None])[:, None, :, :]
        self.last_index = torch.tensor([n - 1 for n in self.new_lens], device=self.device)


class StepCache:
    """A transformers-compatible cache for one step; see the module docstring."""

    is_compileable = False

    def __init__(self, pool: KVPool, batch: StepBatch):
        self.pool = pool
        self.batch = batch

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        b = self.batch
        k_buf, v_buf = self.pool._buffers(layer_idx, key_states, value_states)
        q = key_states.shape[2]
        if b._contiguous and b._uniform_start:
            lo, start = b.slots[0], b.starts[0]
            k_buf[lo : lo + b.rows, :, start : start + q] = key_states
            v_buf[lo : lo + b.rows, :, start : start + q] = value_states
        else:
            for row, (slot, start) in enumerate(zip(b.slots, b.starts, strict=True)):
                k_buf[slot, :, start : start + q] = key_states[row]
                v_buf[slot, :, start : start + q] = value_states[row]
        if b._contiguous:
            lo = b.slots[0]
            return k_buf[lo : lo + b.rows, :, : b.kv_len], v_buf[lo : lo + b.rows, :, : b.kv_len]
        return (
            k_buf.index_select(0, b.slot_index)[:, :, : b.kv_len],
            v_buf.index_select(0, b.slot_index)[:, :, : b.kv_len],
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batch.kv_len


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a :class:`StepCache`'s output; the mask comes from the ``tidal_step`` keyword."""
    gqa = key.shape[1] != query.shape[1]
    step: StepBatch | None = kwargs.get("tidal_step")
    if step is None:
        # a plain forward outside the engine (no cache, unpadded): ordinary causal attention
        causal = attention_mask is None and query.shape[2] == key.shape[2]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    mask = step.mask
    if step.q_len == 1 and step._uniform_start:
        mask = None  # every row sees exactly its whole cache: no mask needed
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
