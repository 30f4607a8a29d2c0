"""The clients' own bookkeeping (broker/client.py): reusable encode buffers, the window of submits not yet
acknowledged, and reading batches' frames from the broker's memory or journal on its host."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from tidal.broker.local_journal import JournalReader, JournalUnavailable, host_id
from tidal.broker.local_memory import MemoryReader, MemoryUnavailable

log = logging.getLogger("tidal.broker.client")

# Encode buffers kept for reuse per client: freshly allocated memory costs a page fault per 4 KiB, which
# was the largest part of a rollout node's cost of submitting large groups.
BUFFER_POOL_BYTES = 256 << 20


class _BufferPool:
    """Reusable memory for encoding group frames. A buffer comes back only once the broker has answered
    the submit that carried it: the broker then holds every byte, so nothing still reads it.

    Buffers are kept by size (sizes are rounded, so a run's groups share a few), and taking or giving
    one costs the same however many are kept (it once scanned them all, per group submitted)."""

    def __init__(self, max_bytes: int = BUFFER_POOL_BYTES):
        self.max_bytes = max_bytes
        self.free: dict[int, list[np.ndarray]] = {}  # by size
        self.held = 0  # bytes in ``free``

    @staticmethod
    def size_for(nbytes: int) -> int:
        step = max(4096, 1 << max(0, nbytes.bit_length() - 4))  # round up by 1/16: sizes vary a little
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> np.ndarray:
        size = self.size_for(nbytes)
        kept = self.free.get(size)
        if not kept:  # the smallest larger size kept, if any
            larger = [s for s, bs in self.free.items() if s > size and bs]
            kept = self.free[min(larger)] if larger else None
        if kept:
            b = kept.pop()
            self.held -= len(b)
            return b
        return np.empty(size, np.uint8)

    def give(self, buffers: list[np.ndarray]) -> None:
        for b in buffers:
            base = b.base if isinstance(b.base, np.ndarray) else b
            if self.held + len(base) <= self.max_bytes:
                self.free.setdefault(len(base), []).append(base)
                self.held += len(base)


# A message whose group frames are all at most this big is copied into ZeroMQ's memory when sent; a
# larger one goes by reference. By reference, pyzmq's garbage-collector thread is woken to release each
# frame once sent, which cost more than copying small frames: a producer of 8-sample groups of 1K-token
# samples (~100 KB frames) spent 19.7 us of CPU per sample by reference, 16.2 copying; with 8K tokens
# (~800 KB) copying cost 61 against 41.
SEND_COPY_MAX_BYTES = 256 << 10


def send_copies(frames: Any) -> bool:
    """Whether a message with these group frames is better copied than sent by reference."""
    return all(len(f) <= SEND_COPY_MAX_BYTES for f in frames)


# Group frames a client may have sent and not yet seen acknowledged (the producer's window).
MAX_UNACKED_BYTES = 128 << 20


class _Unacked:
    """Submits sent and not yet acknowledged: request id -> (node id it was sent as, group ids). An ``ack``
    acknowledges every submit of that node up to its ``through`` id; submits sent under an earlier
    registration (a broker that restarted) are never acknowledged by the new one and time out."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[str | None, list[str]]] = {}

    def add(self, rid: int, node_id: str | None, group_ids: list[str]) -> None:
        self.by_id[rid] = (node_id, group_ids)

    def forget(self, rid: int) -> None:
        self.by_id.pop(rid, None)

    def acked(self, body: dict[str, Any]) -> list[tuple[int, dict[str, list[str]]]]:
        through, node_id = body.get("through"), body.get("node_id")
        if not isinstance(through, int):
            return []
        filtered = {r: ids for r, ids in body.get("filtered") or ()}
        done = []
        for rid, (node, ids) in list(self.by_id.items()):
            if rid > through:
                break  # ids only grow
            if node != node_id:
                continue
            del self.by_id[rid]
            dropped = filtered.get(rid, [])
            done.append((rid, {"accepted": [g for g in ids if g not in dropped], "filtered": dropped}))
        return done


class _LocalFrames:
    """Reads batches' group frames, when on the broker's host, from the broker's memory (local_memory) or
    else from its journal (local_journal); each falls back to the next, the last to the wire."""

    def __init__(self, enabled: bool, memory: bool = True):
        self.host = host_id() if enabled else None
        self.reader = JournalReader() if self.host else None
        self.memory = MemoryReader() if self.host and memory else None
        self.batches_read = 0  # batches whose frames came from the journal
        self.batches_copied = 0  # batches whose frames were copied from the broker's memory

    def request_field(self) -> dict[str, Any]:
        if self.reader is None:
            return {}
        return {"host": self.host, "memory": True} if self.memory is not None else {"host": self.host}

    def frames(self, body: dict[str, Any], frames: list[Any]) -> list[Any] | None:
        """The reply's group frames; None when they must be asked for again on the wire."""
        batch = body.get("batch") or {}
        held = batch.get("memory")
        if held is not None and self.memory is not None:
            try:
                frames = self.memory.read(held["pid"], held["refs"], held.get("rings"))
                self.batches_copied += 1
                return frames
            except MemoryUnavailable as exc:
                log.info("copying batches from the broker's memory stopped (%s): reading its journal", exc)
                self.memory = None
        where = batch.get("journal")
        if where is None:
            return None if held is not None else frames
        if self.reader is None:
            return None
        try:
            frames = self.reader.read(
                where["path"], where["file_id"], where["refs"], bool(where.get("direct", True))
            )
            self.batches_read += 1
            return frames
        except JournalUnavailable as exc:
            log.info("reading batches from the broker's journal stopped (%s): frames come on the wire", exc)
            self.close()
            return None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.reader = None
        self.memory = None
