"""Copying group frames out of another process's memory, as a consumer on the broker's host does."""

import multiprocessing as mp
import os

import numpy as np
import pytest

from tidal.broker.journal import Journal
from tidal.broker.journal_records import Kind, read_records
from tidal.broker.local_memory import MemoryReader, MemoryUnavailable, frame_address, group_crc
from tidal.broker.submit_memory import SubmitArena, SubmitRing

SIZES = (3, 4096, 70_000, 600_000, 3_000_000)


def _hold(sizes, out, done) -> None:
    """A stand-in for the broker: holds frames and says where they lie, until told to stop."""
    frames = [os.urandom(n) for n in sizes]
    out.put((os.getpid(), [[frame_address(f), len(f), group_crc(f)] for f in frames], frames))
    done.get(timeout=30)


@pytest.fixture
def holder():
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Queue()  # a queue, not an Event: setting one a killed waiter held hangs
    proc = ctx.Process(target=_hold, args=(SIZES, out, done), daemon=True)
    proc.start()
    try:
        yield proc, *out.get(timeout=30)
    finally:
        if proc.is_alive():
            done.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_copies_another_processs_frames_in_the_order_asked_and_checks_them(holder):
    _, pid, refs, frames = holder
    reader = MemoryReader()
    order = [3, 0, 4, 2, 1]
    got = reader.read(pid, [refs[i] for i in order])
    assert [bytes(g) for g in got] == [frames[i] for i in order]
    assert all(g.readonly for g in got)
    # Memory is reused once the views are gone: a second read gives the same bytes.
    del got
    assert [bytes(g) for g in reader.read(pid, refs)] == frames


def test_a_frame_that_does_not_match_its_checksum_or_a_gone_process_is_refused(holder):
    proc, pid, refs, _ = holder
    reader = MemoryReader()
    wrong = [list(r) for r in refs]
    wrong[2][2] ^= 1  # what a reused or freed frame would look like
    with pytest.raises(MemoryUnavailable, match="checksum"):
        reader.read(pid, wrong)
    with pytest.raises(MemoryUnavailable, match="pid"):
        reader.read(pid, [[8, 4096, 0]])  # an address not mapped there
    proc.kill()
    proc.join(10)
    with pytest.raises(MemoryUnavailable, match="pid"):
        reader.read(pid, refs)


def test_the_checksum_is_the_one_the_groups_journal_record_carries(tmp_path):
    j = Journal(tmp_path, fsync="never", direct_io=False)
    j.open()
    frame = os.urandom(5000)
    j.append(Kind.GROUP, frame, group_crc(frame))  # a caller's CRC is written as given ...
    j.append(Kind.GROUP, frame)  # ... and the same as the one the journal computes
    j.close()
    records, _ = read_records(memoryview(j.path.read_bytes()))
    # read_records stops at the first record whose CRC does not match: both are read back
    assert [(kind, bytes(p)) for kind, p in records[1:]] == [(Kind.GROUP, frame)] * 2


def test_frames_in_a_nodes_ring_are_copied_from_the_readers_mapping_or_else_read_as_the_others():
    arena = SubmitArena(1 << 20)
    ring = SubmitRing(arena.offer(os.getpid()))
    spans = []
    for n in (1000, 70_000, 5):
        start, memory = ring.alloc(n)
        memory[:] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        spans.append(arena.spans([[start, n]], 1 << 30)[0])
    refs = []
    rings = []
    for span in spans:
        where, offset = span.ring_location()
        rings = [where]
        refs.append(
            [np.frombuffer(span.buffer, np.uint8).ctypes.data, len(span), group_crc(span.buffer), 0, offset]
        )
    reader = MemoryReader()
    got = reader.read(os.getpid(), refs, rings)
    assert [bytes(g) for g in got] == [bytes(s.buffer) for s in spans] and reader.ring_frames == 3
    other = MemoryReader()  # a ring it cannot map (not the one named): read through the process instead
    got = other.read(os.getpid(), refs, [{**rings[0], "nonce": b"x" * 16}])
    assert [bytes(g) for g in got] == [bytes(s.buffer) for s in spans] and other.ring_frames == 0
