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
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
