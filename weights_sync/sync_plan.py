"""A sync's buckets, planned once and replayed: the sender's per-tensor work after the first sync.

The first sync of a model plans its buckets as the tensors stream in (``bucket.stream_buckets`` cuts them,
``segments.plan`` orders each bucket's broadcasts) and records, per bucket, which source positions it holds,
their order on the wire, which of them are packed into the staging buffer at which offsets, which go out
from their own memory, and the announcement's names, dtypes and shapes. Later syncs replay that record:
per tensor only a name, shape, dtype and type comparison against the record; per bucket one multi-tensor
copy into views of the staging buffer made on the first replay, a span check per broadcast sent from its
own memory, and the announcement's JSON encoded once (``engine_api.Announcement``).

A tensor that differs from the record (another model, another dtype, a tensor no longer lying back to back
with its neighbour) ends the replay: everything from there is planned afresh, and that sync's buckets
become the record. On GPUs, where a GB moves in milliseconds, this per-tensor Python is what bounds a
sync of many small tensors (see docs/weights_sync.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from tidal.weights_sync import bucket, receiver, segments
from tidal.weights_sync.engine_api import Announcement

Item = tuple[str, bucket.Packable]


@dataclass
class _Part:
    """One broadcast of a bucket: tensors [first, end) of the wire order, packed at ``offset`` of the
    staging buffer, or sent from their own memory (``offset`` None)."""

    first: int
    end: int
    offset: int | None
    nbytes: int


@dataclass
class BucketRecipe:
    """How one bucket is sent. ``positions``: its tensors' places in the source stream, in wire order."""

    positions: list[int]
    spec: bucket.BucketSpec
    parts: list[_Part]
    counts: list[int] | None  # tensors per broadcast, announced as ``segments`` (None: one packed broadcast)
    need: int  # staging bytes
    announcement: Announcement
    # packed GroupedRows (q/k/v rows of a fused QKV): the [groups, rows, ...] shape they are copied as, by wire index
    grouped_shapes: dict[int, list[int]] = field(default_factory=dict)
    # views of the staging buffer for the packed tensors (wire order) and of each packed part, per buffer
    _views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)

    def spans(self, items: list[Item]) -> list[torch.Tensor] | None:
        """Byte views of the parts sent from their own memory, for ``items`` (in wire order); None when one
        no longer lies back to back or contiguous (then the bucket must be planned afresh)."""
        out = []
        for part in self.parts:
            if part.offset is None:
                span = receiver.byte_span([t for _, t in items[part.first : part.end]])
                if span is None or span.numel() != part.nbytes:
                    return None
                out.append(span)
        return out

    def payload(
        self, items: list[Item], spans: list[torch.Tensor], staging: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """The bucket's broadcasts, in order: ``spans`` (from ``spans``) and the packed parts, whose tensors
        are copied into ``staging`` with one multi-tensor copy."""
        if staging is None:  # nothing to pack but empty tensors
            staging = torch.empty(self.need, dtype=torch.uint8, device=items[0][1].device)
        dsts, packed_parts = self._staging_views(staging)
        out: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        own, packed = iter(spans), iter(packed_parts)
        for part in self.parts:
            if part.offset is None:
                out.append(next(own))
                continue
            out.append(next(packed))
            srcs.extend(
                t.grouped if isinstance(t, bucket.GroupedRows) else t for _, t in items[part.first : part.end]
            )
        if srcs:
            with torch.no_grad():  # copies from parameters: no autograd record
                torch._foreach_copy_(dsts, srcs)
        return out

    def payload_packed(self, items: list[Item], staging: torch.Tensor) -> list[torch.Tensor]:
        """The same broadcasts (sizes and order) with every part packed into ``staging`` (``spec.nbytes``
        bytes at least): a replayed update whose tensors no longer lie back to back still sends what the
        engine recorded."""
        out, dsts, srcs, at = [], [], [], 0
        for part in self.parts:
            out.append(staging[at : at + part.nbytes])
            for i in range(part.first, part.end):
                dtype = bucket._dtype(self.spec.dtypes[i])
                n = bucket._numel(self.spec.shapes[i]) * dtype.itemsize
                shape = self.grouped_shapes.get(i, self.spec.shapes[i])
                dsts.append(staging[at : at + n].view(dtype).view(shape))
                t = items[i][1]
                srcs.append(t.grouped if isinstance(t, bucket.GroupedRows) else t)
                at += n
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        return out

    def _staging_views(self, staging: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        key = staging.data_ptr()
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 2:  # the sender alternates two buffers; a grown one replaces them
                self._views.clear()
            views = self._views[key] = self._make_views(staging)
        return views

    def _make_views(self, staging: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dsts, parts = [], []
        spec = self.spec
        for part in self.parts:
            if part.offset is None:
                continue
            parts.append(staging[part.offset : part.offset + part.nbytes])
            at = part.offset
            for i in range(part.first, part.end):
                dtype = bucket._dtype(spec.dtypes[i])
                n = bucket._numel(spec.shapes[i]) * dtype.itemsize
                shape = self.grouped_shapes.get(i, spec.shapes[i])
                dsts.append(staging[at : at + n].view(dtype).view(shape))
                at += n
        return dsts, parts


def compile_bucket(
    items: list[Item], positions: list[int], own_bytes: int | None
) -> tuple[BucketRecipe, list[Item]]:
    """Plan one bucket (``segments.plan``) and record it; ``positions``: each item's place in the source.
    Returns the recipe and the items in wire order."""
    runs = segments.plan(items, own_bytes)
    index = {_key(item): i for i, item in enumerate(items)}
    wire = [index[_key(item)] for _, run in runs for item in run]
    ordered = [items[i] for i in wire]
    parts, first, offset = [], 0, 0
    for own, run in runs:
        n = sum(segments.nbytes(t) for _, t in run)
        parts.append(_Part(first, first + len(run), None if own is not None else offset, n))
        if own is None:
            offset += n
        first += len(run)
    spec = segments.spec(ordered)
    # tensors per broadcast (only to engines that take segments), whenever there are several broadcasts
    # or one from a tensor's own memory (the engine may then receive it in place)
    several = len(runs) > 1 or runs[0][0] is not None
    counts = [len(run) for _, run in runs] if several else None
    recipe = BucketRecipe(
        positions=[positions[i] for i in wire],
        spec=spec,
        parts=parts,
        counts=counts,
        need=offset,
        announcement=Announcement(spec.names, spec.dtypes, spec.shapes, counts),
        grouped_shapes={
            i: list(t.grouped.shape) for i, (_, t) in enumerate(ordered) if isinstance(t, bucket.GroupedRows)
        },
    )
    return recipe, ordered


@dataclass
class _Record:
    """A whole sync: each source position's name, shape, dtype and type, and the buckets in send order."""

    names: list[str] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    types: list[type] = field(default_factory=list)
    buckets: list[BucketRecipe] = field(default_factory=list)

    def add(self, name: str, t: bucket.Packable) -> None:
        self.names.append(name)
        self.shapes.append(t.shape)
        self.dtypes.append(t.dtype)
        self.types.append(type(t))

    def matches(self, pos: int, name: str, t: bucket.Packable) -> bool:
        return (
            pos < len(self.names)
            and name == self.names[pos]
            and type(t) is self.types[pos]
            and t.dtype == self.dtypes[pos]
            and t.shape == self.shapes[pos]
        )


class PlanDiverged(RuntimeError):
    """A replayed update's source no longer matches the record (another model, dtype or shape)."""


class SyncPlan:
    """Recorded syncs, one per bucketing setting (``key``: whatever changes how tensors are bucketed)."""

    def __init__(self) -> None:
        self._records: dict[tuple, _Record] = {}
        self.replayed = 0  # buckets replayed from a record (last sync)
        self.planned = 0  # buckets planned afresh (last sync)

    def buckets(
        self,
        tensors: Iterable[Item],
        key: tuple,
        stream: Callable[[Iterable[Item]], Iterable[list[Item]]],
        own_bytes: int | None,
        strict: bool = False,
    ) -> Iterator[tuple[list[Item], BucketRecipe, list[torch.Tensor] | None]]:
        """Each bucket's tensors (in wire order), its recipe and the byte views of its parts sent from their
        own memory. ``stream`` cuts buckets from tensors (``bucket.stream_buckets`` with the sender's sizes)
        once the record no longer applies. The sync becomes the record once every tensor went out.

        ``strict`` (a replayed update, whose engines expect the record's broadcasts): the recorded recipes
        only; spans are None for a bucket whose own-memory tensors moved (``payload_packed`` sends it), and
        a source that differs from the record raises ``PlanDiverged``."""
        self.replayed = self.planned = 0
        old = self._records.get(key)
        new = _Record()
        source = iter(tensors)
        where: dict[int, int] = {}  # id(tensor) -> source position, for tensors read and not yet bucketed
        pending: dict[int, Item] = {}  # replay: read from the source, not yet in a bucket
        refeed: list[Item] = []  # read during the replay, to be planned afresh
        if strict and old is None:
            raise PlanDiverged("no recorded sync to replay")
        for recipe in old.buckets if old is not None else []:
            last = max(recipe.positions)
            while len(new.names) <= last:
                item = next(source, None)
                if item is None:
                    break
                pos = len(new.names)
                new.add(*item)
                pending[pos] = item
                if not old.matches(pos, *item):
                    break
            else:
                items = [pending.pop(p) for p in recipe.positions]
                spans = recipe.spans(items)
                if spans is None and strict:
                    self.replayed += 1
                    new.buckets.append(recipe)
                    yield items, recipe, None
                    continue
                if spans is None:  # a tensor sent from its own memory moved: plan this bucket again
                    recipe, items = compile_bucket(items, recipe.positions, own_bytes)
                    spans = recipe.spans(items)
                    self.planned += 1
                else:
                    self.replayed += 1
                new.buckets.append(recipe)
                yield items, recipe, spans
                continue
            if strict:
                raise PlanDiverged(f"tensor {len(new.names) - 1} ({new.names[-1]}) differs from the record")
            # the record ends here: what was read and not yet sent is planned with the rest
            for p in sorted(pending):
                where[_key(pending[p])] = p
                refeed.append(pending[p])
            pending.clear()
            break

        if strict:
            if next(source, None) is not None or len(new.names) != len(old.names):
                raise PlanDiverged(f"the source has {len(new.names)}+ tensors; the record {len(old.names)}")
            self._records[key] = new
            return

        def tagged() -> Iterator[Item]:
            for item in source:
                where[_key(item)] = len(new.names)
                new.add(*item)
                yield item

        for items in stream(itertools.chain(refeed, tagged())):
            positions = [where.pop(_key(item)) for item in items]
            recipe, ordered = compile_bucket(items, positions, own_bytes)
            spans = recipe.spans(ordered)
            assert spans is not None, "a bucket just planned has its own-memory parts back to back"
            new.buckets.append(recipe)
            self.planned += 1
            yield ordered, recipe, spans
        self._records[key] = new

    def recorded(self, key: tuple) -> list[BucketRecipe] | None:
        """The buckets of the last sync with bucketing setting ``key`` (what a replay sends), if any."""
        record = self._records.get(key)
        return None if record is None else list(record.buckets)


def _key(item: Item) -> tuple[str, int]:
    """A tensor read and not yet bucketed (names are unique in a sync; the tensor is alive until bucketed)."""
    return item[0], id(item[1])
