"""The ``flattened_bucket`` layout shared by sender and receiver (SGLang's FlattenedTensorBucket).

A bucket is one uint8 buffer holding its tensors' bytes back to back, in announcement order. It is
announced as parallel lists ``names``, ``dtypes`` (torch dtype names, e.g. "float32") and ``shapes``;
each tensor's byte offset must be a multiple of its dtype's item size, which dtype-homogeneous
buckets satisfy by construction.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class BucketSpec:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) * _dtype(d).itemsize for d, s in zip(self.dtypes, self.shapes, strict=True))


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in bucket announcement")
    return dtype


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"negative dimension in shape {list(shape)}")
        n *= d
    return n


class GroupedRows:
    """A tensor of ``shape`` [groups * rows, ...] whose rows are ``grouped`` ([groups, rows, ...], a strided
    view) concatenated: what reshaping the view would copy. Packing writes it into the bucket directly,
    so the live sync copies such a tensor once (megatron's fused QKV rows split into HF's q, k and v)."""

    def __init__(self, grouped: torch.Tensor):
        self.grouped = grouped
        self.shape = torch.Size((grouped.shape[0] * grouped.shape[1], *grouped.shape[2:]))
        self.dtype = grouped.dtype
        self.device = grouped.device

    def numel(self) -> int:
        return self.grouped.numel()

    @property
    def nbytes(self) -> int:
        return self.grouped.nbytes

    def element_size(self) -> int:
        return self.grouped.element_size()

    def to(self, dtype: torch.dtype) -> GroupedRows:
        return GroupedRows(self.grouped.to(dtype))

    def materialize(self) -> torch.Tensor:
        return self.grouped.reshape(self.shape)


Packable = torch.Tensor | GroupedRows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(
    named_tensors: list[tuple[str, Packable]], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, BucketSpec]:
    """Copy tensors into one uint8 buffer (``out`` if given, e.g. a reused staging buffer)."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    spec = BucketSpec(
        names=[n for n, _ in named_tensors],
        dtypes=[dtype_name(t.dtype) for _, t in named_tensors],
        shapes=[list(t.shape) for _, t in named_tensors],
    )
    total = spec.nbytes
    device = named_tensors[0][1].device
    buf = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    dsts, srcs = [], []
    for _, t in named_tensors:
        n = t.nbytes
        if offset % t.dtype.itemsize:
            raise ValueError(
                f"unaligned tensor at byte {offset} for dtype {t.dtype}: keep buckets dtype-homogeneous"
            )
        # copy straight from (possibly strided) views into the bucket: no intermediate contiguous copy
        dst = buf[offset : offset + n].view(t.dtype)
        src = t.grouped if isinstance(t, GroupedRows) else t
        dsts.append(dst.view(src.shape))
        srcs.append(src)
        offset += n
    with torch.no_grad():  # copies from parameters: no autograd record (and no per-tensor detach)
        # one call for the bucket: on CUDA a few multi-tensor kernels instead of a launch per tensor
        torch._foreach_copy_(dsts, srcs)
    return buf, spec


def empty(spec: BucketSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(spec.nbytes, dtype=torch.uint8, device=device)


def unpack(buf: torch.Tensor, spec: BucketSpec) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buf`` (no copies), one per announced tensor."""
    out = []
    offset = 0
    for name, d, shape in zip(spec.names, spec.dtypes, spec.shapes, strict=True):
        dtype = _dtype(d)
        n = _numel(shape) * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"unaligned tensor {name} at byte {offset} for dtype {d}")
        if offset + n > buf.numel():
            raise ValueError(f"bucket of {buf.numel()} bytes is too small for {name} at byte {offset}")
        out.append((name, buf[offset : offset + n].view(dtype).view(shape)))
        offset += n
    return out


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors into dtype-homogeneous buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    open_buckets: dict[torch.dtype, tuple[list[tuple[str, torch.Tensor]], int]] = {}
    done: list[list[tuple[str, torch.Tensor]]] = []
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        items, size = open_buckets.get(t.dtype, ([], 0))
        if items and size + n > bucket_bytes:
            done.append(items)
            items, size = [], 0
        items.append((name, t))
        open_buckets[t.dtype] = (items, size + n)
    done.extend(items for items, _ in open_buckets.values() if items)
    return done


def checksum(buf: torch.Tensor | list[torch.Tensor]) -> int:
    """CRC32 of a bucket's bytes, or of its broadcasts' bytes one after the other (optional verification:
    the sender announces it, the receiver compares with its buffer)."""
    crc = 0
    for part in [buf] if isinstance(buf, torch.Tensor) else buf:
        crc = zlib.crc32(part.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def stream_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    first_bytes: int | None = None,
    *,
    packed: Callable[[Packable], bool] | None = None,
    max_bytes: int | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``plan_buckets`` as a stream: each dtype's bucket leaves as soon as the next tensor would overflow it,
    so packing and sending start before the last tensor is gathered.

    ``first_bytes``: the first bucket's limit, doubling with each bucket up to ``bucket_bytes``, so the
    first broadcast starts after a small pack instead of a full bucket's (the pipeline's fill time).
    ``packed(t)``: whether ``t`` is copied into the bucket's buffer; those that are not (sent from their
    own memory) count only against ``max_bytes``, the bucket's size in all (default: ``bucket_bytes``),
    which ramps up from ``first_bytes`` likewise.
    """
    limit = min(first_bytes or bucket_bytes, bucket_bytes)
    most = max(max_bytes or bucket_bytes, bucket_bytes)
    total_limit = min(first_bytes or most, most)
    # per dtype: (items, packed bytes, all bytes)
    open_buckets: dict[torch.dtype, tuple[list[tuple[str, torch.Tensor]], int, int]] = {}
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        copied = n if packed is None or packed(t) else 0
        items, size, total = open_buckets.get(t.dtype, ([], 0, 0))
        if items and (size + copied > limit or total + n > total_limit):
            yield items
            items, size, total = [], 0, 0
            limit = min(2 * limit, bucket_bytes)
            total_limit = min(2 * total_limit, most)
        items.append((name, t))
        open_buckets[t.dtype] = (items, size + copied, total + n)
    for items, _, _ in open_buckets.values():
        if items:
            yield items
