"""The embedded engine's KV cache: one preallocated slot per running request, written in place.

transformers' attention modules call ``cache.update(key, value, layer_idx)`` with the new tokens' keys and
values and attend over what it returns. :class:`StepCache` is that cache for one forward step of a batch
of slots: it writes each row's new keys at the row's own offset into the :class:`KVPool` and returns the
rows' keys and values up to the longest row. Rows of different lengths are masked by
:func:`paged_attention`, which reads the step's mask from the forward's keyword arguments. The pool is
shape-agnostic per layer, so DeepSeek-V3's compressed MLA latents are cached like ordinary heads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

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
        # lowest free slot first: the running batch stays a contiguous block of the pool as long as it can,
        # so decode attends over a view of the pool instead of gathering the rows' caches every layer
        self._free = list(range(num_slots))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                "KV pool has no free slot (the scheduler must not admit more than max_batch_size)"
            )
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def take(self, slot: int) -> None:
        """Allocate this particular free slot."""
        self._free.remove(slot)
        heapq.heapify(self._free)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into slot ``dst``, every layer."""
        for buffers in (self.keys, self.values):
            for buf in buffers:
                if buf is not None:
                    buf[dst, :, :length] = buf[src, :, :length]

    def preallocate(
        self, layer: int, key_shape: tuple[int, int], value_shape: tuple[int, int], dtype: torch.dtype
    ) -> None:
        """Allocate a layer's buffers now (``(heads, dim)`` per position); a forward never reallocates them."""
        k = self.keys[layer]
        if k is not None and (k.shape[1], k.shape[3]) == key_shape and k.dtype == dtype:
            return
        shape = (self.num_slots, key_shape[0], self.max_seq_len)
        self.keys[layer] = torch.zeros(*shape, key_shape[1], dtype=dtype, device=self.device)
        self.values[layer] = torch.zeros(
            *shape[:1], value_shape[0], shape[2], value_shape[1], dtype=dtype, device=self.device
        )

    def _buffers(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.keys[layer]
        if k is None or k.shape[1] != key.shape[1] or k.shape[3] != key.shape[3] or k.dtype != key.dtype:
            self.preallocate(layer, (key.shape[1], key.shape[3]), (value.shape[1], value.shape[3]), key.dtype)
        return self.keys[layer], self.values[layer]


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
        self.decode = self.q_len == 1
        self.starts_t = torch.tensor(self.starts, device=self.device)
        self.position_ids = self.starts_t[:, None] + torch.arange(self.q_len, device=self.device)[None, :]
        self.last_index = torch.tensor([n - 1 for n in self.new_lens], device=self.device)

    @cached_property
    def slot_index(self) -> torch.Tensor:
        return torch.tensor(self.slots, device=self.device)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """``[rows, 1, q_len, kv_len]`` bool: query i of a row sees keys 0..start+i; None when all see all.

        Padded queries past a row's new_len see garbage, but their outputs are discarded.
        """
        if self.decode and self._uniform_start:
            return None  # every row sees exactly its whole cache
        key_pos = torch.arange(self.kv_len, device=self.device)
        return (key_pos[None, None, :] <= self.position_ids[:, :, None])[:, None, :, :]


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
        elif q == 1:
            # one token per row at the row's own offset: a single scatter, no loop over rows
            k_buf[b.slot_index, :, b.starts_t] = key_states[:, :, 0]
            v_buf[b.slot_index, :, b.starts_t] = value_states[:, :, 0]
        else:
            for row, (slot, start) in enumerate(zip(b.slots, b.starts, strict=True)):
                k_buf[slot, :, start : start + q] = key_states[row]
                v_buf[slot, :, start : start + q] = value_states[row]
        if b._contiguous:
            lo = b.slots[0]
            return k_buf[lo : lo + b.rows, :, : b.kv_len], v_buf[lo : lo + b.rows, :, : b.kv_len]
        return (
            k_buf[:, :, : b.kv_len].index_select(0, b.slot_index),
            v_buf[:, :, : b.kv_len].index_select(0, b.slot_index),
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batch.kv_len


def _decode_attention(query, key, value, mask, scaling):
    """One query per row against its cache, as grouped matmuls over the cache view (CPU decode).

    PyTorch's CPU flash kernel is tiled for long queries; for a single query it spends more on its tiling than
    on the arithmetic. Query heads that share a K/V head (GQA) are stacked as that head's query rows, so the
    cache is read once per K/V head and never repeated.
    """
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value)  # [rows, kv_heads, group, v_dim]
    return out.reshape(rows, 1, heads, value.shape[-1])


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
    if step.decode and query.device.type == "cpu" and query.shape[1] % key.shape[1] == 0:
        return _decode_attention(query, key, value, step.mask, scaling), None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=step.mask, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
