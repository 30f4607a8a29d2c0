"""Buffers for O_DIRECT I/O (broker/direct_memory.py): aligned as direct I/O requires, huge-page aligned
when large, and usable for a direct write and read of the same bytes."""

import os

import numpy as np
import pytest

from tidal.broker.direct_memory import BLOCK, HUGE_MIN, HUGE_PAGE, direct_buffer


@pytest.mark.parametrize("nbytes", [1, BLOCK, 5000, HUGE_MIN - 1, HUGE_MIN, 3 * HUGE_PAGE + 12345])
def test_buffers_have_the_size_asked_and_the_alignment_direct_io_needs(nbytes):
    buf = direct_buffer(nbytes)
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable
    alignment = HUGE_PAGE if nbytes >= HUGE_MIN else BLOCK
    assert buf.ctypes.data % alignment == 0
    buf[:] = 7  # the whole range is ours
    assert int(buf.sum()) == 7 * nbytes


def test_a_direct_write_and_read_through_huge_page_buffers_keep_the_bytes(tmp_path):
    path = tmp_path / "direct.bin"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:  # e.g. tmpfs
        pytest.skip(f"the file system under {tmp_path} refuses O_DIRECT ({exc})")
    try:
        out = direct_buffer(2 * HUGE_PAGE)
        out[:] = np.random.default_rng(0).integers(0, 256, out.size, dtype=np.uint8)
        assert os.pwrite(fd, memoryview(out), 0) == out.size
        back = direct_buffer(2 * HUGE_PAGE)
        assert os.preadv(fd, [memoryview(back)], 0) == back.size
        assert np.array_equal(out, back)
    finally:
        os.close(fd)
