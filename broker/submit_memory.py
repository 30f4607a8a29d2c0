"""Group frames submitted through memory shared with the broker, by rollout nodes on its host.

Over the wire a group frame is copied into the kernel by the producer and out of it by the broker's ZeroMQ
I/O thread: at 32K-token samples that second receive was the broker's largest cost per sample
(docs/BENCHMARKS.md). A rollout node on the broker's host (same boot id) is offered instead a ring of
memory the broker allocated for it (``memfd``): the node encodes each group frame straight into the ring
and its submit names where the frames lie (``spans``) instead of carrying them. The broker holds the spans
as it held received frames (journaled, copied out by a local consumer, sent on the wire to a remote one)
and gives a span back when it lets go of the group: consumed, dropped, filtered or refused.

The ring is shared by two parties with one rule each: the node only writes between its ``head`` (where it
allocates next) and the broker's ``tail`` + capacity; the broker only moves ``tail``, to the start of the
oldest span it still holds (or past every span it has seen when it holds none). Positions are byte counts
since the ring was made (monotonic, never reused); a span never wraps (the node skips to the ring's start
instead). ``tail`` is one aligned 64-bit word in the ring's header page, written by the broker alone.

The node maps the ring through ``/proc/<broker pid>/fd/<fd>`` (the same user may open another process's
descriptors) and checks a random nonce in the header, so a client in another pid namespace or a stale
reply maps nothing; on any failure it submits over the wire, as do nodes on other hosts.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
from collections import deque
from typing import Any

import numpy as np

from tidal.broker.codec import encode_group
from tidal.broker.protocol import BAD_FRAME, ProtocolError
from tidal.broker.types import Group

log = logging.getLogger(__name__)

MAGIC = b"TIDALSM1"
HEADER_BYTES = 4096  # magic | nonce | ... | tail (u64 at TAIL_AT); the ring follows
NONCE_AT, NONCE_BYTES = 8, 16
TAIL_AT = 64
ALIGN = 64  # spans start on cache lines (the frame's arrays are 8-byte aligned within it)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def can_share() -> bool:
    return hasattr(os, "memfd_create")


# ------------------------------------------------------------------------------------------ broker side
class SubmitArena:
    """The broker's side of one node's ring: makes it, checks the spans a submit names, moves ``tail``."""

    def __init__(self, capacity: int):
        self.capacity = _align(capacity)
        self.fd = os.memfd_create("tidal-submit", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER_BYTES + self.capacity)
        self.mm = mmap.mmap(self.fd, HEADER_BYTES + self.capacity)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.mm[: len(MAGIC)] = MAGIC
        self.mm[NONCE_AT : NONCE_AT + NONCE_BYTES] = self.nonce
        self._tail = np.frombuffer(self.mm, np.int64, count=1, offset=TAIL_AT)
        self._view = memoryview(self.mm)
        self._lock = threading.Lock()  # spans are let go on whichever thread drops them last
        self._live: deque[list[int]] = deque()  # [start, end, held] in ring order
        self._seen = 0  # end of the last span a submit named
        self.spans_taken = 0
        self.wire_submits = 0  # submits this node sent over the wire all the same (its ring was full)

    def offer(self, pid: int) -> dict[str, Any]:
        """What the register reply tells the node (``submit_memory``)."""
        return {"pid": pid, "fd": self.fd, "bytes": self.capacity, "nonce": self.nonce}

    def close(self) -> None:
        """The node left: no one maps the ring any more. Spans still held stay readable (the mapping
        lives until the last of them is let go)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def spans(self, wire: Any, max_bytes: int) -> list[ArenaSpan]:
        """The submit's ``spans`` ([[start, length], ...]) as held frames, checked against the ring's rule."""
        if not isinstance(wire, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in wire
        ):
            raise ProtocolError(BAD_FRAME, "submit: spans must be a list of [start, length] integer pairs")
        if sum(length for _, length in wire) > max_bytes:
            raise ProtocolError(BAD_FRAME, f"submit: spans hold more than broker.max_frame_bytes={max_bytes}")
        out = []
        with self._lock:
            tail = self._tail_now()
            seen = self._seen
            for start, length in wire:
                offset = start % self.capacity if start >= 0 else -1
                if (
                    length < 1
                    or start < seen
                    or offset + length > self.capacity
                    or start + length > tail + self.capacity
                ):
                    raise ProtocolError(
                        BAD_FRAME,
                        f"submit: span [{start}, {length}] is outside the node's free ring (written through "
                        f"{seen}, free from {tail}, capacity {self.capacity}): only fresh, unwrapped spans",
                    )
                seen = start + length
            for start, length in wire:
                entry = [start, start + length, 1]
                self._live.append(entry)
                offset = HEADER_BYTES + start % self.capacity
                out.append(ArenaSpan(self, entry, self._view[offset : offset + length]))
            self._seen = seen
            self.spans_taken += len(out)
        return out

    def _tail_now(self) -> int:
        return self._live[0][0] if self._live else self._seen

    def let_go(self, entry: list[int]) -> None:
        with self._lock:
            entry[2] = 0
            live = self._live
            while live and not live[0][2]:
                live.popleft()
            self._tail[0] = self._tail_now()

    @property
    def held(self) -> int:
        return len(self._live)


class ArenaSpan:
    """A group frame in a node's ring, held by the broker as a received frame is (bytes-like: ``len`` and
    the buffer protocol; every view of it keeps it held). Given back to the ring when the last reference
    goes."""

    __slots__ = ("_arena", "_entry", "_view")

    def __init__(self, arena: SubmitArena, entry: list[int], view: memoryview):
        self._arena, self._entry, self._view = arena, entry, view

    def __len__(self) -> int:
        return len(self._view)

    def __buffer__(self, flags: int) -> memoryview:
        return self._view  # the memoryview made from this keeps this span alive (PEP 688)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self)

    def ring_location(self) -> tuple[dict[str, Any], int] | None:
        """(the ring as a reader on this host opens it, this frame's offset in its file); None once the
        node left (its descriptor is closed: readers copy through this process's memory instead)."""
        arena = self._arena
        if arena.fd < 0:
            return None
        ring = {"fd": arena.fd, "bytes": arena.capacity, "nonce": arena.nonce}
        return ring, HEADER_BYTES + self._entry[0] % arena.capacity

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._arena.let_go(self._entry)


# ------------------------------------------------------------------------------------------ node side
class SubmitMemoryUnavailable(Exception):
    """The broker's ring could not be mapped; submit over the wire."""


class _RingFull(Exception):
    """The ring has no room for a group: that submit goes over the wire."""


def open_ring(pid: int, ring: dict[str, Any], writable: bool) -> mmap.mmap:
    """Map the ring the broker (process ``pid``) describes as ``{fd, bytes, nonce}``, checking it is that
    ring; raises :class:`SubmitMemoryUnavailable` saying why not."""
    try:
        fd, capacity, nonce = int(ring["fd"]), int(ring["bytes"]), ring["nonce"]
        path = f"/proc/{int(pid)}/fd/{fd}"
        handle = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise SubmitMemoryUnavailable(f"cannot open the broker's submit memory: {exc}") from None
    try:
        size = os.fstat(handle).st_size
        if size != HEADER_BYTES + capacity:
            raise SubmitMemoryUnavailable(f"{path} holds {size} bytes, the broker said {capacity}")
        mm = mmap.mmap(handle, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(handle)
    if mm[: len(MAGIC)] != MAGIC or mm[NONCE_AT : NONCE_AT + NONCE_BYTES] != nonce:
        mm.close()
        raise SubmitMemoryUnavailable("the mapped memory is not the ring the broker offered (nonce differs)")
    return mm


class SubmitRing:
    """The node's side: maps the broker's ring and allocates spans for group frames."""

    def __init__(self, offer: dict[str, Any]):
        self.mm = open_ring(offer.get("pid", -1), offer, writable=True)
        self.capacity = capacity = int(offer["bytes"])
        self.ring = np.frombuffer(self.mm, np.uint8, count=capacity, offset=HEADER_BYTES)
        self._tail = np.frombuffer(self.mm, np.int64, count=1, offset=TAIL_AT)
        self.head = 0
        self.peak = 0  # the most bytes this node has had in the ring at once (allocated, not let go)
        self._skipped = (0, 0)  # positions [from, to) the last jump to a lap's start left unused
        self.full = 0  # allocations refused for want of room (those submits went on the wire)

    def alloc(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        """A fresh span of ``nbytes``: (start position, its memory), or None when the ring has no room.

        A span goes back to the ring's start (the next lap) as soon as the room the broker let go of there
        is twice the most bytes this node has had in flight, not only when the end is reached: the node,
        the broker and a local trainer all touch each frame within moments, and room they touched a moment
        ago is still in their caches. The ring then cycles through about three times the bytes in flight
        (a few MiB per node at 1K-token samples) instead of all of it. The rule uses the peak, not the
        bytes in flight at the moment of the jump: those dip whenever the oldest group is let go, and a
        jump taken in a dip left too little room once they grew back (with 8 leases in flight, half the
        submits of a 1K-token benchmark run found the ring full and went over the wire). Nor does the
        peak count the room a jump skipped at the end of a lap: counting it made the peak almost the whole
        ring after the first jump, and the node walked every page of it on every lap."""
        size = _align(nbytes)
        start = self.head
        offset = start % self.capacity
        tail = int(self._tail[0])
        lap = start - offset
        # the room skipped at the end of the last lap is not in flight, though it lies between tail and head
        skipped = max(0, self._skipped[1] - max(tail, self._skipped[0]))
        self.peak = max(self.peak, start + size - tail - skipped)
        # never wrap inside a span; and skip to the next lap once its free start is large enough
        if offset and (offset + size > self.capacity or tail - lap >= 2 * self.peak + size):
            self._skipped = (start, start + self.capacity - offset)
            start += self.capacity - offset
            offset = 0
        if start + size > tail + self.capacity:
            self.full += 1
            return None
        self.head = start + size
        return start, self.ring[offset : offset + nbytes]

    def encode(self, groups: list[Group]) -> list[list[int]] | None:
        """Each group's frame encoded into the ring: their [start, length] spans, or None (and nothing
        allocated) when the ring has no room for all of them."""
        mark, spans = self.head, []

        def alloc(nbytes: int) -> np.ndarray:
            got = self.alloc(nbytes)
            if got is None:
                raise _RingFull
            spans.append([got[0], nbytes])
            return got[1]

        try:
            for g in groups:
                encode_group(g, alloc, streaming=True)  # the node does not read its frames again
        except _RingFull:
            self.head = mark  # nothing was sent: the spans are free again
            return None
        return spans

    def close(self) -> None:
        self.ring = self._tail = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # frames of submits in flight still refer to it: GC unmaps
            self.mm.close()
