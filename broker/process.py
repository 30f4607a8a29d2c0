"""Process-wide settings for the broker, which moves large buffers through a long-lived process.

- glibc's malloc gives freed blocks of more than ~128 KiB-32 MiB back to the kernel (munmap, heap trim)
  and faults fresh pages in for the next one: every group frame that ZeroMQ receives then costs a page
  fault per 4 KiB, which was the largest single cost of the broker's I/O thread at 32K-token samples.
  We keep freed memory for reuse instead (the resident size stays at its peak, which the staleness
  bound already limits).
- The garbage collector's full passes walk every long-lived object (buffered groups, leases); the
  broker makes few reference cycles, so collections run less often and start-up objects are frozen.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from pathlib import Path

from tidal.heap import freeze_start_up_heap

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit; larger blocks are always mmapped
_TRIM_THRESHOLD = 1 << 30
# A thread's arena (ZeroMQ's I/O thread allocates the frames) is a chain of 64 MiB heaps; glibc unmaps a
# heap that empties unless the padding to keep exceeds what is left: a pad of one heap keeps them all.
_TOP_PAD = 64 << 20

GC_THRESHOLDS = (50_000, 50, 1000)


def keep_freed_memory() -> bool:
    """Ask glibc to reuse freed blocks up to 32 MiB instead of returning them; False where not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("not glibc (%s): the allocator keeps its defaults", name)
        return False
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )


def tune_gc() -> None:
    """Freeze what start-up built (config, replayed state) and collect less often."""
    freeze_start_up_heap()
    gc.set_threshold(*GC_THRESHOLDS)


# The broker's heap on transparent huge pages (``broker.huge_page_heap_bytes``): glibc reads its tunables
# only when a process starts, so the broker starts itself again with them (same pid, see reexec_...).
HUGE_PAGE_TUNABLES = ("glibc.malloc.hugetlb=1", "glibc.malloc.arena_max=1")
_REEXEC_MARK = "TIDAL_BROKER_HUGE_PAGE_HEAP"


def huge_page_heap_active() -> bool:
    """Whether this process was started with the huge-page heap's tunables (by reexec_with_huge_page_heap)."""
    return os.environ.get(_REEXEC_MARK) == "1"


def reexec_with_huge_page_heap() -> None:
    """Replace this process (same pid, same command line) by one whose glibc heap is advised huge pages
    and is one arena for all threads, so that the frames ZeroMQ's I/O thread receives lie on huge pages
    that ``prefault_heap`` faulted in. Returns only where that is not possible (then nothing changes)."""
    if huge_page_heap_active():
        return
    try:
        argv = [a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError as exc:
        log.info("huge-page heap off: cannot read this process's command line (%s)", exc)
        return
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
    env = {**os.environ, "GLIBC_TUNABLES": ":".join([*tunables, *HUGE_PAGE_TUNABLES]), _REEXEC_MARK: "1"}
    logging.shutdown()  # nothing buffered is lost across the exec
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        log.warning("huge-page heap off: could not start again with glibc's tunables (%s)", exc)


def prefault_heap(nbytes: int) -> None:
    """Fault in ``nbytes`` of the heap and give it back to malloc, which keeps it (keep_freed_memory).
    With the huge-page tunables these are 2 MiB pages: faulting them at run time (zeroing and compacting
    for each) cost ZeroMQ's I/O thread 2-3x its CPU per received byte; here it is paid once at start
    (~0.6 s of CPU for 256 MiB, ~0.9 s for 640 MiB on the development VM)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk = 16 << 20  # below the raised mmap threshold: taken from the heap, and kept there when freed
    blocks = []
    for _ in range(-(-nbytes // chunk)):
        p = libc.malloc(chunk)
        if not p:
            break
        ctypes.memset(p, 0, chunk)
        blocks.append(p)
    for p in blocks:
        libc.free(p)
