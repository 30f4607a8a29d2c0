"""One broker per journal: an exclusive lock on ``journal.lock`` in the journal's directory, held for the
broker process's life.

Two brokers appending to one log (one started by hand beside ``tidal run``'s, or a restart while the old
process still lives) would interleave their records and acknowledge groups the other overwrites. The lock is
``flock``: the kernel drops it when its holder dies, ``kill -9`` included, so a restart never finds a stale
lock. The file says who holds it, for the refusal's message and ``tidal journal``.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from tidal.errors import ConfigError

LOCK_NAME = "journal.lock"


def lock_journal_dir(directory: Path, serving: str) -> int:
    """Take the lock for this process (``serving``: the broker's address, for the holder's description);
    returns its descriptor, which must stay open. ConfigError when another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(
            f"broker.journal.dir={str(directory)!r} is in use by another broker ({holder}): two brokers "
            "appending to one journal would corrupt it. Stop that broker first, or give this one another "
            "broker.journal.dir (or run_dir)"
        ) from None
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"pid {os.getpid()} on {socket.gethostname()}, serving {serving}, since {since}\n".encode(), 0
    )
    return fd


def journal_holder(directory: Path) -> str | None:
    """Who holds the journal's lock now (a running broker), or None; takes no lock that outlives the call."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said who it is"
