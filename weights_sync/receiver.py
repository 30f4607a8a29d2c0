"""The receive side of a weight sync: named groups, ordered and double-buffered flattened buckets.

Engines call this from their ``/init_weights_update_group`` and ``/update_weights_from_distributed``
handlers. A handler holds its bucket from the receive until it has loaded it::

    with receiver.receive(names=..., dtypes=..., shapes=..., group_name=..., seq=k) as tensors:
        load(tensors)            # views into one of the group's two buffers

Each group has two receive buffers, so bucket k+1 is received into the other buffer while bucket k is
being loaded (``DECLARED_EXTENSIONS``: such an engine lets the sender announce the next bucket before the
previous one is answered). Announcements travel on separate HTTP connections and may arrive out of
order; ``seq`` (tidal's ``bucket_seq`` extension, 0, 1, 2, ... per group) makes each handler wait for
its turn, so receives follow the sender's broadcast order. Without ``seq`` receives run in arrival
order, one at a time, as in SGLang. ``receive_tensors`` is SGLang's other load format (one broadcast per
tensor, into fresh tensors); it takes its turn like a bucket.

``segments`` (tidal's ``bucket_segments`` extension) splits a bucket's bytes into consecutive
broadcasts, so the sender sends large tensors straight from their memory instead of packing them; a
segment whose tensors' ``target``s (the engine's weights, when they may be written now) take them as
they are and lie back to back (one tensor, or q/k/v and gate/up in a fused matrix) is received straight
into them and left out of what ``receive`` yields: neither side copies it.

``stats`` counts what was received and how long receives and loads took (the stand-in's and the
engine's ``/tidal/stats``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tidal.weights_sync import bucket, transport

# What a receiver built on this module answers in ``/init_weights_update_group`` (tidal's extensions):
# ``ordered_buckets``: the sender may pipeline announcements that carry ``bucket_seq``;
# ``bucket_segments``: a bucket may come as several broadcasts (``segments``: tensors per broadcast);
# ``pause_in_update``: ``/begin_weight_update`` takes ``pause_mode`` (pauses generation first, as
# ``/pause_generation`` would) and ``/end_weight_update`` takes ``continue_generation: true`` (continues it
# after), so opening and closing an update cost one round trip each instead of two.
# ``replay_updates``: ``/tidal/replay_weight_update`` repeats the last fully announced update (replay.py);
# ``grouped_qkv``: megatron's fused QKV may come whole, as ``<prefix>.qkv_proj.weight`` (grouped_qkv.py).
DECLARED_EXTENSIONS = {
    "ordered_buckets": True,
    "bucket_segments": True,
    "pause_in_update": True,
    "replay_updates": True,
    "grouped_qkv": True,
}

# bucket layouts whose views a receive buffer keeps (a sync's buckets alternate between two buffers)
_KEPT_LAYOUTS = 256

# ``target(name, shape, dtype)``: the engine's own tensor that ``name`` is received into in place, or None
Target = Callable[[str, list[int], torch.dtype], torch.Tensor | None]


class ChecksumMismatch(ValueError):
    pass


class BucketOrderError(RuntimeError):
    """A bucket's turn never came (a predecessor was lost) or its sequence number was already used."""


@dataclass
class ReceiveStats:
    buckets: int = 0
    bytes: int = 0
    in_place_bytes: int = 0  # of ``bytes``: received straight into a ``target``
    receive_s: float = 0.0  # from the announcement's arrival until its bytes arrived, less load_s
    load_s: float = 0.0  # in the handler's block: from its buffered bytes' arrival until it loaded them

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class _Layout:
    """An announced bucket, checked: its spec, size, broadcasts ([first, end) tensor indices), dtypes and byte
    offsets (the bucket's size last). ``key``: the announcement's names, dtypes, shapes and segments."""

    key: tuple | None
    spec: bucket.BucketSpec
    nbytes: int
    runs: list[tuple[int, int]]
    dtypes: list[torch.dtype]
    offsets: list[int]


class _Slot:
    """One receive buffer; held from the receive until its bucket is loaded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer: torch.Tensor | None = None
        # the views made into ``buffer`` for each bucket layout received into it (a sync repeats the same
        # buckets: made once instead of a view per tensor per sync); dropped with the buffer
        self.views: dict[tuple, tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]] = {}


class _GroupState:
    def __init__(self, group: transport.WeightGroup):
        self.group = group
        self.turn = threading.Condition()
        self.next_seq = 0  # the bucket whose turn it is to receive
        self.issued = 0  # one past the highest bucket announced so far
        self.waiting = 0  # handlers waiting for their turn
        self.closed = False
        self.slots = (_Slot(), _Slot())
        self.stream = None  # CUDA: the stream receives run on


class _Receives:
    """Receives started, in order, into ``dsts`` (every one before the first is waited for, so the sender's
    next broadcast finds its receive posted). On CUDA they run on the group's own stream, so loading the
    previous bucket (on the handler's current stream) does not queue behind them."""

    def __init__(self, state: _GroupState, dsts: list[torch.Tensor]):
        self.works: dict[int, Any] = {}  # gloo: not yet waited for, by index into dsts
        self.arrived: torch.cuda.Event | None = None
        if not dsts or dsts[0].device.type != "cuda":
            self.works = {i: state.group.broadcast_async(dst, src=0) for i, dst in enumerate(dsts)}
            return
        if state.stream is None:
            state.stream = torch.cuda.Stream(dsts[0].device)
        with torch.cuda.stream(state.stream):
            for dst in dsts:
                state.group.broadcast_async(dst, src=0).wait()  # NCCL: orders the stream after it
            self.arrived = torch.cuda.Event()
            self.arrived.record(state.stream)

    def wait(self, which: Iterable[int] | None = None) -> None:
        """Return once the bytes of ``dsts[i]`` for each ``i`` in ``which`` (default: all) have arrived."""
        error = None
        for i in list(self.works) if which is None else [i for i in which if i in self.works]:
            try:  # every one of them, so that none is still being written when this raises
                self.works.pop(i).wait()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others finished
                error = error or exc
        if error is not None:
            raise error
        if self.arrived is not None:
            self.arrived.synchronize()  # NCCL's wait() only orders a stream: wait for the bytes themselves

    def settle(self) -> None:
        """Wait for whatever is left, ignoring failures (the receive already failed)."""
        with contextlib.suppress(Exception):
            self.wait()


class WeightReceiver:
    def __init__(self, device: str = "cpu", timeout_s: float = 60.0):
        self.device = device
        self.timeout_s = timeout_s
        self._groups: dict[str, _GroupState] = {}
        self._lock = threading.Lock()
        self._layouts: dict[tuple, _Layout] = {}
        self._raw_distinct: torch.Tensor | None = None  # receive_raw's buffer for distinct memory
        self.stats = ReceiveStats()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = ReceiveStats()

    def _count(self, nbytes: int, receive_s: float, load_s: float, in_place: int = 0) -> None:
        with self._lock:
            self.stats.buckets += 1
            self.stats.bytes += nbytes
            self.stats.in_place_bytes += in_place
            self.stats.receive_s += receive_s
            self.stats.load_s += load_s

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None = None,
        local_rank: int = 0,
    ) -> None:
        """Join ``group_name`` as rank ``rank_offset + local_rank`` (blocks until all ranks joined)."""
        self.destroy_group(group_name)  # the sender rebuilt the group (a node joined or died): replace ours
        group = transport.create_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset + local_rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
        )
        with self._lock:
            self._groups[group_name] = _GroupState(group)

    def destroy_group(self, group_name: str) -> bool:
        with self._lock:
            state = self._groups.pop(group_name, None)
        if state is None:
            return False
        with state.turn:
            state.closed = True
            state.turn.notify_all()  # handlers waiting for their turn fail instead of timing out
        state.group.destroy()
        return True

    @property
    def group_names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    @property
    def waiting(self) -> int:
        """Handlers waiting for their bucket's turn, over all groups."""
        with self._lock:
            states = list(self._groups.values())
        return sum(state.waiting for state in states)

    def group(self, group_name: str) -> transport.WeightGroup:
        return self._state(group_name).group

    def _state(self, group_name: str) -> _GroupState:
        with self._lock:
            state = self._groups.get(group_name)
        if state is None:
            raise KeyError(
                f"weight-update group {group_name!r} does not exist: call init_weights_update_group first"
            )
        return state

    def continue_at(self, group_name: str, seq: int) -> None:
        """The group's next bucket is ``seq`` (a replayed update numbers its buckets from the sender's count)."""
        state = self._state(group_name)
        with state.turn:
            if state.waiting:
                raise BucketOrderError(
                    f"group {group_name}: {state.waiting} buckets still wait for their turn"
                )
            state.next_seq = state.issued = seq
            state.turn.notify_all()

    @contextmanager
    def _turn(self, state: _GroupState, group_name: str, seq: int | None) -> Iterator[int]:
        """Wait for ``seq``'s turn (arrival order without it); the next turn starts when the block exits."""
        with state.turn:
            if seq is None:  # arrival order
                seq = state.issued
            state.issued = max(state.issued, seq + 1)
            state.waiting += 1
            try:
                self._wait_for_turn(state, seq, group_name)
            finally:
                state.waiting -= 1
        try:
            yield seq
        finally:
            with state.turn:  # the next bucket may go on even after a failure: the sender drops us anyway
                state.next_seq = seq + 1
                state.turn.notify_all()

    @contextmanager
    def receive(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        checksum: int | None = None,
        seq: int | None = None,
        segments: list[int] | None = None,
        target: Target | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receive one flattened bucket; yields views of its tensors, valid until the block exits, except
        those received straight into their ``target`` (never with a ``checksum``: it covers the buffer)."""
        t0 = time.perf_counter()
        layout = self._layout(names, dtypes, shapes, segments)  # raises ValueError before any receive
        spec, nbytes, runs, dtypes_, offsets = (
            layout.spec,
            layout.nbytes,
            layout.runs,
            layout.dtypes,
            layout.offsets,
        )
        state = self._state(group_name)
        with self._turn(state, group_name, seq) as seq:
            # our turn: the other handlers wait for next_seq, which moves once our receives are posted
            dsts: list[torch.Tensor | None] = [None] * len(runs)
            if target is not None and checksum is None:
                device = torch.empty(0, device=self.device).device
                for r, (first, end) in enumerate(runs):
                    dsts[r] = _in_place(
                        target, spec.names[first:end], spec.shapes[first:end], dtypes_[first:end], device
                    )
            buffered = [r for r, dst in enumerate(dsts) if dst is None]
            # a bucket received wholly in place needs no buffer: its receives are posted at once, also
            # while the bucket two before is still being loaded
            slot = state.slots[seq % 2] if buffered else None
            # bucket seq-2 used this buffer: its handler must have loaded it (normally long done)
            if slot is not None and not slot.lock.acquire(timeout=self.timeout_s):
                raise BucketOrderError(f"group {group_name}: bucket {seq - 2} was never loaded")
            try:
                in_place = sum(
                    offsets[end] - offsets[first]
                    for (first, end), dst in zip(runs, dsts, strict=True)
                    if dst is not None
                )
                buf, views = self._buffered(slot, layout, dsts) if slot is not None else (None, [])
                # the next bucket's turn starts once these receives are posted, not once they are done
                receives = _Receives(state, dsts)
            except BaseException:
                if slot is not None:
                    slot.lock.release()
                raise
        loaded = 0.0  # seconds in the caller's block (its load)
        try:
            # the tensors to load are yielded once their own bytes are in: loading them overlaps the
            # segments still arriving in place (the small tensors go first); the block exits (and the
            # engine replies) only once every byte has arrived
            receives.wait(buffered)
            t1 = time.perf_counter()
            if checksum is not None and buf is not None and bucket.checksum(buf) != checksum:
                raise ChecksumMismatch(
                    f"bucket of {len(names)} tensors ({names[0]} ...) in group {group_name}: checksum "
                    f"{bucket.checksum(buf)} != announced {checksum}"
                )
            yield views
            loaded = time.perf_counter() - t1
            receives.wait()
        finally:
            receives.settle()  # after a failure: nothing may still write into the buffer once it is free
            if receives.arrived is not None and buf is not None:  # the load read this buffer: finish it
                torch.cuda.current_stream(buf.device).synchronize()
            if slot is not None:
                slot.lock.release()
            spent = time.perf_counter() - t0
            self._count(nbytes, spent - loaded, loaded, in_place)

    def _layout(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], segments: list[int] | None
    ) -> _Layout:
        """The announced bucket's offsets and broadcasts, checked (ValueError naming what is wrong); kept per
        announcement, as a sync repeats the same buckets."""
        try:
            key = (tuple(names), tuple(dtypes), tuple(map(tuple, shapes)), segments and tuple(segments))
            layout = self._layouts.get(key)
        except TypeError:  # unhashable parts: checked (and refused) below
            key, layout = None, None
        if layout is not None:
            return layout
        spec = _spec(names, dtypes, shapes)
        nbytes = spec.nbytes  # raises ValueError naming a bad dtype or shape
        runs = _runs(segments, len(spec.names))
        # by arithmetic, not views: this runs per tensor before the receives are posted
        dtypes_ = [bucket._dtype(d) for d in spec.dtypes]
        layout = _Layout(key, spec, nbytes, runs, dtypes_, _offsets(spec, dtypes_))
        if key is not None:
            with self._lock:
                if len(self._layouts) >= _KEPT_LAYOUTS:
                    self._layouts.clear()
                self._layouts[key] = layout
        return layout

    def _buffered(
        self, slot: _Slot, layout: _Layout, dsts: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
        """Lay the segments that are not received in place (``dsts[r] is None``) out in ``slot``'s buffer and
        fill in their ``dsts``; returns the buffer and views of their tensors, in order. Only those take
        room, each at an offset congruent to its offset in the bucket modulo 16 (so every tensor keeps its
        alignment); without segments in place the buffer is the bucket as sent. The views are kept per
        layout (names, dtypes, shapes, segments, which segments are in place) and reused by the next sync."""
        spec, runs, offsets, dtypes = layout.spec, layout.runs, layout.offsets, layout.dtypes
        key = (layout.key, tuple(dst is None for dst in dsts))
        placed, size = [], 0
        for r, (first, end) in enumerate(runs):
            if dsts[r] is None:
                size += (offsets[first] - size) % 16
                placed.append((r, size))
                size += offsets[end] - offsets[first]
        buf = self._buffer(slot, size)
        kept = slot.views.get(key) if layout.key is not None else None
        if kept is not None:
            views, parts = kept
        else:
            views, parts = [], []
            for r, at in placed:
                first, end = runs[r]
                parts.append(buf[at : at + offsets[end] - offsets[first]])
                shift = at - offsets[first]
                i = first
                while (
                    i < end
                ):  # one typed view and one split per run of a dtype: hundreds of tensors a bucket
                    j = i + 1
                    while j < end and dtypes[j] == dtypes[i]:
                        j += 1
                    typed = buf[shift + offsets[i] : shift + offsets[j]].view(dtypes[i])
                    sizes = [(offsets[k + 1] - offsets[k]) // dtypes[i].itemsize for k in range(i, j)]
                    for k, part in zip(range(i, j), typed.split(sizes), strict=True):
                        views.append((spec.names[k], part.view(spec.shapes[k])))
                    i = j
            if layout.key is not None:
                if len(slot.views) >= _KEPT_LAYOUTS:
                    slot.views.clear()
                slot.views[key] = (views, parts)
        for (r, _), part in zip(placed, parts, strict=True):
            dsts[r] = part
        return buf, views

    def receive_tensors(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        seq: int | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """SGLang's per-tensor load format: one broadcast per tensor, each into a fresh tensor."""
        t0 = time.perf_counter()
        spec = _spec(names, dtypes, shapes)
        nbytes = spec.nbytes
        state = self._state(group_name)
        received = [
            (name, torch.empty(shape, dtype=bucket._dtype(dtype), device=self.device))
            for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes, strict=True)
        ]
        with self._turn(state, group_name, seq):
            receives = _Receives(state, [t for _, t in received])
        receives.wait()
        self._count(nbytes, time.perf_counter() - t0, 0.0)
        return received

    def _wait_for_turn(self, state: _GroupState, seq: int, group_name: str) -> None:
        if seq < state.next_seq:
            raise BucketOrderError(
                f"group {group_name}: bucket_seq {seq} was already received (next is {state.next_seq})"
            )
        deadline = time.monotonic() + self.timeout_s
        while state.next_seq != seq and not state.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BucketOrderError(
                    f"group {group_name}: bucket_seq {seq} waited {self.timeout_s:.0f}s for bucket "
                    f"{state.next_seq}, which never arrived"
                )
            state.turn.wait(left)
        if state.closed:
            raise BucketOrderError(f"group {group_name} was destroyed while bucket {seq} waited")

    def _buffer(self, slot: _Slot, nbytes: int) -> torch.Tensor:
        # reused across buckets and syncs: a fresh CPU allocation costs a page fault per 4 KB
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            slot.views.clear()  # views into the old buffer
            slot.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return slot.buffer[:nbytes]

    def receive_raw(self, sizes: list[int], group_name: str, distinct: bool = False) -> None:
        """Plain uint8 broadcasts of ``sizes`` bytes, between two barriers and synchronised on CUDA (the
        benchmark's transport ceiling): into one reused buffer, or with ``distinct`` each into its own part
        of a buffer of their sum (kept for the next call), as a sync's bytes land in the weights."""
        state = self._state(group_name)
        with state.slots[0].lock:
            if distinct:
                if self._raw_distinct is None or self._raw_distinct.numel() < sum(sizes):
                    self._raw_distinct = None  # the old one freed first
                    self._raw_distinct = torch.ones(sum(sizes), dtype=torch.uint8, device=self.device)
                buf = self._raw_distinct
            else:
                buf = self._buffer(state.slots[0], max(sizes))
            state.group.barrier()
            offset = 0
            for n in sizes:
                state.group.broadcast(buf[offset : offset + n], src=0)
                offset += n if distinct else 0
            state.group.barrier()


def _spec(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> bucket.BucketSpec:
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            f"names, dtypes and shapes must be non-empty lists of one length, got "
            f"{len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    return bucket.BucketSpec(names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes])


def _runs(segments: list[int] | None, n: int) -> list[tuple[int, int]]:
    """[first, end) tensor indices of each broadcast of a bucket of ``n`` tensors."""
    if segments is None:
        return [(0, n)]
    if not all(isinstance(c, int) and c > 0 for c in segments) or sum(segments) != n:
        raise ValueError(
            f"segments={segments} must be positive tensor counts that add up to the bucket's {n} tensors"
        )
    bounds = [0]
    for count in segments:
        bounds.append(bounds[-1] + count)
    return list(zip(bounds, bounds[1:], strict=False))


def _offsets(spec: bucket.BucketSpec, dtypes: list[torch.dtype]) -> list[int]:
    """Each announced tensor's byte offset in the bucket, and the bucket's size last; raises ValueError
    for a tensor that would not be aligned to its dtype."""
    offsets = [0]
    for name, dtype, shape in zip(spec.names, dtypes, spec.shapes, strict=True):
        if offsets[-1] % dtype.itemsize:
            raise ValueError(f"unaligned tensor {name} at byte {offsets[-1]} for dtype {dtype}")
        offsets.append(offsets[-1] + bucket._numel(shape) * dtype.itemsize)
    return offsets


def _in_place(
    target: Target,
    names: list[str],
    shapes: list[list[int]],
    dtypes: list[torch.dtype],
    device: torch.device,
) -> torch.Tensor | None:
    """The bytes that a segment of tensors (names, shapes and dtypes as announced) can be received into in
    place on ``device``: its tensors' targets, if each takes its tensor as it is (same dtype, shape,
    device; contiguous) and they lie back to back in one storage in the segment's order (as q/k/v or
    gate/up do in a fused matrix); else None."""
    targets = []
    end = (
        None  # where the previous target ends: stop at the first that does not follow it (no wasted lookups)
    )
    for name, shape, dtype in zip(names, shapes, dtypes, strict=True):
        t = target(name, list(shape), dtype)
        if t is None or t.dtype != dtype or list(t.shape) != list(shape) or t.device != device:
            return None
        if not t.is_contiguous() or (end is not None and t.data_ptr() != end):
            return None
        end = t.data_ptr() + t.numel() * t.element_size()
        targets.append(t)
    return byte_span(targets)


def byte_span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A uint8 view over contiguous ``tensors`` that lie back to back in one storage, else None."""
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += t.numel() * t.element_size()
    nbytes = end - first.data_ptr()
    offset = first.storage_offset() * first.element_size()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), offset, (nbytes,)
    )
