"""Append-only, checksummed log of what the broker must not forget.

File ``<dir>/journal.log``: a sequence of records ``kind u8 | length u32 LE | crc32 u32 LE | payload``,
the CRC (zlib's CRC-32) covering the kind byte and the payload. The first record is ``FORMAT`` (payload: the
format number in ASCII); a log of another format is refused, naming what to do. On open, records are read until the first one that is
torn or fails its checksum (a crash mid-write); the file is truncated there. Compaction writes the live
state to ``journal.log.tmp``, fsyncs it and renames it over the log, so a crash leaves one whole file.

Compaction copies no group frame (format 3): the new file's ``REF`` records name where each live group's
record lies in an earlier file, which is kept under ``journal.<file id>.log`` (a hard link made before the
rename) for as long as some compaction still refers to it; files no longer referred to are deleted after
each compaction and on open. Copying the live groups stalled every append behind hundreds of MB of
writes at 8K-32K-token samples (docs/BENCHMARKS.md, session 11).

Appends use O_DIRECT where the file system allows it (``broker.journal.direct_io``), so a record is on
the device when ``append`` returns; otherwise they go through the page cache.

fsync policy: ``always`` fsyncs after every record (a record survives power loss before it is
acknowledged); ``interval`` fsyncs at most every ``fsync_interval_s`` from a background thread (a record
survives a crash of the broker process as soon as ``append`` returns; power loss may take the last
interval); ``never`` leaves it to the OS.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.broker.journal_files import JournalFiles, fsync_path
from tidal.broker.journal_packing import Pieces
from tidal.broker.journal_records import (
    FIRST_FORMAT,
    FORMAT_RECORD_BYTES,
    FORMAT_VERSION,
    GROUP_KINDS,
    READABLE_FORMATS,
    RECORD_HEADER,
    JournalCorrupt,
    JournalFormatError,
    Kind,
    file_mask,
    format_payload,
    group_frame,
    new_file_id,
    parse_format,
    parse_ref,
    read_records_at,
    read_referred,
    record_parts,
    segment_path,
)
from tidal.broker.journal_writers import BufferedWriter, DirectWriter, open_writer

if TYPE_CHECKING:
    from tidal.broker.config import JournalConfig

log = logging.getLogger(__name__)

_PR_SET_NAME = 15  # prctl option (linux/prctl.h)
# The writer thread reports records durable every this many bytes of a pass (see _write_pass).
DURABLE_SLICE = 8 << 20


class Journal:
    """The log. Inline mode (default): ``append`` writes before it returns. Deferred mode: ``append`` only
    stages the record, ``commit`` writes all staged records in one go (the broker commits once per batch
    of requests it handles, then sends the replies that waited for them: group commit without a thread).
    Background mode: ``append`` queues the record and ``commit`` hands the queue to a writer thread, which
    writes everything queued in one go and reports the highest durable sequence number through
    ``on_durable`` (called from that thread), so the event loop does not wait for large writes; as that
    costs two thread wake-ups per commit, a commit of at most ``inline_bytes`` is written by the
    committing thread itself while the writer thread is idle."""

    @classmethod
    def from_config(cls, directory: str | Path, jc: JournalConfig) -> Journal:
        """The journal as ``broker.journal`` configures it (``writer``: 'thread' = background, 'loop' =
        deferred)."""
        return cls(
            directory,
            fsync=jc.fsync,
            fsync_interval_s=jc.fsync_interval_s,
            direct_io=jc.direct_io,
            background=jc.writer == "thread",
            deferred=jc.writer == "loop",
            inline_bytes=jc.inline_bytes,
            spare_files=jc.spare_files,
        )

    def __init__(
        self,
        directory: str | Path,
        *,
        fsync: str = "interval",
        fsync_interval_s: float = 0.05,
        direct_io: bool = True,
        background: bool = False,
        deferred: bool = False,
        inline_bytes: int = 0,
        spare_files: int = 2,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "journal.log"
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.direct_io = direct_io
        self.background = background
        self.deferred = deferred and not background
        # Background mode: a commit whose records come to at most this many bytes is written by the
        # committing thread (the event loop) at once, without the writer thread (see commit).
        self.inline_bytes = inline_bytes
        self.on_durable: Callable[[int], None] | None = None
        self.appended_seq = 0  # records appended (staged or written)
        self.durable_seq = 0  # records written (and fsynced under fsync=always)
        self._writer: BufferedWriter | DirectWriter | None = None
        # Deferred mode: records staged for the next commit: (kind, payload, crc or None).
        self._staged: list[tuple[Kind | None, Any, int | None]] = []
        # Background mode: records for the writer thread, and compactions (None, records) in their place
        # among them. Appended by the event loop and taken by the writer without a lock (deque appends
        # and pops are atomic); the writer is woken only when it waits (``_idle``), so that an append
        # costs no lock and no wake-up while the writer is busy.
        self._queue: deque[tuple[Kind | None, Any, int | None]] = deque()
        self._idle = False
        self.writer_wakeups = 0  # times the writer thread woke from its wait (a pass or a stop among them)
        self._pass = threading.Lock()  # held while queued records are taken and written
        self._dirty = False
        self._lock = threading.Condition()  # the writer thread's sleep and wake-ups
        # flush() waits on this one, over the same lock: a pass the loop writes itself must not wake the
        # writer thread (a wake-up and a GIL hand-off for every commit, ~2 CPU-us a 1K sample)
        self._written = threading.Condition(self._lock)
        self._io = threading.Lock()  # held while the writer is in use or replaced
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.truncated_bytes = 0
        self.compacting = False  # a compaction is staged and not yet in place
        # Where appended records land, as the appender sees it (records staged for the writer included):
        # the id of the file they go to, its size once they are written, and the last payload's offset.
        self.file_id: str | None = None
        self._writing_id: str | None = None  # the file the writer writes (file_id runs ahead in compaction)
        self._mask = 0  # that file's checksum mask (file_mask)
        self._files = JournalFiles(self.dir, self.path, spare_files, overwrites=direct_io)
        # The format of the file appends go to: an older file is finished as it was written, taking no
        # record kind of a later format (FIRST_FORMAT), and the next compaction starts a current one.
        self.file_format = FORMAT_VERSION
        self.replayed_locs: list[tuple[str, int, int] | None] = []
        self._tail = 0
        self.last_offset = 0

    @property
    def direct(self) -> bool:
        """Whether appends go to the device with O_DIRECT (False: through the page cache)."""
        return bool(self._writer and self._writer.direct)

    @property
    def bytes_written(self) -> int:
        return self._writer.size if self._writer else 0

    def disk(self) -> dict[str, int]:
        """What the journal holds on disk: earlier files kept for their live groups, spares, and the bytes
        of every file in its directory (spares keep what they held before)."""
        return self._files.disk()

    @property
    def spares_used(self) -> int:
        """Compactions that wrote over a spare file."""
        return self._files.spares_used

    def open(self) -> list[tuple[Kind, memoryview]]:
        """Read the existing log (truncating a torn tail) and open it for appending. REF records come back
        as the RESTORE records of the groups they name and PACKED ones as GROUP records, each with its
        frame; ``replayed_locs`` says where each group's record payload lies ((file id, offset, length),
        parallel to the records returned)."""
        records: list[tuple[Kind, memoryview, int]] = []
        good = 0
        if self.path.exists():
            data = memoryview(self.path.read_bytes())
            records, good = read_records_at(data)
            if records and records[0][0] is Kind.FORMAT:
                self.file_id = parse_format(records[0][1])[1]
            records = self._check_format(records)
            if good < len(data):
                if any(data[good:]):  # zero padding after the last record is normal (direct I/O)
                    self.truncated_bytes = len(data) - good
                    log.warning(
                        "journal %s: dropping %d bytes after the last of %d intact records (a write torn by "
                        "a crash, or what a reused file held before)",
                        self.path,
                        self.truncated_bytes,
                        len(records),
                    )
                with open(self.path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
        out, self.replayed_locs = self._resolve(records)
        leftover = self.path.with_suffix(".log.tmp")  # a compaction a crash cut short
        if leftover.exists() and not self._files.keep_spare(leftover):
            leftover.unlink()
        self._files.forget({loc[0] for loc in self.replayed_locs if loc is not None})
        self._open_writer(good)
        if good == 0:
            self.file_id = new_file_id()
            self._writer.write(record_parts(Kind.FORMAT, format_payload(self.file_id)))
            self._mask = file_mask(str(FORMAT_VERSION), self.file_id)
            self.file_format = FORMAT_VERSION
        self._writing_id = self.file_id
        self._tail = self._writer.size
        if self.fsync == "interval":
            self._start(self._sync_loop, "journal-fsync")
        if self.background:
            self._start(self._write_loop, "journal-writer")
        return out

    def _resolve(
        self, records: list[tuple[Kind, memoryview, int]]
    ) -> tuple[list[tuple[Kind, memoryview]], list[tuple[str, int, int] | None]]:
        refs = [parse_ref(payload) for kind, payload, _ in records if kind is Kind.REF]
        referred = iter(read_referred(self.dir, refs))
        kept = iter(refs)
        out: list[tuple[Kind, memoryview]] = []
        locs: list[tuple[str, int, int] | None] = []
        for kind, payload, offset in records:
            if kind is Kind.REF:
                out.append((Kind.RESTORE, next(referred)))
                locs.append(next(kept))
                continue
            if kind is Kind.PACKED:
                try:
                    out.append((Kind.GROUP, group_frame(kind, payload)))
                except ValueError as exc:  # its checksum held: written wrong, not torn
                    raise JournalCorrupt(f"journal {self.path}: packed group at {offset}: {exc}") from None
            else:
                out.append((kind, payload))
            held = kind in GROUP_KINDS and self.file_id is not None
            locs.append((self.file_id, offset, len(payload)) if held else None)
        return out, locs

    def _open_writer(self, size: int) -> None:
        self._writer = open_writer(self.path, size, self.direct_io)
        self._files.overwrites = self._writer.direct  # page-cache appends go to a file's end: no spares

    def _check_format(
        self, records: list[tuple[Kind, memoryview, int]]
    ) -> list[tuple[Kind, memoryview, int]]:
        if not records:
            return records
        kind, payload, _ = records[0]
        found = parse_format(payload)[0] if kind is Kind.FORMAT else "1"
        self._mask = file_mask(found, self.file_id)
        if found not in READABLE_FORMATS:
            raise JournalFormatError(
                f"journal {self.path} is in format {found}, this broker reads formats {', '.join(READABLE_FORMATS)} "
                "(its group frames changed layout): finish that run with the tidal version that wrote it, "
                "or move the journal directory away to start afresh"
            )
        self.file_format = int(found)
        return records[1:]

    def takes(self, kind: Kind) -> bool:
        """Whether the file appends go to takes records of ``kind`` (a file of an older format takes
        none of a kind a later format added)."""
        return self.file_format >= FIRST_FORMAT.get(kind, 0)

    def _start(self, target: Callable[[], None], name: str) -> None:
        def run() -> None:
            _name_os_thread(name)
            target()

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def append(self, kind: Kind, payload: bytes | memoryview | Pieces, crc: int | None = None) -> int:
        """Append a record; returns its sequence number (durable once ``durable_seq`` reaches it). Its
        payload will lie at ``last_offset`` of the file ``file_id``. ``crc``: the record's checksum where
        the caller has it (``record_crc``), else computed when written. A record of a kind a later format
        added goes only to a file that ``takes`` it."""
        if kind in FIRST_FORMAT and not self.takes(kind):
            raise ValueError(
                f"journal {self.path} is a format-{self.file_format} file: it takes no {kind.name} records"
            )
        self.last_offset = self._tail + RECORD_HEADER.size
        self._tail = self.last_offset + len(payload)
        if self.background:  # written at the next commit(), by the writer thread or inline
            self._queue.append((kind, payload, crc))
            self.appended_seq += 1
            return self.appended_seq
        if self.deferred:  # written by the next commit()
            self._staged.append((kind, payload, crc))
            self.appended_seq += 1
            return self.appended_seq
        with self._io:
            self._write(record_parts(kind, payload, crc, self._mask))
        self.appended_seq += 1
        self.durable_seq = self.appended_seq
        return self.appended_seq

    def commit(self) -> None:
        """Write everything appended since the last commit, in one go (group commit). Deferred mode: here
        and now. Background mode: small commits (``inline_bytes``) here and now too, where the writer
        thread is not busy; the others by the writer thread, which this wakes (it reports through
        ``on_durable``). A thread wake-up and the event loop's wake-up for the report cost more than
        writing a few small records (at 1K-token samples the writer thread's share of the broker's CPU
        was mostly that); large writes stay off the loop, which keeps serving meanwhile."""
        if self.background:
            # A snapshot: the writer thread may take records meanwhile, and iterating the deque itself
            # while it does raises ("deque mutated during iteration"); tuple() copies it without yielding.
            queue = tuple(self._queue)
            if not queue:
                return
            if (
                not self.compacting
                and sum(len(payload) for _, payload, _ in queue) <= self.inline_bytes
                and self._pass.acquire(blocking=False)
            ):
                try:
                    self._write_pass()
                finally:
                    self._pass.release()
            elif self._idle:
                self._wake()
            return
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        parts: list[bytes | memoryview] = []
        for kind, payload, crc in staged:
            parts += record_parts(kind, payload, crc, self._mask)
        with self._io:
            self._write(parts)
        self.durable_seq = self.appended_seq

    def _write(self, parts: list[bytes | memoryview]) -> None:
        self._writer.write(parts)
        if self.fsync == "always":
            os.fdatasync(self._writer.fd)
        else:
            self._dirty = True

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                # Idle is said before the queue is looked at: an append either lands before the look
                # (and is seen) or sees _idle and wakes this thread.
                self._idle = True
                while not self._queue and not self._stop.is_set():
                    self._lock.wait()
                    self.writer_wakeups += 1
                self._idle = False
            if not self._queue:
                # stopping; or a commit on the event loop wrote what woke this thread since it looked
                # (it returned here too, and larger commits then waited for a writer that was gone)
                if self._stop.is_set():
                    return
                continue
            with self._pass:
                seq = self._write_pass(report=True)
            if seq is not None and self.on_durable is not None:
                self.on_durable(seq)

    def _write_pass(self, report: bool = False) -> int | None:
        """Take every queued record (and compaction) and write them in order; returns the durable
        sequence number after them (None when another pass took them first). Holding ``_pass``. With
        ``report`` (the writer thread), durability is reported every ``DURABLE_SLICE`` bytes written, so
        replies waiting on the first records of a long pass need not wait for its last ones."""
        staged = [self._queue.popleft() for _ in range(len(self._queue))]
        if not staged:
            return None
        done = self.durable_seq
        parts: list[bytes | memoryview] = []
        records = nbytes = 0
        try:
            for kind, payload, crc in staged:
                if kind is None:  # a compaction, in its place among the appends (see compact)
                    if parts:
                        with self._io:
                            self._write(parts)
                        done += records
                        parts, records, nbytes = [], 0, 0
                    self._replace(payload)
                    continue
                parts += record_parts(kind, payload, crc, self._mask)
                records += 1
                nbytes += len(payload)
                if report and nbytes >= DURABLE_SLICE:
                    with self._io:
                        self._write(parts)
                    done += records
                    parts, records, nbytes = [], 0, 0
                    self._durable(done, report)
            if parts:
                with self._io:
                    self._write(parts)
                done += records
        except Exception:
            # Nothing may be acknowledged unjournaled: stop the broker; a restart replays the log.
            log.critical("journal %s: write failed; stopping the broker", self.path, exc_info=True)
            os._exit(70)
        self._durable(done, report=False)  # the caller reports the end of the pass
        return done

    def _durable(self, seq: int, report: bool) -> None:
        with self._lock:
            self.durable_seq = seq
            self._written.notify_all()
        if report and self.on_durable is not None:
            self.on_durable(seq)

    def flush(self) -> None:
        """Wait until every appended record is written."""
        self.commit()
        with self._lock:
            while self.durable_seq < self.appended_seq:
                self._written.wait()

    def compact(self, records: Iterable[tuple[Kind, bytes | memoryview]]) -> list[int]:
        """Replace the log by ``records`` (the live state now); returns where each record's payload lies in
        the new file (``file_id`` names it from now on). In background mode the writer thread does it
        in order with the appends: records appended before this call go to the old log first, later ones
        to the new log after the records, so the event loop does not wait for the copy; ``compacting``
        stays true until the new log is in place."""
        records = list(records)
        if not self.background:
            return self.rewrite(records)
        file_id, offsets = self._plan(records)
        self.compacting = True
        self._queue.append((None, (file_id, records), None))
        self._wake()
        return offsets

    def rewrite(self, records: Iterable[tuple[Kind, bytes | memoryview]]) -> list[int]:
        """Compaction, waiting for it: replace the log by ``records`` atomically."""
        records = list(records)
        self.flush()
        file_id, offsets = self._plan(records)
        self._replace((file_id, records))
        return offsets

    def _plan(self, records: list[tuple[Kind, bytes | memoryview]]) -> tuple[str, list[int]]:
        """A new file for ``records``: its id, and where their payloads will lie in it."""
        file_id, offsets = new_file_id(), []
        self._tail = FORMAT_RECORD_BYTES
        for _, payload in records:
            offsets.append(self._tail + RECORD_HEADER.size)
            self._tail += RECORD_HEADER.size + len(payload)
        self.file_id = file_id
        self.file_format = FORMAT_VERSION  # appends from here on go to the new file
        return file_id, offsets

    def _replace(self, compaction: tuple[str, Iterable[tuple[Kind, bytes | memoryview]]]) -> None:
        file_id, records = compaction
        records = list(records)
        referred = {parse_ref(payload)[0] for kind, payload in records if kind is Kind.REF}
        tmp = self.path.with_suffix(".log.tmp")
        tmp.unlink(missing_ok=True)
        self._files.spare_for(tmp)  # before the file being replaced may become a spare itself
        # The file being replaced keeps a name of its own: the live groups in it stay there (whole on
        # disk); if none, JournalFiles.forget below keeps it as a spare or deletes it a slice at a time
        # (the rename would free its blocks at once, on this thread).
        with self._io:
            if self._writing_id in referred:
                os.fsync(self._writer.fd)
            kept = segment_path(self.dir, self._writing_id)
            if not kept.exists():
                os.link(self.path, kept)
        # The same writer as appends (O_DIRECT where allowed): the live groups may be hundreds of MB, and
        # page-cache writes were several times slower here.
        writer = open_writer(tmp, 0, self.direct_io)
        try:
            writer.write(record_parts(Kind.FORMAT, format_payload(file_id)))
            mask = file_mask(str(FORMAT_VERSION), file_id)
            writer.write(
                [part for kind, payload in records for part in record_parts(kind, payload, mask=mask)]
            )
        finally:
            size = writer.size
            writer.close()
        fsync_path(tmp)
        with self._io:
            os.replace(tmp, self.path)
            fsync_path(self.dir)
            self._writer.close()
            self._open_writer(size)
            self._writing_id = file_id
            self._mask = mask
            self._dirty = False
        unlinking = self._files.forget(referred, wait=False)
        if unlinking is not None:
            self._threads.append(unlinking)  # close() waits for it
        self.compacting = False

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self.sync()

    def sync(self) -> None:
        # fsync a duplicate descriptor outside the lock, so writes never wait for the disk flush.
        with self._io:
            if not self._dirty or self._writer is None:
                return
            self._dirty = False
            fd = os.dup(self._writer.fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._writer is None:
            return
        self.flush()
        with self._lock:
            self._stop.set()
            self._lock.notify_all()
        for t in self._threads:
            t.join()
        with self._io:
            os.fsync(self._writer.fd)
            self._writer.close()
            self._writer = None


def _name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (``top -H``, /proc/<pid>/task/*/comm), so that the benchmark
    and a profiler tell the journal's threads from the event loop; a no-op where prctl is missing."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
