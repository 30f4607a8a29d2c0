"""A batch's group frames read straight from the broker's journal, by a client on the broker's host.

Every group frame the broker accepts is in its journal before any batch holding it is sent. A client on
the same host (same kernel boot id) asks for a batch with its ``host`` id, and the broker answers with
where the frames lie (journal path, file id, ``[offset, length]`` of each record's payload) instead of the
frames: they then cross loopback once (producer -> broker), as raw pyzmq's do, not twice. The reader
opens the file, checks its FORMAT record names the same file id (a compaction writes a new file under
the same path; an open descriptor keeps reading the file it opened), and reads neighbouring records in
one O_DIRECT read each into fresh memory (the device writes it; the CPU copies nothing), checking each
record's header and CRC (a PACKED record is expanded back to its frame). Anything unexpected raises
:class:`JournalUnavailable`; the client then asks for the same batch with its frames on the wire.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from tidal.broker.direct_memory import direct_buffer
from tidal.broker.journal_records import (
    RECORD_HEADER,
    Kind,
    head_mask,
    intact_group_frame,
    parse_format,
)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
BLOCK = 4096
# Records closer than this are read together (one read of the gap costs less than another read).
MERGE_GAP = 256 << 10
# Read memory kept for reuse per client: two batches (the one trained on, the next) of 32 groups of
# 8 samples of 32K tokens take ~200 MiB.
KEEP_BYTES = 512 << 20


def host_id() -> str | None:
    """This host's identity as the kernel gives it (the boot id); None where there is none."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


class ReadMemory:
    """Page-aligned memory for reads, reused once nothing refers to it any more (the batch decoded from it
    and every array view of it are gone): fresh memory costs a page fault and a zeroed page per 4 KiB,
    which cost more than the reads themselves. At most ``max_bytes`` are kept."""

    def __init__(self, max_bytes: int = KEEP_BYTES):
        self.max_bytes = max_bytes
        self.bases: list[np.ndarray] = []

    def take(self, nbytes: int) -> memoryview:
        nbytes = max(nbytes, BLOCK)
        free = [i for i in range(len(self.bases)) if sys.getrefcount(self.bases[i]) == 2]  # list + arg
        fits = [i for i in free if len(self.bases[i]) >= nbytes + BLOCK]
        if fits:
            base = self.bases[min(fits, key=lambda i: len(self.bases[i]))]
        else:
            step = max(BLOCK, 1 << max(0, nbytes.bit_length() - 4))  # sizes vary a little: round up by 1/16
            base = direct_buffer(-(-nbytes // step) * step + BLOCK)  # huge pages: cheaper to pin
            held, drop = sum(map(len, self.bases)), set()
            for i in sorted(free, key=lambda i: len(self.bases[i]), reverse=True):
                if held + len(base) <= self.max_bytes:
                    break
                drop.add(i)  # make room: drop free ones, largest first
                held -= len(self.bases[i])
            self.bases = [b for i, b in enumerate(self.bases) if i not in drop]
            if held + len(base) <= self.max_bytes:
                self.bases.append(base)
        start = -base.ctypes.data % BLOCK
        return memoryview(base)[start : start + nbytes]


class JournalUnavailable(Exception):
    """The journal could not be read as the broker described it; ask for the frames on the wire."""


class JournalReader:
    def __init__(self) -> None:
        self._path: str | None = None
        self._fd = -1
        self._direct = False
        self._file_id: str | None = None
        self._mask = 0  # the file's checksum mask (journal.file_mask)
        self._wants_direct = True
        self._memory = ReadMemory()

    def read(self, path: str, file_id: str, refs: list[list[int]], direct: bool = True) -> list[memoryview]:
        """The payloads at ``refs`` ([offset, length] each) of the journal file ``file_id`` at ``path``,
        as read-only views (in the order of ``refs``); ``direct``: with O_DIRECT where allowed (a journal
        written through the page cache is read through it)."""
        try:
            if path != self._path or file_id != self._file_id or direct != self._wants_direct:
                self._open(path, file_id, direct)
            return self._read(refs)
        except OSError as exc:
            raise JournalUnavailable(f"reading the journal {path}: {exc}") from None

    def _open(self, path: str, file_id: str, direct: bool = True) -> None:
        self.close()
        try:
            if not direct:
                raise OSError("the broker writes this journal through the page cache")
            self._fd, self._direct = os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:  # e.g. tmpfs refuses O_DIRECT
            self._fd, self._direct = os.open(path, os.O_RDONLY), False
        self._path, self._wants_direct = path, direct
        head = self._pread_spans([(0, BLOCK)])[0]
        kind, length, _ = RECORD_HEADER.unpack_from(head, 0)
        found = None
        if kind == Kind.FORMAT and RECORD_HEADER.size + length <= len(head):
            found = parse_format(head[RECORD_HEADER.size : RECORD_HEADER.size + length])[1]
        if found != file_id:
            self.close()  # replaced by a compaction since the broker answered
            raise JournalUnavailable(f"journal {path} is file {found}, not {file_id}")
        self._file_id = file_id
        self._mask = head_mask(head)

    def _read(self, refs: list[list[int]]) -> list[memoryview]:
        order = sorted(range(len(refs)), key=lambda i: refs[i][0])
        spans: list[list[int]] = []  # [start, end) in the file, each covering records in `order`
        for i in order:
            start, end = refs[i][0] - RECORD_HEADER.size, refs[i][0] + refs[i][1]
            if spans and start - spans[-1][1] <= MERGE_GAP:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        aligned = [(s // BLOCK * BLOCK, -(-e // BLOCK) * BLOCK) for s, e in spans]
        bufs = self._pread_spans(aligned)
        out: list[memoryview | None] = [None] * len(refs)
        span = 0
        for i in order:
            offset, length = refs[i]
            while offset + length > aligned[span][1]:
                span += 1
            buf, base = bufs[span], aligned[span][0]
            at = offset - RECORD_HEADER.size - base
            payload = buf[at + RECORD_HEADER.size : at + RECORD_HEADER.size + length]
            frame = intact_group_frame(RECORD_HEADER.unpack_from(buf, at), payload, length, self._mask)
            if frame is None:
                raise JournalUnavailable(
                    f"journal {self._path}: no group record of {length} bytes at {offset}"
                )
            out[i] = frame.toreadonly()
        return out

    def _pread_spans(self, spans: list[tuple[int, int]]) -> list[memoryview]:
        """Read each [start, end) into page-aligned memory (what O_DIRECT needs), whole."""
        memory = self._memory.take(sum(e - s for s, e in spans))
        views, at = [], 0
        for start, end in spans:
            view = memory[at : at + end - start]
            done = 0
            while done < len(view):
                n = os.preadv(self._fd, [view[done:]], start + done)
                if n <= 0:
                    break  # end of file: a span's last block may run past it
                done += n
            views.append(view[:done])
            at += end - start
        return views

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._path, self._file_id = -1, None, None
