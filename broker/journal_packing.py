"""The journal's compact form of an accepted group frame (record kind ``PACKED``, journal format 4): the
frame with its per-token ``versions`` array run-length encoded.

A rollout engine stamps every token with the policy version that sampled it, so within a sample the
versions change only where a weight update landed mid-generation, and mostly not at all: a third of a
group frame's bytes (int32 ids, float32 logprobs, int32 versions) repeat one number. The broker journals
every accepted byte, and at 32K-token samples the journal's device was the broker's limit
(docs/BENCHMARKS.md), so the journal keeps those runs instead. The wire, the broker's memory and every
reader still see the frame exactly as it came: a ``PACKED`` record is expanded back to it byte for byte.

Payload: ``frame[:at] | frame[at + nbytes:] | run values | run lengths (<u4) | trailer``, the trailer
``<IIII``: the versions' byte offset ``at`` in the frame, their size ``nbytes``, the number of runs and
the item size. Groups whose runs would take more than half the bytes of the array are journaled as plain
``GROUP`` records.
"""

from __future__ import annotations

import struct

import numpy as np

TRAILER = struct.Struct("<IIII")
RUN_LENGTH = np.dtype("<u4")
_ONE_RUN = struct.Struct("<I")


class Pieces:
    """A record payload in pieces, written one after the other (nothing joins them into one buffer)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: tuple[bytes | memoryview, ...]):
        self.parts = parts
        self.nbytes = sum(map(len, parts))

    def __len__(self) -> int:
        return self.nbytes


def pack_group(frame: memoryview, at: int, count: int, dtype: np.dtype, lo: int, hi: int) -> Pieces | None:
    """The ``PACKED`` payload of ``frame`` whose versions (``count`` x ``dtype``) lie at byte ``at``;
    ``lo`` / ``hi``: their smallest and largest value (the broker has the first already). None where
    packing does not pay (runs taking more than half the array's bytes) or cannot be exact (versions of
    a float type, which the broker refuses anyway: runs of floats would not compare bit for bit)."""
    if count == 0 or dtype.kind not in "iu":
        return None
    nbytes = count * dtype.itemsize
    if lo == hi:  # the common case: one run, no pass over the array (and no numpy call: per group)
        values = lo.to_bytes(dtype.itemsize, "little", signed=dtype.kind == "i")
        lengths = _ONE_RUN.pack(count)
        runs = 1
    else:
        v = np.frombuffer(frame, dtype, count, at)
        starts = np.flatnonzero(v[1:] != v[:-1]) + 1
        if (len(starts) + 1) * (dtype.itemsize + RUN_LENGTH.itemsize) > nbytes // 2:
            return None
        starts = np.concatenate(([0], starts))
        runs = len(starts)
        values = v[starts].tobytes()
        lengths = np.diff(np.append(starts, count)).astype(RUN_LENGTH).tobytes()
    # the runs and the trailer as one piece: a few dozen bytes, summed and copied once
    runs_and_trailer = b"".join((values, lengths, TRAILER.pack(at, nbytes, runs, dtype.itemsize)))
    return Pieces((frame[:at], frame[at + nbytes :], runs_and_trailer))


def unpack_group(payload: memoryview) -> memoryview:
    """The group frame a ``PACKED`` payload holds, in fresh memory (read-only). Raises ``ValueError``
    where the payload is not one (a reader treats that as a corrupt record)."""
    payload = memoryview(payload).cast("B")
    if len(payload) < TRAILER.size:
        raise ValueError(f"packed group of {len(payload)} bytes is shorter than its trailer")
    at, nbytes, runs, itemsize = TRAILER.unpack_from(payload, len(payload) - TRAILER.size)
    kept = len(payload) - TRAILER.size - runs * (itemsize + RUN_LENGTH.itemsize)
    if itemsize not in (1, 2, 4, 8) or runs < 1 or not 0 <= at <= kept or nbytes % itemsize:
        raise ValueError(f"packed group trailer {(at, nbytes, runs, itemsize)} does not fit its payload")
    dtype = np.dtype(f"<u{itemsize}")  # the bytes come back as they were, whatever the signedness
    values = np.frombuffer(payload, dtype, runs, kept)
    lengths = np.frombuffer(payload, RUN_LENGTH, runs, kept + runs * itemsize)
    if int(lengths.sum(dtype=np.int64)) * itemsize != nbytes:
        raise ValueError(f"packed group runs cover {int(lengths.sum())} versions, not {nbytes // itemsize}")
    out = np.empty(kept + nbytes, np.uint8)
    out[:at] = np.frombuffer(payload, np.uint8, at)
    out[at : at + nbytes].view(dtype)[:] = np.repeat(values, lengths)
    out[at + nbytes :] = np.frombuffer(payload, np.uint8, kept - at, at)
    return memoryview(out).toreadonly()
