"""Memory for O_DIRECT reads and writes (the journal's staging buffer, a local reader's batch buffers).

For every direct read or write the kernel pins each page of the user buffer; with 4 KiB pages that cost
as much CPU as the transfer itself here (12.5 us to write and 13.8 us to read the 393 KB of one 32K-token
sample), with 2 MiB transparent huge pages 1.7 and 1.6 us, and the device's throughput rose with it
(writes 3.1 -> 5.0 GB/s, reads 1.5 -> 4.5 GB/s; 8 MiB transfers on this VM). So buffers of at least
``HUGE_MIN`` bytes are placed at a huge-page boundary and advised ``MADV_HUGEPAGE`` (which works with the
kernel's usual ``madvise`` mode); where the kernel gives no huge pages they are ordinary aligned memory.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

BLOCK = 4096  # O_DIRECT's alignment of addresses, lengths and file offsets
HUGE_PAGE = 2 << 20
HUGE_MIN = 1 << 20  # smaller buffers take plain pages: a huge page would be mostly waste


def direct_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` starting at a ``BLOCK`` boundary (a huge-page boundary, with
    huge pages advised, from ``HUGE_MIN`` bytes up). The memory is freed with the last array viewing it."""
    if nbytes < HUGE_MIN:
        raw = np.empty(nbytes + BLOCK, np.uint8)
        start = -raw.ctypes.data % BLOCK
        return raw[start : start + nbytes]
    # Private anonymous memory (shared memory takes a slower path when O_DIRECT pins it), one huge page
    # larger than asked so that the array can start at a huge-page boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # kernels without transparent huge pages refuse the advice
            region.madvise(advice)
    raw = np.frombuffer(region, np.uint8)  # holds the mapping until the last view of it goes
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes]
