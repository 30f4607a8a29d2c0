"""Append-only, checksummed log of what the broker must not forget.

File ``<dir>/journal.log``: a sequence of records ``kind u8 | length u32 LE | crc32 u32 LE | payload``,
the CRC covering the kind byte and the payload. On open, records are read until the first one that is
torn or fails its checksum (a crash mid-write); the file is truncated there. Compaction writes the live
state to ``journal.log.tmp``, fsyncs it and renames it over the log, so a crash leaves one whole file.

fsync policy: ``always`` fsyncs after every record (a record survives power loss before it is
acknowledged); ``interval`` fsyncs at most every ``fsync_interval_s`` from a background thread (a record
survives a crash of the broker process as soon as ``append`` returns; power loss may take the last
interval); ``never`` leaves it to the OS.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<BII")


class Kind(IntEnum):
    GROUP = 1  # an accepted group: payload is the group frame as it came
    TAKE = 2  # prompts taken from the source, and the cursor after it
    DROP = 3  # a group resolved without training: filtered (never accepted) or stale (accepted, dropped)
    BATCH = 4  # a cut batch: id, group ids, policy version
    CONSUMED = 5  # the trainer trained through this batch durably
    VERSION = 6  # the trainer's policy version
    SNAPSHOT = 7  # compacted state; followed by RESTORE records of the groups it still needs
    RESTORE = 8  # a group frame kept by compaction (bookkeeping lives in the SNAPSHOT)


def _crc(kind: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(bytes((kind,))))


def read_records(data: memoryview) -> tuple[list[tuple[Kind, memoryview]], int]:
    """Parse ``data``; returns the good records (payloads are views into ``data``) and the good length."""
    out: list[tuple[Kind, memoryview]] = []
    pos = 0
    while pos + _HEADER.size <= len(data):
        kind, length, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if end > len(data) or kind not in Kind._value2member_map_:
            break
        payload = data[pos + _HEADER.size : end]
        if _crc(kind, payload) != crc:
            break
        out.append((Kind(kind), payload))
        pos = end
    return out, pos


class Journal:
    def __init__(self, directory: str | Path, *, fsync: str = "interval", fsync_interval_s: float = 0.05):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "journal.log"
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self._fd = -1
        self._dirty = False
        self._lock = threading.Lock()  # guards _fd against the fsync thread during compaction
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bytes_written = 0
        self.truncated_bytes = 0

    def open(self) -> list[tuple[Kind, memoryview]]:
        """Read the existing log (truncating a torn tail) and open it for appending."""
        records: list[tuple[Kind, memoryview]] = []
        if self.path.exists():
            data = memoryview(self.path.read_bytes())
            records, good = read_records(data)
            if good < len(data):
                self.truncated_bytes = len(data) - good
                log.warning(
                    "journal %s: dropping %d bytes of torn or corrupt tail after %d records",
                    self.path,
                    self.truncated_bytes,
                    len(records),
                )
                with open(self.path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.bytes_written = os.fstat(self._fd).st_size
        if self.fsync == "interval":
            self._thread = threading.Thread(target=self._sync_loop, name="journal-fsync", daemon=True)
            self._thread.start()
        return records

    def append(self, kind: Kind, payload: bytes | memoryview) -> None:
        header = _HEADER.pack(kind, len(payload), _crc(kind, payload))
        with self._lock:
            _write_all(self._fd, [header, payload])
            self.bytes_written += len(header) + len(payload)
            if self.fsync == "always":
                os.fsync(self._fd)
            else:
                self._dirty = True

    def rewrite(self, records: Iterable[tuple[Kind, bytes | memoryview]]) -> None:
        """Compaction: replace the log by ``records`` atomically."""
        tmp = self.path.with_suffix(".log.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        size = 0
        try:
            for kind, payload in records:
                _write_all(fd, [_HEADER.pack(kind, len(payload), _crc(kind, payload)), payload])
                size += _HEADER.size + len(payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._lock:
            os.replace(tmp, self.path)
            _fsync_dir(self.dir)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self.bytes_written = size
            self._dirty = False

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self.sync()

    def sync(self) -> None:
        # fsync a duplicate descriptor outside the lock, so appends never wait for the disk.
        with self._lock:
            if not self._dirty or self._fd < 0:
                return
            self._dirty = False
            fd = os.dup(self._fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
