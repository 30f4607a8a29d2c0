"""The journal directory's files other than the log: earlier logs kept under ``journal.<file id>.log`` for
the live groups that a compaction's REF records name, and spare files (``spare.<id>``) that compactions
write over instead of allocating new blocks. ``Journal`` decides when; this module knows the files."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from tidal.broker.journal_records import new_file_id

# Files compaction no longer refers to are deleted this many bytes at a time, pausing between slices
# (at most 4 GB/s: more than the device writes, so deletion keeps up with any run).
DELETE_SLICE = 8 << 20
DELETE_PAUSE_S = 0.002


class JournalFiles:
    """The kept and spare files of the journal directory ``directory`` whose log is ``log_path``.
    ``overwrites``: whether the journal's writer writes a file from its start (O_DIRECT); only then are
    spares kept (page-cache appends go to a file's end)."""

    def __init__(self, directory: Path, log_path: Path, spare_files: int, overwrites: bool):
        self.dir = directory
        self.log_path = log_path
        self.spare_files = spare_files
        self.overwrites = overwrites
        self.spares_used = 0  # compactions that wrote over a spare file

    def disk(self) -> dict[str, int]:
        """Earlier files kept for their live groups, spares, and the bytes of every file in the directory
        (spares keep what they held before)."""
        kept, spares = list(self.dir.glob("journal.*.log")), list(self.dir.glob("spare.*"))
        total = 0
        for path in (self.log_path, *kept, *spares):
            with contextlib.suppress(OSError):  # deleted or renamed meanwhile by a compaction
                total += path.stat().st_size
        return {
            "files_kept": len(kept),
            "spare_files": len(spares),
            "spares_used": self.spares_used,
            "dir_bytes": total,
        }

    def forget(self, keep: set[str], wait: bool = True) -> threading.Thread | None:
        """Let go of the earlier files whose ids are not in ``keep`` (no record of the log refers to them):
        up to ``spare_files`` are kept as spares (see ``spare_for``); the rest are deleted. Without
        ``wait`` (behind a compaction) a thread of its own deletes, a slice at a time (see
        ``DELETE_SLICE``), so that appends do not wait behind it; that thread is returned."""
        doomed = []
        for path in self.dir.glob("journal.*.log"):
            if path.name.split(".")[1] not in keep and not self.keep_spare(path):
                doomed.append(path)
        doomed += sorted(self.dir.glob("spare.*"))[self._spare_limit() :]
        if not doomed:
            return None

        def unlink() -> None:
            for path in doomed:
                delete_in_slices(path, DELETE_SLICE if not wait else 0)

        if wait:
            unlink()
            return None
        t = threading.Thread(target=unlink, name="journal-unlink", daemon=True)
        t.start()
        return t

    def _spare_limit(self) -> int:
        return self.spare_files if self.overwrites else 0

    def keep_spare(self, path: Path) -> bool:
        """Keep ``path`` (a file nothing refers to) as a spare, if there is room for one more."""
        if len(list(self.dir.glob("spare.*"))) >= self._spare_limit():
            return False
        os.rename(path, self.dir / f"spare.{new_file_id()}")
        return True

    def spare_for(self, path: Path) -> None:
        """Put a spare file at ``path`` (to be written over from its start), if there is one: writing over
        a file's blocks ran ~30% faster here than appending new ones (an append allocates blocks and
        grows the file: a metadata update per write), and deleting it would trim its blocks (discard)."""
        if not self._spare_limit():
            return
        # never a file that is still the log or one it refers to (links left by a crash mid-compaction)
        used = {_inode(p) for p in (self.log_path, *self.dir.glob("journal.*.log"))}
        for spare in sorted(self.dir.glob("spare.*")):
            if _inode(spare) in used:
                spare.unlink(missing_ok=True)  # only a second name of a file in use
                continue
            os.rename(spare, path)
            self.spares_used += 1
            return


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def delete_in_slices(path: Path, step: int) -> None:
    """Truncate ``path`` by ``step`` bytes at a time, pausing between slices, then unlink it (step 0: at
    once). A file system mounted with ``discard`` trims freed blocks as they are freed: unlinking a file of
    hundreds of MB in one go took 120-140 ms here, and the appends behind it stalled 50-90 ms."""
    if step:
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            while size > step:
                size -= step
                os.ftruncate(fd, size)
                time.sleep(DELETE_PAUSE_S)
        finally:
            os.close(fd)
    path.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
