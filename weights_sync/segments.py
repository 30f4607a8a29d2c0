"""Which tensors of a bucket go out on broadcasts of their own (tidal's ``bucket_segments`` extension).

To engines that declare it, a bucket may be several broadcasts: the small tensors packed into the staging
buffer first, then contiguous runs of at least ``own_broadcast_bytes`` sent straight from the trainer's
memory (received in place by a paused engine), and q/k/v of one fused QKV as a packed segment of its own.
The announcement lists the tensors in the broadcasts' order (:func:`spec`).
"""

from __future__ import annotations

import torch

from tidal.weights_sync import bucket, receiver


def nbytes(t: bucket.Packable) -> int:
    return t.nbytes


def spec(items: list[tuple[str, bucket.Packable]]) -> bucket.BucketSpec:
    return bucket.BucketSpec(
        names=[n for n, _ in items],
        dtypes=[bucket.dtype_name(t.dtype) for _, t in items],
        shapes=[list(t.shape) for _, t in items],
    )


def plan(
    items: list[tuple[str, bucket.Packable]], own_bytes: int | None
) -> list[tuple[torch.Tensor | None, list[tuple[str, bucket.Packable]]]]:
    """The bucket's broadcasts, in order: (None, run) for the small tensors, packed into the staging
    buffer, first; then (bytes, run) for contiguous tensors lying back to back in one storage (gate and
    up from megatron's fused fc1) of at least ``own_bytes`` together, sent from their own memory, and
    (None, run) for q/k/v of one fused QKV, packed. The announcement lists the tensors in this order."""
    if own_bytes is None:
        return [(None, items)]
    # in memory order: megatron's DDP keeps a model's parameters in one buffer, last layer first, so the
    # tensors that lie back to back come in the reverse order of the source's
    items = sorted(items, key=_address)
    adjacent: list[list[tuple[str, bucket.Packable]]] = []  # runs of back-to-back tensors, or one packable
    end = None  # (storage address, byte address) where the last contiguous tensor ends
    for name, t in items:
        contiguous = isinstance(t, torch.Tensor) and t.is_contiguous()
        # address arithmetic, not byte_span: this runs per tensor, and a span tensor costs ~10 us
        start = (t.untyped_storage().data_ptr(), t.data_ptr()) if contiguous else None
        if adjacent and ((start is not None and start == end) or same_grouped(adjacent[-1][-1][1], t)):
            adjacent[-1].append((name, t))
        else:
            adjacent.append([(name, t)])
        end = (start[0], start[1] + t.nbytes) if start is not None else None
    loose: list[tuple[str, bucket.Packable]] = []  # small tensors: one packed broadcast, first
    runs: list[tuple[torch.Tensor | None, list[tuple[str, bucket.Packable]]]] = []
    for run in adjacent:
        if sum(nbytes(t) for _, t in run) < own_bytes:
            loose.extend(run)
        elif isinstance(run[0][1], bucket.GroupedRows):
            # q/k/v of one fused QKV: packed (their rows interleave), but a segment of their own, which the
            # engine can receive straight into its own fused matrix
            runs.append((None, run))
        elif (
            all(isinstance(t, torch.Tensor) and t.is_contiguous() for _, t in run)
            and (span := receiver.byte_span([t for _, t in run])) is not None
        ):
            runs.append((span, run))
        else:
            loose.extend(run)
    # the bucket's order is free: gathering the small tensors saves broadcasts (each costs thread hand-offs)
    return ([(None, loose)] if loose else []) + runs


def _address(item: tuple[str, bucket.Packable]) -> tuple[int, int]:
    t = item[1]
    t = t.grouped if isinstance(t, bucket.GroupedRows) else t
    return t.untyped_storage().data_ptr(), t.data_ptr()


def same_grouped(a: bucket.Packable, b: bucket.Packable) -> bool:
    """Rows of one fused tensor (q, k and v of megatron's QKV)."""
    return (
        isinstance(a, bucket.GroupedRows)
        and isinstance(b, bucket.GroupedRows)
        and a.grouped.untyped_storage().data_ptr() == b.grouped.untyped_storage().data_ptr()
    )
