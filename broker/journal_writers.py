"""The journal's two ways of appending to a file (broker/journal.py): with O_DIRECT through an aligned
staging buffer, or through the page cache where the file system refuses O_DIRECT."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tidal.broker import native_codec
from tidal.broker.direct_memory import direct_buffer

log = logging.getLogger("tidal.broker.journal")

# Copies of at least this many bytes into the staging buffer go through numpy, which releases the GIL.
COPY_WITHOUT_GIL = 64 << 10


class BufferedWriter:
    """Appends through the page cache."""

    direct = False

    def __init__(self, path: Path, size: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = size

    def write(self, parts: list[bytes | memoryview]) -> None:
        _write_all(self.fd, parts)
        self.size += sum(len(p) for p in parts)

    def close(self) -> None:
        os.close(self.fd)


class DirectWriter:
    """Appends with O_DIRECT: records are copied into a page-aligned staging buffer and written through
    to the device in whole blocks; the last partial block stays staged and is rewritten with the next
    record (the file ends in zero padding, which the reader treats as the end). Page-cache writes can be
    several times slower than the device (they were here: 0.13 GB/s against 1.2 GB/s direct), and a
    journal is written once and read back only after a crash. The staging buffer has a fixed size
    (``STAGING``): a larger write goes through it in pieces, so its pages are faulted in once."""

    direct = True
    BLOCK = 4096
    STAGING = 8 << 20

    def __init__(self, path: Path, size: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        self.base = size // self.BLOCK * self.BLOCK  # file offset of the staging buffer's first byte
        # O_DIRECT pins these pages on every write: huge pages where the kernel gives them (direct_memory)
        self.array = direct_buffer(self.STAGING)
        self.view = memoryview(self.array)
        self.fill = size - self.base
        if self.fill:
            with open(path, "rb") as f:
                f.seek(self.base)
                self.view[: self.fill] = f.read(self.fill)
        self.size = size

    def write(self, parts: list[bytes | memoryview]) -> None:
        gather = _gather()
        end = None if gather is None else gather(self.array, self.fill, parts)
        if end is not None:  # they fit: copied in one call
            self.fill = end
        else:
            self._copy_in_pieces(parts)
        self._flush(whole_only=False)
        self.size = self.base + self.fill

    def _copy_in_pieces(self, parts: list[bytes | memoryview]) -> None:
        """Copy ``parts`` into the staging buffer, writing it out whenever it fills."""
        staging, cap = self.array, len(self.view)
        for p in parts:
            p = memoryview(p).cast("B")
            while len(p):
                n = min(len(p), cap - self.fill)
                if n >= COPY_WITHOUT_GIL:
                    # numpy copies without the GIL; a memoryview copy holds it, and the event loop stalled
                    # behind the journal thread's copies (ms per MB under load)
                    np.copyto(staging[self.fill : self.fill + n], np.frombuffer(p, np.uint8, n))
                else:
                    self.view[self.fill : self.fill + n] = p[:n]
                self.fill += n
                p = p[n:]
                if self.fill == cap:
                    self._flush(whole_only=True)

    def _flush(self, whole_only: bool) -> None:
        """Write the staged blocks; the partial last block is padded with zeros and written too unless
        ``whole_only``; either way it stays staged at the buffer's start."""
        view, fill = self.view, self.fill
        whole = fill // self.BLOCK * self.BLOCK
        end = whole if whole_only else -(-fill // self.BLOCK) * self.BLOCK
        view[fill:end] = bytes(end - fill)
        done = 0
        while done < end:
            done += os.pwrite(self.fd, view[done:end], self.base + done)
        view[: fill - whole] = view[whole:fill]
        self.base += whole
        self.fill = fill - whole

    def close(self) -> None:
        if os.fstat(self.fd).st_size <= -(-self.size // self.BLOCK) * self.BLOCK:
            os.ftruncate(self.fd, self.size)  # drop the zero padding
        # else a spare written over (JournalFiles.spare_for): what it held before stays after the records,
        # unread (its checksums do not match this file's mask); truncating would free the blocks
        os.close(self.fd)
        self.view.release()
        self.array = None  # the last reference: the memory goes with it


def _gather() -> Callable[[object, int, list], int | None] | None:
    return native_codec.function("gather")


def open_writer(path: Path, size: int, direct: bool) -> BufferedWriter | DirectWriter:
    if direct:
        try:
            return DirectWriter(path, size)
        except OSError as exc:  # e.g. tmpfs refuses O_DIRECT
            log.info("journal %s: O_DIRECT unavailable (%s); writing through the page cache", path, exc)
    return BufferedWriter(path, size)


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        rest = []
        for v in views:
            if n >= len(v):
                n -= len(v)
            else:
                rest.append(v[n:])
                n = 0
        views = [v for v in rest if len(v)]
