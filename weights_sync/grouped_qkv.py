"""Megatron's fused QKV sent as it lies in the trainer's memory (tidal's ``grouped_qkv`` extension).

Hugging Face's q, k and v are interleaved in megatron's fused matrix: per query group, that group's query
rows, then its key rows, then its value rows. SGLang takes q/k/v by their HF names, so the sender copies
them apart (``bucket.GroupedRows``). An engine that declares ``grouped_qkv`` instead takes the fused matrix
whole, under ``<prefix>.qkv_proj.weight`` with the 4-D shape ``[groups, q_heads_per_group + 2, head_dim,
hidden]`` (what the shape says is all it needs to take it apart), and copies the rows into its own q/k/v
itself. The sender then copies nothing, and the fused matrix is a contiguous view of the trainer's
parameter, so it joins its neighbours in one broadcast from the trainer's memory (``segments.plan``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator

import torch

from tidal.weights_sync.bucket import GroupedRows, Packable

_FUSED = re.compile(r"^(?P<prefix>.*)\.qkv_proj\.weight$")
_Q = re.compile(r"^(?P<prefix>.*)\.q_proj\.weight$")


@functools.cache  # asked per tensor per sync on the engine (checks, targets, loads): a dict lookup, not a regex
def parts(name: str) -> tuple[str, str, str] | None:
    """The q, k and v names that fused ``name`` holds, or None when ``name`` is not a fused QKV name."""
    m = _FUSED.match(name)
    if m is None:
        return None
    p = m["prefix"]
    return f"{p}.q_proj.weight", f"{p}.k_proj.weight", f"{p}.v_proj.weight"


def split(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``[groups, q_heads, head_dim, hidden]``, ``[groups, head_dim, hidden]`` (k, v) of a fused 4-D
    tensor: q/k/v's rows are these views' rows in order (HF's head order)."""
    if fused.dim() != 4 or fused.shape[1] < 3:
        raise ValueError(f"a fused QKV is [groups, q_heads + 2, head_dim, hidden]; got {list(fused.shape)}")
    heads = fused.shape[1] - 2
    return fused[:, :heads], fused[:, heads], fused[:, heads + 1]


def part_shapes(shape: list[int] | torch.Size) -> tuple[list[int], list[int], list[int]]:
    """The HF shapes of q, k and v held by a fused tensor of ``shape``."""
    groups, rows, head_dim, hidden = shape
    return [groups * (rows - 2) * head_dim, hidden], [groups * head_dim, hidden], [groups * head_dim, hidden]


def fuse(items: Iterable[tuple[str, Packable]]) -> Iterator[tuple[str, Packable]]:
    """The sender's stream with each q, k, v triple of one megatron fused QKV (``GroupedRows`` views, in
    that order) replaced by the fused 4-D view of the trainer's tensor; anything else passes as it is."""
    held: list[tuple[str, Packable]] = []
    for item in items:
        held.append(item)
        if len(held) == 3:
            fused = _fused(held)
            if fused is not None:
                yield fused
                held = []
                continue
            yield held.pop(0)
    yield from held


def _fused(triple: list[tuple[str, Packable]]) -> tuple[str, torch.Tensor] | None:
    (qn, q), (kn, k), (vn, v) = triple
    m = _Q.match(qn)
    if m is None or not all(isinstance(t, GroupedRows) for t in (q, k, v)):
        return None
    if (kn, vn) != (f"{m['prefix']}.k_proj.weight", f"{m['prefix']}.v_proj.weight"):
        return None
    qg, kg, vg = q.grouped, k.grouped, v.grouped
    if qg.dim() != 3 or kg.shape != vg.shape or qg.shape[1] % kg.shape[1] or qg.shape[0] != kg.shape[0]:
        return None
    groups, q_rows, hidden = qg.shape
    head_dim = kg.shape[1]
    rows = q_rows + 2 * head_dim
    # the three must be one contiguous fused matrix: q's rows, then k's, then v's, per group
    item = qg.element_size()
    if (
        qg.stride() != (rows * hidden, hidden, 1)
        or qg.untyped_storage().data_ptr() != vg.untyped_storage().data_ptr()
        or kg.data_ptr() != qg.data_ptr() + q_rows * hidden * item
        or vg.data_ptr() != kg.data_ptr() + head_dim * hidden * item
        or kg.stride() != qg.stride()
        or vg.stride() != qg.stride()
    ):
        return None
    shape = (groups, q_rows // head_dim + 2, head_dim, hidden)
    fused = torch.empty(0, dtype=qg.dtype, device=qg.device).set_(
        qg.untyped_storage(), qg.storage_offset(), shape
    )
    return f"{m['prefix']}.qkv_proj.weight", fused
